"""Lose minutes, not epochs: checkpoints inside the epoch, preemption notices, SLURM requeue.

A stop inside an epoch (SIGUSR1 to one rank, SIGKILL after a time-based checkpoint,
torchrun's restart; SIGTERM to torchrun is a cell of tests/test_fault_matrix.py) resumed
with --resume auto must end where a straight run ends: the same weights, EMA and
metrics.csv rows. At another world size the epoch goes on
with each remaining image once. The straight runs are made once and shared.
"""
import os
import shutil
import signal
import stat
import time
from collections import Counter

import pytest
import torch

from conftest import (FAST, PROBE, PYTHON, TORCHRUN, free_port, metrics_without_timing, parse_flags, probe_records,
                      read_metrics, run, train_args)

# 36 training images; batch 2: 9 steps an epoch at world size 2, 18 in one process.
# --print-freq 3 with --accum-steps 2: the check at step 2 falls on the first micro-batch of
# the group (2, 3), so the save waits for step 3, the group's optimizer step.
RECIPE = ["--epochs", "2", "--batch-size", "2", "--workers", "1", "--print-freq", "3", "--accum-steps", "2",
          "--mixup-alpha", "0.4", "--model-ema", "--model-ema-decay", "0.9", "--sampler", "balanced"]
DDP_STEPS = 9


def torchrun(*flags, restarts=0):
    return [*TORCHRUN, "--nproc_per_node=2", f"--max-restarts={restarts}", "--master_port", str(free_port()), PROBE,
            "multi", *flags]


def assert_same_run(out, reference, epochs=2):
    """The same metrics rows (timing aside), final weights and EMA (1e-6) as ``reference``."""
    assert metrics_without_timing(out) == metrics_without_timing(reference)
    for name in (f"model-{epoch}.pth" for epoch in range(epochs)):  # the epoch before the stop's kept too
        got, expected = (torch.load(d / name, weights_only=True) for d in (out, reference))
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-6, msg=key)
    got, expected = (torch.load(d / "checkpoint.pth", weights_only=True) for d in (out, reference))
    assert got["position"] is None and got["epoch"] == epochs - 1
    if expected["model_ema"] is not None:
        for key, value in expected["model_ema"]["weights"].items():
            torch.testing.assert_close(got["model_ema"]["weights"][key], value, rtol=0, atol=1e-6, msg=key)


def expected_stop_step(signal_step, print_freq=3, accum=2, steps=DDP_STEPS):
    """Steps done at the save: the next check step (every print_freq) at or after the signal,
    then the end of its accumulation group."""
    check = next(s for s in range(signal_step, steps) if (s + 1) % print_freq == 0)
    return check - check % accum + accum


@pytest.fixture(scope="module")
def straight(tiny_data, tmp_path_factory):
    """Uninterrupted runs, made the first time a test asks: "ddp" (RECIPE, torchrun, 2
    processes) and "single" (a model with dropout, so that the generators must resume too)."""
    done = {}

    def reference(kind):
        if kind not in done:
            out = tmp_path_factory.mktemp(f"straight-{kind}") / "out"
            if kind == "ddp":
                result = run(torchrun(*train_args(tiny_data, out, *RECIPE)), env={"PROBE_OUT": f"{out}.probe"})
            else:
                result = run([PYTHON, PROBE, "single", *train_args(tiny_data, out, *SINGLE)],
                             env={"PROBE_OUT": f"{out}.probe"})
            assert result.returncode == 0, result.stdout + result.stderr
            done[kind] = out
        return done[kind]

    return reference


SINGLE = ["--epochs", "2", "--batch-size", "2", "--workers", "0", "--print-freq", "4", "--model", "mobilenet_v3_small",
          "--checkpoint-every", "0"]


