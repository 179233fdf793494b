"""DDP correctness, proved with probes in tests/helpers/probe.py: identical start on all
ranks, per-epoch shuffles, 2 x b == 1 x 2b (also with gradient accumulation), and a NaN on one
rank stopping every rank."""
import os

import pytest
import torch

from conftest import PROBE, PYTHON, probe_records, read_metrics, run, run_ranks, train_args


# name: (hyper-parameters, float64?, {run: batch flags})
EQUIVALENCE_SETS = {
    "fp64": (["--lr", "0.01"], True, {"ddp": ["--batch-size", "2"], "accum": ["--batch-size", "1", "--accum-steps", "2"],
                                      "single": ["--batch-size", "4"]}),
    "fp64-wd0": (["--lr", "0.05", "--weight-decay", "0"], True, {"ddp": ["--batch-size", "2"],
                                                                "single": ["--batch-size", "4"]}),
    "fp32": (["--lr", "0.01"], False, {"ddp": ["--batch-size", "2"], "single": ["--batch-size", "4"]}),
}


@pytest.fixture(scope="module")
def equivalence_runs(tiny_data, tmp_path_factory):
    """Same data, same seed, no autocast, BatchNorm in eval mode, no lr scaling, 2 epochs:
    2 ranks x batch 2 (rank 1's weights perturbed before the DDP wrap), 2 ranks x batch 1 x
    2 accumulation steps, and train_single 1 rank x batch 4; in float64
    at two settings (there the paths must agree to rounding, 1e-12) and in float32."""
    root = tmp_path_factory.mktemp("equivalence")
    results = {}
    for name, (hyper, float64, runs) in EQUIVALENCE_SETS.items():
        flags = ["--epochs", "2", "--workers", "0", "--amp", "off", *hyper]
        for kind, batch_flags in runs.items():
            out = root / name / kind
            env = {"PROBE_BN_EVAL": "1", "PROBE_OUT": str(out), "PROBE_FLOAT64": "1" if float64 else "0"}
            if kind == "single":
                cmd = [PYTHON, PROBE, "single"]
            else:
                env.update(PROBE_PERTURB="1", PROBE_COUNT_SYNCS="1")
                cmd = [PYTHON, PROBE, "multi", "--no-scale-lr"]
            cmd += train_args(tiny_data, out, *flags, *batch_flags)
            # the 2 ranks as srun starts them, one process each (torchrun itself: test_launch_modes)
            results[name, kind] = run(cmd, env=env) if kind == "single" else run_ranks(2, cmd, env=env)
    return {"root": root, "results": results}


def probes(equivalence_runs, name, kind):
    """The probe records of one run, which must have finished (checked here, in the test that
    reads it, so that a run that fails fails that test's assertion)."""
    result = equivalence_runs["results"][name, kind]
    assert result.returncode == 0, result.stdout + result.stderr
    return probe_records(equivalence_runs["root"] / name / kind, 1 if kind == "single" else 2)


def test_all_ranks_start_from_rank0_weights(equivalence_runs):
    rank0, rank1 = probes(equivalence_runs, "fp64", "ddp")
    (single,) = probes(equivalence_runs, "fp64", "single")
    assert rank1["before_wrap"] != pytest.approx(rank0["before_wrap"], rel=1e-6)  # perturbed
    assert rank1["after_wrap"] == rank0["after_wrap"] == rank0["before_wrap"]  # DDP broadcast rank 0's
    assert single["after_wrap"] == pytest.approx(rank0["after_wrap"], rel=1e-12)


def test_sample_order_changes_every_epoch_and_ranks_share_nothing(equivalence_runs):
    rank0, rank1 = probes(equivalence_runs, "fp64", "ddp")
    (single,) = probes(equivalence_runs, "fp64", "single")
    assert rank0["orders"]["0"] != rank0["orders"]["1"]
    for epoch in ("0", "1"):
        assert len(rank0["orders"][epoch]) == len(rank1["orders"][epoch]) == 18
        assert sorted(rank0["orders"][epoch] + rank1["orders"][epoch]) == list(range(36))
        # one process with the same seed sees the same shuffle: ranks take every other sample
        assert single["orders"][epoch][0::2] == rank0["orders"][epoch]
        assert single["orders"][epoch][1::2] == rank1["orders"][epoch]


