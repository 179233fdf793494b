"""DDP correctness, proved with probes in tests/helpers/probe.py: identical start on all
ranks, per-epoch shuffles, 2 x b == 1 x 2b (also with gradient accumulation), and a NaN on one
rank stopping every rank."""
import json
import os

import pytest
import torch

from conftest import PYTHON, REPO, TORCHRUN, free_port, run, train_args

PROBE = os.path.join(REPO, "tests", "helpers", "probe.py")


def probe_records(prefix, world_size):
    records = []
    for rank in range(world_size):
        with open(f"{prefix}.rank{rank}.json") as f:
            records.append(json.load(f))
    return records


@pytest.fixture(scope="module")
def equivalence_runs(tiny_data, tmp_path_factory):
    """Same data, same seed, fp32, BatchNorm in eval mode, no lr scaling:
    torchrun 2 ranks x batch 2 (rank 1's weights perturbed before the DDP wrap), torchrun
    2 ranks x batch 1 x 2 accumulation steps, and train_single 1 rank x batch 4."""
    root = tmp_path_factory.mktemp("equivalence")
    flags = ["--epochs", "2", "--lr", "0.01", "--workers", "0", "--amp", "off"]
    runs = {"ddp": ["--batch-size", "2"], "accum": ["--batch-size", "1", "--accum-steps", "2"]}
    for name, batch_flags in runs.items():
        env = {"PROBE_BN_EVAL": "1", "PROBE_PERTURB": "1", "PROBE_COUNT_SYNCS": "1", "PROBE_OUT": str(root / name)}
        ddp = run([*TORCHRUN, "--nproc_per_node=2", "--master_port", str(free_port()), PROBE, "multi",
                   *train_args(tiny_data, root / name, *flags, *batch_flags, "--no-scale-lr")], env=env)
        assert ddp.returncode == 0, ddp.stdout + ddp.stderr
    env = {"PROBE_BN_EVAL": "1", "PROBE_OUT": str(root / "single")}
    single = run([PYTHON, PROBE, "single", *train_args(tiny_data, root / "single", *flags, "--batch-size", "4")],
                 env=env)
    assert single.returncode == 0, single.stdout + single.stderr
    return {"root": root, "ddp": probe_records(root / "ddp", 2), "accum": probe_records(root / "accum", 2),
            "single": probe_records(root / "single", 1)[0]}


def test_all_ranks_start_from_rank0_weights(equivalence_runs):
    rank0, rank1 = equivalence_runs["ddp"]
    assert rank1["before_wrap"] != pytest.approx(rank0["before_wrap"], rel=1e-6)  # perturbed
    assert rank1["after_wrap"] == rank0["after_wrap"] == rank0["before_wrap"]  # DDP broadcast rank 0's
    assert equivalence_runs["single"]["after_wrap"] == pytest.approx(rank0["after_wrap"], rel=1e-9)


def test_sample_order_changes_every_epoch_and_ranks_share_nothing(equivalence_runs):
    rank0, rank1 = equivalence_runs["ddp"]
    assert rank0["orders"]["0"] != rank0["orders"]["1"]
    for epoch in ("0", "1"):
        assert len(rank0["orders"][epoch]) == len(rank1["orders"][epoch]) == 18
        assert sorted(rank0["orders"][epoch] + rank1["orders"][epoch]) == list(range(36))
        # one process with the same seed sees the same shuffle: ranks take every other sample
        single = equivalence_runs["single"]["orders"][epoch]
        assert single[0::2] == rank0["orders"][epoch] and single[1::2] == rank1["orders"][epoch]


def test_two_ranks_batch_b_equal_one_rank_batch_2b(equivalence_runs):
    """After the 9 steps of epoch 0 the weights agree to 1e-5. The two sum their gradients in
    a different order (1 x 4 images vs 2 x 2 and an all-reduce), and those rounding
    differences grow with every step, so after 18 steps the bound is 1e-4."""
    assert_same_weights(equivalence_runs["root"], "ddp", "single")
    root = equivalence_runs["root"]
    start = torch.load(root / "single" / "model-0.pth", weights_only=True)
    end = torch.load(root / "single" / "model-1.pth", weights_only=True)
    assert (start["fc.weight"] - end["fc.weight"]).abs().max() > 1e-3  # it did train


def assert_same_weights(root, run_a, run_b):
    for epoch, tolerance in ((0, 1e-5), (1, 1e-4)):
        a = torch.load(root / run_a / f"model-{epoch}.pth", weights_only=True)
        b = torch.load(root / run_b / f"model-{epoch}.pth", weights_only=True)
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=tolerance, msg=key)


def test_accumulation_over_two_ranks_equals_one_rank_batch_4(equivalence_runs):
    """2 ranks x batch 1 x 2 accumulation steps: the same 9 optimizer steps per epoch as
    2 x 2, hence the same weights as 1 x 4; and DDP averaged gradients only once per
    optimizer step (no_sync on the first micro-batch), as often as the run without accumulation."""
    assert_same_weights(equivalence_runs["root"], "accum", "single")
    for accum_rank, plain_rank in zip(equivalence_runs["accum"], equivalence_runs["ddp"]):
        assert accum_rank["gradient_syncs"] == plain_rank["gradient_syncs"] > 0
    with open(equivalence_runs["root"] / "accum" / "metrics.csv") as f:
        assert len(f.readlines()) == 3  # both epochs recorded


def test_nan_on_one_rank_stops_every_rank(tiny_data, tmp_path):
    out = tmp_path / "out"
    result = run([*TORCHRUN, "--nproc_per_node=2", "--master_port", str(free_port()), PROBE, "multi",
                  *train_args(tiny_data, out, "--epochs", "2", "--workers", "0")],
                 env={"PROBE_NAN_RANK": "1"}, timeout=120)
    assert result.returncode != 0
    assert "error: training loss became nan at epoch 0, step 0" in result.stderr
    assert "Traceback" not in result.stdout
    assert not os.path.exists(out / "model-0.pth")