def test_sigusr1_to_one_rank_saves_every_rank_at_the_same_step_and_the_resume_equals_a_straight_run(
        tiny_data, tmp_path, straight):
    """SIGUSR1 (SLURM's --signal) reaches rank 1 alone, inside an accumulation group of epoch
    1: both ranks stop at the same step, rank 0 saves it, both exit 75; --resume auto at the
    same world size equals the straight run. Then the same checkpoint resumed by one process
    trains each of the epoch's remaining images exactly once."""
    out, bin_dir = tmp_path / "out", fake_scontrol(tmp_path / "bin")
    signal_step = 1  # epoch 1's second step (rank 1's step 10 of its life)
    stopped = run(torchrun(*train_args(tiny_data, out, *RECIPE, "--requeue", "--resume", "auto")),
                  env={"PROBE_OUT": f"{out}.probe", "PROBE_SIGNAL": f"SIGUSR1:{DDP_STEPS + signal_step}:self:1",
                       "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "77",
                       "PROBE_GC_OFF": "1"})
    records = probe_records(f"{out}.probe", 2)
    assert [r["exit_code"] for r in records] == [75, 75], stopped.stdout + stopped.stderr
    # the stop's error is dropped before the exit, with the DDP model (and its process group) that its frames held
    assert [r["ddp_at_exit"] for r in records] == [0, 0]
    assert f"stopped at epoch 1, step {expected_stop_step(signal_step)} on a preemption notice (received by another " \
        "process), and saved the checkpoint" in stopped.stderr and "--resume auto" in stopped.stderr
    checkpoint = torch.load(out / "checkpoint.pth", weights_only=True)
    position = checkpoint["position"]
    steps_done = expected_stop_step(signal_step)
    assert (checkpoint["epoch"], position["epoch"], position["step"]) == (0, 1, steps_done)
    assert (position["done"], position["end"], position["order_world_size"]) == (steps_done * 2 * 2, 36, 2)
    assert [r["steps"] for r in records] == [DDP_STEPS + steps_done] * 2  # no rank trained a step more
    assert scontrol_calls(bin_dir) == "requeue 77\n"  # rank 0 alone asked SLURM
    assert len(read_metrics(out)) == 1  # epoch 0's row; epoch 1 is not finished
    # another world size: one process goes on from a copy of the checkpoint
    other = tmp_path / "one-process"
    other.mkdir()
    for name in ("checkpoint.pth", "args.json", "class_indices.json", "metrics.csv"):
        (other / name).write_bytes((out / name).read_bytes())
    one = run([PYTHON, PROBE, "single", *train_args(tiny_data, other, *RECIPE, "--resume", "auto")],
              env={"PROBE_OUT": f"{other}.probe"})
    assert one.returncode == 0, one.stdout + one.stderr
    assert "the epoch was begun by 2 processes, this run has 1" in one.stdout
    trained_before = [i for r in records for i in r["orders"]["1"][:steps_done * 2]]
    trained_after = probe_records(f"{other}.probe", 1)[0]["orders"]["1"]
    whole_epoch = [i for r in records for i in r["orders"]["1"]]  # the epoch the two processes began
    assert len(trained_after) == 36 - steps_done * 4
    assert Counter(trained_before + trained_after) == Counter(whole_epoch)  # none twice, none skipped
    # the same world size: torchrun again, --resume auto
    resumed = run(torchrun(*train_args(tiny_data, out, *RECIPE, "--resume", "auto")),
                  env={"PROBE_OUT": f"{out}.resumed", "PROBE_GC_OFF": "1"})
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"inside epoch 1: {steps_done * 4} of its 36 training images done" in resumed.stdout
    # no reference cycle keeps the DDP model past main(): its process group goes with it, not at
    # the interpreter's exit (where gloo's teardown aborts now and then)
    assert [(r["ddp_after_main"], r["ddp_at_exit"]) for r in probe_records(f"{out}.resumed", 2)] == [(0, 0)] * 2
    assert_same_run(out, straight("ddp"))


def test_torchrun_restarts_a_killed_worker_from_the_checkpoint_inside_the_epoch(tiny_data, tmp_path, straight):
    """--checkpoint-every saves at every check step here; rank 1 is killed (SIGKILL) in epoch
    1; torchrun --max-restarts starts both again, and --resume auto goes on from inside the
    epoch: the end equals the straight run."""
    out = tmp_path / "out"
    job = run(torchrun(*train_args(tiny_data, out, *RECIPE, "--checkpoint-every", "0.00001", "--resume", "auto"),
                       restarts=1),
              env={"PROBE_SIGNAL": f"SIGKILL:{DDP_STEPS + 7}:self:1"})
    assert job.returncode == 0, job.stdout + job.stderr
    assert "resuming from" in job.stdout and "inside epoch 1: 24 of its 36 training images done" in job.stdout
    assert job.stdout.count("checkpoint inside epoch 1") >= 2  # before the kill, and after the restart
    assert_same_run(out, straight("ddp"))