def assert_same_run(equivalence_runs, name, run_a, run_b, tolerances):
    """Weights of both epochs within ``tolerances`` (epoch 0, epoch 1), and the same train_loss
    in metrics.csv (the DDP one averaged over ranks, not summed)."""
    root = equivalence_runs["root"]
    probes(equivalence_runs, name, run_a), probes(equivalence_runs, name, run_b)  # both finished
    for epoch, tolerance in enumerate(tolerances):
        a = torch.load(root / name / run_a / f"model-{epoch}.pth", weights_only=True)
        b = torch.load(root / name / run_b / f"model-{epoch}.pth", weights_only=True)
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=tolerance, msg=key)
    losses = [[float(r["train_loss"]) for r in read_metrics(root / name / kind)] for kind in (run_a, run_b)]
    assert len(losses[0]) == 2 and losses[0] == pytest.approx(losses[1], abs=2e-6), losses
    start = torch.load(root / name / run_b / "model-0.pth", weights_only=True)
    end = torch.load(root / name / run_b / "model-1.pth", weights_only=True)
    moved = max(float((start[k] - end[k]).abs().max()) for k in start if start[k].is_floating_point())
    assert moved > 1e-3, moved  # it did train


@pytest.mark.parametrize("name", ["fp64", "fp64-wd0"])
def test_two_ranks_batch_b_equal_one_rank_batch_2b_in_float64(equivalence_runs, name):
    """In float64 the two paths compute the same thing: 1e-12 after 18 steps, at the default
    weight decay and lr 0.01 and at weight decay 0 and lr 0.05 (where float32 rounding,
    amplified by training, reaches about 1e-4)."""
    assert_same_run(equivalence_runs, name, "ddp", "single", (1e-12, 1e-12))
    weights = torch.load(equivalence_runs["root"] / name / "ddp" / "model-1.pth", weights_only=True)
    assert weights["fc.weight"].dtype == torch.float64


def test_two_ranks_batch_b_equal_one_rank_batch_2b_in_float32(equivalence_runs):
    """float32 at the defaults: the two sum their gradients in a different order (1 x 4
    images vs 2 x 2 and an all-reduce); 1e-5 after the 9 steps of epoch 0, 1e-4 after 18."""
    assert_same_run(equivalence_runs, "fp32", "ddp", "single", (1e-5, 1e-4))


def test_accumulation_over_two_ranks_equals_one_rank_batch_4(equivalence_runs):
    """2 ranks x batch 1 x 2 accumulation steps: the same 9 optimizer steps per epoch as
    2 x 2, hence the same weights as 1 x 4; and DDP averaged gradients only once per
    optimizer step (no_sync on the first micro-batch), as often as the run without accumulation."""
    assert_same_run(equivalence_runs, "fp64", "accum", "single", (1e-12, 1e-12))
    for accum_rank, plain_rank in zip(probes(equivalence_runs, "fp64", "accum"),
                                      probes(equivalence_runs, "fp64", "ddp")):
        assert accum_rank["gradient_syncs"] == plain_rank["gradient_syncs"] > 0


def assert_nan_stops_both_ranks_naming_step_1(tiny_data, tmp_path, nan_ranks, nan_steps):
    """Two ranks whose loss values become NaN (gradients finite) on ``nan_ranks`` at their
    ``nan_steps``; the loss is checked every 3 steps. Both ranks stop at the first check
    (after step 2) with one message, which names step 1; nothing of the epoch is saved."""
    out = tmp_path / "out"
    result = run_ranks(2, [PYTHON, PROBE, "multi",
                           *train_args(tiny_data, out, "--epochs", "2", "--workers", "0", "--print-freq", "3",
                                       "--dist-timeout", "20")],  # a rank left waiting fails in seconds, not hours
                       env={"PROBE_NAN_RANK": nan_ranks, "PROBE_NAN_STEP": nan_steps,
                            "PROBE_OUT": str(tmp_path / "probe")},
                       timeout=120)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors == ["error: training loss became nan at epoch 0, step 1; lower --lr, add --warmup-epochs or "
                      "--clip-grad, or check the data"], result.stderr
    assert "Traceback" not in result.stdout
    assert [r["steps"] for r in probe_records(tmp_path / "probe", 2)] == [3, 3]
    assert not os.path.exists(out / "model-0.pth")


def test_nan_on_one_rank_stops_every_rank_at_the_same_step(tiny_data, tmp_path):
    """Rank 1's loss value becomes NaN at its step 1 while its gradients stay finite, so the
    NaN cannot reach rank 0 through the gradient all-reduce: only a check over all ranks
    sees it. Both ranks stop at the same step, the next loss check (--print-freq 3: after
    step 2), with one message naming step 1; nothing of the epoch is saved."""
    assert_nan_stops_both_ranks_naming_step_1(tiny_data, tmp_path, "1", "1")


def test_nan_on_both_ranks_at_different_steps_names_the_earliest(tiny_data, tmp_path):
    """Rank 0's loss becomes NaN at its step 2, rank 1's at its step 1, both before the check
    after step 2: the one message names step 1, the first step at which any rank's loss was
    non-finite, not the step rank 0 saw; both ranks stop at that check."""
    assert_nan_stops_both_ranks_naming_step_1(tiny_data, tmp_path, "0,1", "2,1")
