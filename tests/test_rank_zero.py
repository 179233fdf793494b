"""What only rank 0 does (docs/multi-gpu.md, docs/outputs.md): in a job of two processes, rank 0
prints each line once and writes every file of --output-dir and of the TensorBoard folder;
rank 1 prints nothing and writes nothing there. One real torchrun (gloo) with --plots; the
probe's audit hook records the files each process writes, whichever library writes them."""
import glob
import os

import pytest

from conftest import PROBE, TORCHRUN, free_port, probe_records, run, train_args

EPOCHS = 2
SEPARATOR = "-" * 78
TORCHRUN_BANNER = "Setting OMP_NUM_THREADS environment variable for each process"


@pytest.fixture(scope="module")
def two_ranks(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks") / "out"
    result = run([*TORCHRUN, "--nproc_per_node=2", "--master_port", str(free_port()), PROBE, "multi",
                  *train_args(tiny_data, out, "--epochs", str(EPOCHS), "--workers", "0", "--plots", "--keep-last", "1")],
                 env={"PROBE_OUT": f"{out}.probe", "PROBE_WRITES": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    return {"out": str(out), "tb": f"{out}-tb", "result": result, "probe": probe_records(f"{out}.probe", 2)}


def under(paths, folder):
    return sorted(p for p in paths if p.startswith(folder + os.sep))


def test_rank_1_writes_nothing_into_the_run_and_rank_0_wrote_each_of_its_files(two_ranks, tiny_data):
    rank0, rank1 = two_ranks["probe"]
    for folder in (two_ranks["out"], two_ranks["tb"], tiny_data["root"]):
        assert under(rank1["writes"], folder) == [], folder
    kept = sorted(glob.glob(os.path.join(two_ranks["out"], "*"))) + sorted(glob.glob(two_ranks["tb"] + "/*/*"))
    assert {os.path.basename(p) for p in kept} >= {
        "train.log", "metrics.csv", "args.json", "class_indices.json", "model-best.pth", "checkpoint.pth",
        f"model-{EPOCHS - 1}.pth", "class_distribution.png", "batch_preview.png", "curves.png",
        "confusion_matrix.png", "most_confused.png", "confusion_matrix.csv"}
    missing = [p for p in kept if p not in rank0["writes"]]
    assert missing == []  # every file there is rank 0's
    assert not under(rank0["writes"], tiny_data["root"])  # nor does rank 0 write into the data


def test_each_line_of_a_two_process_run_is_printed_once(two_ranks):
    lines = [line.split("\r")[-1] for line in two_ranks["result"].stdout.split("\n") if line and line != SEPARATOR]
    # a bar drawn off a terminal: a line for each redraw (its start once, its end once or twice)
    bars = [line for line in lines if line.startswith(("[valid]", "[train epoch"))]
    repeated = sorted({line for line in lines if lines.count(line) > 1 and line not in bars})
    assert repeated == []
    for epoch in range(EPOCHS):
        assert sum(line.startswith(f"[train epoch {epoch}]:   0%") for line in bars) == 1, epoch
        assert sum(line.startswith(f"[epoch {epoch}] train_loss") for line in lines) == 1, epoch
    assert sum(line.startswith("[valid]:   0%") for line in bars) == EPOCHS  # one validation bar an epoch
    assert sum(line.startswith("world size: 2") for line in lines) == 1
    # stderr: only torchrun's own banner, no process's warning or bar
    own = [line for line in two_ranks["result"].stderr.splitlines() if line.strip("*").strip()
           and TORCHRUN_BANNER not in line]
    assert own == []