def test_sigkill_after_a_time_based_checkpoint_then_resume_equals_a_straight_run(tiny_data, tmp_path, straight):
    """One process, a model with dropout: --checkpoint-every saves inside epoch 1, SIGKILL
    ends the process mid-epoch, twice (the second time in the resumed epoch), and --resume
    auto continues from the last save exactly; the run clock goes on from the checkpoint's,
    and the epoch's seconds count those before the stops."""
    out = tmp_path / "out"
    flags = [*SINGLE[:-2], "--checkpoint-every", "0.00001"]  # SINGLE ends with --checkpoint-every 0
    killed = run([PYTHON, PROBE, "single", *train_args(tiny_data, out, *flags)],
                 env={"PROBE_SIGNAL": "SIGKILL:27:self"})  # epoch 1, step 9
    assert killed.returncode == -signal.SIGKILL
    checkpoint = torch.load(out / "checkpoint.pth", weights_only=True)
    position = checkpoint["position"]
    # one process decides at every step: the save after step 8, the last before the kill
    assert (position["epoch"], position["step"], position["done"]) == (1, 9, 18)
    epoch0_clock = float(read_metrics(out)[0]["run_seconds"])
    assert epoch0_clock <= position["run_seconds"]
    again = run([PYTHON, PROBE, "single", *train_args(tiny_data, out, *flags, "--resume", "auto")],
                env={"PROBE_SIGNAL": "SIGKILL:4:self"})  # this session's fifth step: epoch 1, step 13
    assert again.returncode == -signal.SIGKILL
    position = torch.load(out / "checkpoint.pth", weights_only=True)["position"]
    assert (position["epoch"], position["step"], position["done"]) == (1, 13, 26)
    started = time.monotonic()
    resumed = run([PYTHON, PROBE, "single", *train_args(tiny_data, out, *flags, "--resume", "auto")])
    session = time.monotonic() - started
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert_same_run(out, straight("single"))
    rows = read_metrics(out)
    assert float(rows[0]["run_seconds"]) == epoch0_clock  # the first session's row, kept
    # epoch 1's clock: the earlier sessions' share up to the last save, plus this session's training
    run1 = float(rows[1]["run_seconds"])
    assert position["run_seconds"] < run1 < position["run_seconds"] + session
    # and its seconds: those before the last save, plus this session's (which the run clock also counts)
    assert float(rows[1]["epoch_seconds"]) > position["epoch_seconds"] + (run1 - position["run_seconds"]) - 0.1


def fake_scontrol(folder):
    """An scontrol that writes its arguments to calls.txt and succeeds."""
    folder.mkdir()
    path = folder / "scontrol"
    path.write_text(f"#!/bin/sh\necho \"$@\" >> {folder / 'calls.txt'}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return folder


def scontrol_calls(folder):
    """What the fake scontrol was called with, a line a call ("" for none)."""
    path = folder / "calls.txt"
    return path.read_text() if path.exists() else ""


def test_requeue_asks_slurm_once_with_the_job_id_after_the_save(tiny_data, tmp_path):
    """--requeue: SIGUSR1 (one process), a second notice during the save changes nothing,
    then scontrol requeue $SLURM_JOB_ID, exit 75; --resume auto continues."""
    out, bin_dir = tmp_path / "out", fake_scontrol(tmp_path / "bin")
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "PROBE_SIGNAL": "SIGUSR1:22:self", "PROBE_SIGNAL_IN_SAVE": "SIGTERM", "PROBE_OUT": f"{out}.probe"}
    flags = train_args(tiny_data, out, *SINGLE, "--requeue", "--resume", "auto")
    stopped = run([PYTHON, PROBE, "single", *flags], env=env)
    assert probe_records(f"{out}.probe", 1)[0]["exit_code"] == 75, stopped.stdout + stopped.stderr
    assert scontrol_calls(bin_dir) == "requeue 4242\n"
    assert "requeued SLURM job 4242" in stopped.stderr
    position = torch.load(out / "checkpoint.pth", weights_only=True)["position"]
    assert (position["epoch"], position["step"]) == (1, 5)  # the step after the signal's (one process)
    env.pop("PROBE_SIGNAL")
    env.pop("PROBE_SIGNAL_IN_SAVE")
    resumed = run([PYTHON, PROBE, "single", *flags], env=env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert scontrol_calls(bin_dir) == "requeue 4242\n"  # a run that ends is not requeued
    assert len(read_metrics(out)) == 2


def test_sigkill_during_the_save_leaves_the_previous_checkpoint(tiny_data, tmp_path):
    """A kill while checkpoint.pth is being written inside the epoch: the previous one (epoch
    0's end) is intact and --resume auto can read it."""
    out = tmp_path / "out"
    killed = run([PYTHON, PROBE, "single", *train_args(tiny_data, out, *SINGLE)],
                 env={"PROBE_SIGNAL": "SIGTERM:22:self", "PROBE_SIGNAL_IN_SAVE": "SIGKILL"})
    assert killed.returncode == -signal.SIGKILL
    checkpoint = torch.load(out / "checkpoint.pth", weights_only=True)
    assert checkpoint["epoch"] == 0 and checkpoint["position"] is None


# --- without a process -------------------------------------------------------------------------


def test_requeue_refuses_outside_slurm_or_without_resume_auto(monkeypatch, tmp_path):
    from multi_train_utils.errors import UserError

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(UserError, match="--requeue: SLURM_JOB_ID is not set"):
        parse_flags(False, "--requeue", "--resume", "auto")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("PATH", str(fake_scontrol(tmp_path / "bin")))
    with pytest.raises(UserError, match="--requeue needs --resume auto"):
        parse_flags(True, "--requeue")
    with pytest.raises(UserError, match="--requeue needs --resume auto"):
        parse_flags(True, "--requeue", "--resume", str(tmp_path / "checkpoint.pth"))
    assert parse_flags(True, "--requeue", "--resume", "auto").requeue
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UserError, match="scontrol is not on PATH"):
        parse_flags(True, "--requeue", "--resume", "auto")


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("balanced", [False, True])
def test_the_padded_order_is_what_the_ranks_train(world_size, balanced):
    """Rank r's batches of a whole epoch are positions r, r + W, ... of padded_order, for 11
    images (padding at 2 and 3 ranks)."""
    from multi_train_utils.loaders import BalancedDistributedSampler
    from multi_train_utils.loaders import EpochBatchSampler, padded_order
    from torch.utils.data import DistributedSampler

    labels = [0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4]
    for rank in range(world_size):
        sampler = (BalancedDistributedSampler(labels, world_size, rank, seed=5) if balanced else
                   DistributedSampler(labels, world_size, rank, seed=5))
        sampler.set_epoch(3)
        batches = EpochBatchSampler(sampler, 2, world_size=world_size, rank=rank)
        order = padded_order(sampler, world_size)
        assert len(order) == -(-11 // world_size) * world_size
        trained = [index for batch in batches for _, index in batch]
        assert trained == order[rank::world_size][:len(trained)]
        assert len(trained) == len(sampler) // 2 * 2


@pytest.mark.parametrize("to_world", [1, 2, 3, 4, 5])
def test_the_rest_of_an_epoch_at_any_world_size_is_each_image_once(to_world):
    """An epoch begun by 2 ranks (batch 3, 37 images: 6 steps of 6 positions), stopped after 2
    steps, resumed by 1 to 5 ranks: every remaining position once, every rank the same number
    of steps, each at least 2 images (3 ranks: a last step of 6, 2 each; 5 ranks: the 9 left
    after a step of 15 are fewer than 2 each, and join it)."""
    from multi_train_utils.loaders import EpochBatchSampler, EpochPosition
    from torch.utils.data import DistributedSampler

    data = list(range(37))
    position = EpochPosition(epoch=1, done=12, end=36, order_world_size=2, step=2, train_images=37)
    per_rank = []
    for rank in range(to_world):
        sampler = DistributedSampler(data, to_world, rank, seed=0)
        sampler.set_epoch(1)
        batches = EpochBatchSampler(sampler, 3, world_size=to_world, rank=rank)
        batches.resume_at(position)
        per_rank.append([[index for _, index in batch] for batch in batches])
        assert len(batches) == len(per_rank[-1])
    assert len({len(b) for b in per_rank}) == 1  # the same number of steps on every rank
    assert min(len(batch) for b in per_rank for batch in b) >= 2
    whole = DistributedSampler(data, 1, 0, seed=0)
    whole.set_epoch(1)
    order = list(whole) + list(whole)[:1]  # padded for 2 ranks
    remaining = Counter(index for b in per_rank for batch in b for index in batch)
    assert remaining == Counter(order[12:36])
    assert len(per_rank[0]) == {1: 8, 2: 4, 3: 3, 4: 2, 5: 1}[to_world]


def test_a_rest_of_fewer_than_2_images_a_rank_is_left_out_with_no_step_before():
    from multi_train_utils.loaders import step_bounds

    assert step_bounds(30, 36, 3, 4) == []  # 6 images for 4 ranks, a step of 12: no step before to join
    assert step_bounds(30, 36, 3, 3) == [30, 36]  # 2 each
    assert step_bounds(0, 30, 3, 4) == [0, 12, 30]  # the last 6 join the step before


def test_the_run_clock_goes_on_from_the_checkpoint_and_the_summary_says_when_the_target_was_reached():
    from multi_train_utils.checkpoint import RunClock, TrainState, restore_training_state
    from multi_train_utils.recorder import time_to_target
    from multi_train_utils.run_files import METRICS_HEADER
    from multi_train_utils.single_label import SingleLabel

    model = torch.nn.Linear(2, 2)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    checkpoint = {"optimizer": state.optimizer.state_dict(), "scaler": None, "rng": {}, "epoch": 3,
                  "best_value": 0.5, "best_accuracy": 0.5, "best_epoch": 2, "best_source": "model",
                  "best_confusion": None, "best_report": None, "position": None, "run_seconds": 125.0}
    restore_training_state(state, checkpoint)
    time.sleep(0.05)
    assert state.clock.seconds() == 125.0  # not running before the epochs begin (start-up not counted)
    state.clock.start()
    assert 125.0 <= state.clock.seconds() < 126.0  # not the time since the checkpoint was written
    assert RunClock().seconds() == 0.0

    def row(epoch, accuracy, ema, seconds):
        values = dict.fromkeys(METRICS_HEADER, "")
        values.update(epoch=str(epoch), val_accuracy=accuracy, ema_val_accuracy=ema, run_seconds=seconds)
        return [values[k] for k in METRICS_HEADER]

    rows = [row(0, "0.5", "", "60.0"), row(1, "0.69", "0.7", "130.0"), row(2, "0.9", "", "200.0")]
    assert time_to_target(0.7, rows, 2, SingleLabel(), METRICS_HEADER) == (
        "run clock: the best epoch (2) after 3m20s of training; val accuracy 0.7 first reached at epoch 1, after 2m10s")
    assert time_to_target(0.95, rows, 2, SingleLabel(), METRICS_HEADER).endswith(
        "val accuracy never reached --target-accuracy 0.95")
    assert time_to_target(0.5, rows, 2, SingleLabel(), METRICS_HEADER).endswith(
        "val accuracy 0.5 first reached at epoch 0, after 1m00s")  # the first epoch, exactly at the target
    # a run resumed from an earlier version's checkpoint: its epochs before have no run_seconds
    rows[1][METRICS_HEADER.index("run_seconds")] = ""
    assert time_to_target(0.7, rows, 2, SingleLabel(), METRICS_HEADER) == (
        "run clock: the best epoch (2) after 3m20s of training; val accuracy 0.7 first reached at epoch 1")


def test_the_time_to_save_counts_from_the_last_checkpoint(monkeypatch):
    """--checkpoint-every 2: due 2 minutes after the last checkpoint (exactly then), again 2
    minutes after a save inside the epoch or an epoch's; never with 0."""
    from multi_train_utils import train_eval_utils as mid_epoch
    from multi_train_utils.loaders import EpochPosition

    now = [1000.0]
    monkeypatch.setattr(mid_epoch.time, "monotonic", lambda: now[0])
    written = []
    saves, never = mid_epoch.MidEpochCheckpoints(2.0, written.append), mid_epoch.MidEpochCheckpoints(0, written.append)
    now[0] += 119.5
    assert saves.wishes() == [0.0, 0.0]
    now[0] += 0.5
    assert saves.wishes() == [1.0, 0.0] and never.wishes() == [0.0, 0.0]
    position = EpochPosition(epoch=0, done=4, end=36, order_world_size=1, step=2, train_images=36)
    assert saves.save(position, torch.tensor(3.0), notice=False)
    assert written == [position] and position.loss_sums == [3.0]
    assert saves.wishes() == [0.0, 0.0]  # the clock starts again at the save
    now[0] += 119.0
    assert saves.wishes() == [0.0, 0.0]
    saves.saved()  # an epoch's checkpoint
    now[0] += 100.0
    assert saves.wishes() == [0.0, 0.0]
    now[0] += 20.0
    assert saves.wishes() == [1.0, 0.0]
    now[0] += 1e6
    assert never.wishes() == [0.0, 0.0]


def test_the_fault_advice_names_the_checkpoint_inside_the_epoch(tmp_path):
    """A fault after a save inside epoch 0 names that checkpoint as the intact one (not "no
    checkpoint was written yet")."""
    from multi_train_utils.checkpoint import TrainState
    from multi_train_utils.loaders import EpochPosition
    from multi_train_utils.recorder import RunRecorder

    model = torch.nn.Linear(2, 2)
    recorder = RunRecorder.__new__(RunRecorder)
    recorder.__dict__.update(state=TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1)), rows=[],
                             output_dir=str(tmp_path), flags={}, classes=["a", "b"], file_list=None,
                             world_size=1, log_dir=None, position=None, saved_epoch=None)
    assert recorder.resume_advice() == "no checkpoint was written yet"
    recorder._save_inside_epoch(EpochPosition(epoch=0, done=8, end=36, order_world_size=2, step=2, train_images=36))
    assert recorder.resume_advice() == (f"{tmp_path / 'checkpoint.pth'} (inside epoch 0, 8 of 36 images) is intact: "
                                        "continue from it with --resume auto")
    assert torch.load(tmp_path / "checkpoint.pth", weights_only=True)["position"]["done"] == 8


def test_a_notice_at_an_epochs_last_step_stops_after_its_checkpoint_and_requeues(tiny_data, tmp_path):
    """SIGUSR1 in epoch 0's last step (one process, --requeue): no save inside the epoch, the
    epoch is validated and saved, then the run stops with 75 and SLURM is asked to requeue."""
    out, bin_dir = tmp_path / "out", fake_scontrol(tmp_path / "bin")
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "31",
           "PROBE_SIGNAL": "SIGUSR1:17:self", "PROBE_OUT": f"{out}.probe"}
    stopped = run([PYTHON, PROBE, "single", *train_args(tiny_data, out, *SINGLE, "--requeue", "--resume", "auto")],
                  env=env)
    assert probe_records(f"{out}.probe", 1)[0]["exit_code"] == 75, stopped.stdout + stopped.stderr
    assert "stopped after an epoch's checkpoint on a preemption notice (SIGUSR1)" in stopped.stderr
    assert (out / "checkpoint.pth").exists() and len(read_metrics(out)) == 1  # epoch 0 saved before the stop
    checkpoint = torch.load(out / "checkpoint.pth", weights_only=True)
    assert checkpoint["epoch"] == 0 and checkpoint["position"] is None and len(read_metrics(out)) == 1
    assert scontrol_calls(bin_dir) == "requeue 31\n"


def test_a_training_set_that_grew_starts_the_interrupted_epoch_again(tiny_data, tmp_path):
    """Images added between a stop inside epoch 1 and the resume: the epoch starts again from
    its first step, with a warning, and trains every image of the new set's order."""
    train = tmp_path / "train"
    shutil.copytree(tiny_data["train"], train)
    out = tmp_path / "out"
    flags = ["--data-path", str(train), "--val-path", tiny_data["val"], "--check-images", *FAST,
             "--output-dir", str(out), "--log-dir", str(out) + "-tb", *SINGLE]
    stopped = run([PYTHON, PROBE, "single", *flags], env={"PROBE_SIGNAL": "SIGTERM:22:self"})
    assert stopped.returncode == 75, stopped.stderr
    daisy = sorted((train / "daisy").glob("*.jpg"))[0]
    for name in ("added_1.jpg", "added_2.jpg"):
        shutil.copy(daisy, train / "daisy" / name)
    resumed = run([PYTHON, PROBE, "single", *flags, "--resume", "auto"], env={"PROBE_OUT": f"{out}.probe"})
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert ("the checkpoint stopped inside epoch 1 of 36 training images, the data now has 38: epoch 1 starts again "
            "from its first step") in resumed.stdout
    assert sorted(probe_records(f"{out}.probe", 1)[0]["orders"]["1"]) == list(range(38))
