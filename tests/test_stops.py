"""Stops where clusters really stop jobs: the requeue done before any rank exits, a refusal or a
failed save on one rank reaching every rank in seconds, a loader worker that hangs or dies,
the schedule after a resume at another batch size, the random state of the GPU in use, and
the smaller promises around them (the port, uneven SLURM nodes, --eval-only's precision).
The fault matrix itself is tests/test_fault_matrix.py.
"""
import concurrent.futures
import fcntl
import os
import signal
import stat
import time

import pytest
import torch

from conftest import (PROBE, PYTHON, REPO, TORCHRUN, ScriptProcess, free_port, kill_tree, parse_flags, read_metrics, run,
                      run_ranks, started_early, train_args)

SHORT = ["--epochs", "2", "--workers", "0", "--print-freq", "1", "--checkpoint-every", "0"]


def rank_env(world_size, rank, port, extra=None):
    return dict(extra or {}, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def kill_on_bad_exit(cmd, env, world_size=2, timeout=300):
    """The ranks of one job as ``srun --kill-on-bad-exit=1`` runs them: the first rank to exit
    with a non-zero code gets every other rank killed at once, with all they started. Returns
    each rank's exit code (-9 for the killed) and the seconds until the first non-zero exit."""
    port, started = free_port(), time.monotonic()
    ranks = [ScriptProcess(cmd, rank_env(world_size, r, port, env), REPO) for r in range(world_size)]
    codes, first_bad = [None] * world_size, None
    while None in codes:
        assert time.monotonic() - started < timeout, "the job did not end"
        for r, rank in enumerate(ranks):
            if codes[r] is None and os.path.exists(rank.paths["rc"]):
                codes[r] = int(open(rank.paths["rc"]).read())
                if codes[r] != 0 and first_bad is None:
                    first_bad = time.monotonic() - started
                    for other in ranks:
                        kill_tree(other.pid)
        time.sleep(0.01)
    return codes, first_bad


def slow_scontrol(folder, seconds=3):
    """An scontrol that takes ``seconds`` (as a busy slurmctld does), then writes its arguments."""
    folder.mkdir()
    path = folder / "scontrol"
    path.write_text(f"#!/bin/sh\nsleep {seconds}\necho \"$@\" >> {folder / 'calls.txt'}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return folder


def requeue_run(tiny_data, folder, point):
    """SIGUSR1 to rank 1 at ``point``, scontrol taking 3 s, under ``kill_on_bad_exit``: each
    rank's exit code and what scontrol was called with (None where every script is a new
    interpreter: kill_on_bad_exit reads the prestarted Python's rc files)."""
    if os.environ.get("TESTS_FRESH_PROCESSES") == "1":
        return None
    out, bin_dir = folder / "out", slow_scontrol(folder / "bin")
    cmd = [PYTHON, PROBE, "multi", *train_args(tiny_data, out, *SHORT, "--requeue", "--resume", "auto")]
    codes, _ = kill_on_bad_exit(cmd, {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "91",
                                      "PROBE_STOP": f"SIGUSR1:{point}:rank1"})
    calls = bin_dir / "calls.txt"
    return codes, calls.read_text() if calls.exists() else ""


def loader_worker_fault_run(tiny_data, out, fault):
    """Rank 1's validation loader worker hangs (the loader's time-out, 5 s here), exits or is killed."""
    return run_ranks(2, [PYTHON, PROBE, "multi", *train_args(tiny_data, out, *SHORT[:2], "--workers", "1")],
                     env={"PROBE_VAL_WORKER": f"{fault}:1", "PROBE_LOADER_TIMEOUT": "5"}, timeout=240)


REQUEUE_POINTS = ["step-1-1", "validation-0"]
LOADER_WORKER_FAULTS = {"hang": "gave no batch in 5 s: it hangs", "die": "ended: exited unexpectedly",
                        "kill": "ended: "}


@pytest.fixture(scope="module", autouse=True)
def waiting_jobs(request, tiny_data, tmp_path_factory):
    """The requeue runs (each waits 3 s for scontrol) and the loader worker that hangs (its
    rank waits 5 s for the loader's time-out) start together as this module begins, and the
    module's other tests run meanwhile."""
    jobs = {point: started_early(request, test_the_requeue_is_done_before_any_rank_exits, requeue_run, tiny_data,
                                 tmp_path_factory.mktemp("requeue"), point) for point in REQUEUE_POINTS}
    jobs["hang"] = started_early(request, test_a_validation_worker_that_hangs_or_dies_is_one_line_on_every_rank,
                                 loader_worker_fault_run, tiny_data, tmp_path_factory.mktemp("hang") / "out", "hang")
    yield jobs
    concurrent.futures.wait([job for job in jobs.values() if job is not None])


@pytest.mark.parametrize("point", REQUEUE_POINTS)
def test_the_requeue_is_done_before_any_rank_exits(waiting_jobs, point):
    """SIGUSR1 to rank 1 (inside an epoch, and at an epoch's end), scontrol taking 3 s, and a
    launcher that kills every rank at the first non-zero exit (srun --kill-on-bad-exit=1): no
    rank exits before rank 0's scontrol requeue is done, so the job is requeued."""
    result = waiting_jobs[point].result()
    if result is None:
        pytest.skip("needs the prestarted Python's rc files")
    codes, calls = result
    assert calls == "requeue 91\n", codes
    # both stop with 75; the first to exit may get the other killed (-9), whichever it is
    assert 75 in codes and set(codes) <= {75, -signal.SIGKILL}, codes


def test_a_refusal_on_rank_0_at_start_up_reaches_every_rank_in_seconds(tiny_data, tmp_path):
    """torchrun, 2 processes, into an --output-dir that another run holds: rank 0 refuses at
    the lock, rank 1 learns of it at the same all-reduce (not in another collective), and
    both end within seconds with "another run is writing there", long before --dist-timeout."""
    out = tmp_path / "out"
    out.mkdir()
    with open(out / "run.lock", "w") as held:  # the other run: this process holds the lock
        fcntl.lockf(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        started = time.monotonic()
        job = run([*TORCHRUN, "--nproc_per_node=2", "--master_port", str(free_port()), PROBE, "multi",
                   *train_args(tiny_data, out, *SHORT, "--dist-timeout", "300")], timeout=240)
        seconds = time.monotonic() - started
    assert job.returncode != 0
    assert "another run is writing there" in job.stderr, job.stderr
    assert "timed out" not in job.stderr and "lost contact" not in job.stderr, job.stderr
    assert seconds < 120  # not --dist-timeout's 300 s


@pytest.mark.parametrize("failing", [0, 1])
def test_a_refusal_on_one_rank_in_the_data_step_stops_every_rank(tiny_data, tmp_path, failing):
    """A rank whose data listing is refused (rank 0, the one that lists; or rank 1, in its
    checks) stops the other at the same all-reduce: both exit 2 within seconds."""
    out = tmp_path / "out"
    started = time.monotonic()
    job = run_ranks(2, [PYTHON, PROBE, "multi", *train_args(tiny_data, out, *SHORT, "--dist-timeout", "300")],
                    env={"PROBE_REFUSE_DATA_RANK": str(failing)}, timeout=240)
    assert job.returncode == 2, job.stderr
    assert "probe: this rank refuses the data" in job.stderr and "timed out" not in job.stderr, job.stderr
    assert time.monotonic() - started < 120


def test_a_failed_write_of_the_runs_first_files_on_rank_0_stops_every_rank_in_seconds(tiny_data, tmp_path):
    """The disk is full as rank 0 writes args.json at the start: rank 1 learns it before the
    first training step's collective, both exit 2 at once with their lines."""
    out = tmp_path / "out"
    started = time.monotonic()
    job = run_ranks(2, [PYTHON, PROBE, "multi", *train_args(tiny_data, out, *SHORT, "--dist-timeout", "300")],
                    env={"PROBE_STOP": "ENOSPC:run_files:rank0"}, timeout=240)
    assert job.returncode == 2, job.stderr
    assert "error: disk full: could not write a file (No space left on device)" in job.stderr, job.stderr
    assert f"[rank 1] error: rank 0 could not write the run's files in {out} (its error says why)" in job.stderr
    assert "timed out" not in job.stderr and "lost contact" not in job.stderr, job.stderr
    assert time.monotonic() - started < 120


@pytest.mark.parametrize("point, what", [("epoch_save-0", "the epoch's checkpoint"),
                                         ("inside_save", "the checkpoint inside the epoch")],
                         ids=["epoch_save", "inside_save"])
def test_a_failed_save_on_rank_0_stops_every_rank_in_seconds(tiny_data, tmp_path, point, what):
    """The disk fills while rank 0 writes epoch 0's checkpoint, or its first checkpoint inside
    an epoch: rank 0 says so, rank 1 learns it in the agreement after the save (not after
    --dist-timeout), both exit 2; no checkpoint was written."""
    out = tmp_path / "out"
    started = time.monotonic()
    every_step = ["--checkpoint-every", "0.00001"] if point == "inside_save" else []
    job = run_ranks(2, [PYTHON, PROBE, "multi", *train_args(tiny_data, out, *SHORT, *every_step, "--dist-timeout",
                                                            "300")],
                    env={"PROBE_STOP": f"ENOSPC:{point}:rank0"}, timeout=240)
    assert job.returncode == 2, job.stderr
    assert "error: disk full: could not write" in job.stderr and "checkpoint.pth" in job.stderr, job.stderr
    assert f"[rank 1] error: rank 0 could not write {what} (its error says why)" in job.stderr, job.stderr
    assert "no checkpoint was written yet" in job.stderr, job.stderr
    assert "timed out" not in job.stderr and "lost contact" not in job.stderr, job.stderr
    assert time.monotonic() - started < 120
    assert not (out / "checkpoint.pth").exists()


@pytest.mark.parametrize("fault", LOADER_WORKER_FAULTS)
def test_a_validation_worker_that_hangs_or_dies_is_one_line_on_every_rank(waiting_jobs, tiny_data, tmp_path, fault):
    """Rank 1's validation loader worker hangs (the loader's time-out, 5 s here), exits or is killed: rank
    1 names it in one line with the checkpoint to resume from, rank 0 says it lost contact;
    neither waits forever, nor prints a traceback."""
    if fault == "hang":  # started early (waiting_jobs): it waits for the loader's time-out
        job = waiting_jobs["hang"].result()
    else:
        job = loader_worker_fault_run(tiny_data, tmp_path / "out", fault)
    assert job.returncode != 0
    assert "[rank 1] error: a data loader's worker" in job.stderr and LOADER_WORKER_FAULTS[fault] in job.stderr, \
        job.stderr
    assert "no checkpoint was written yet" in job.stderr, job.stderr
    assert "lost contact with another process" in job.stderr, job.stderr
    assert "Traceback" not in job.stderr, job.stderr


@pytest.mark.parametrize("message, line", [
    ("DataLoader worker (pid 4242) is killed by signal: Killed. ", "(pid 4242) ended: killed by signal: Killed (the"),
    ("DataLoader worker (pid(s) 17, 18) exited unexpectedly", "(pid 17, 18) ended: exited unexpectedly (the"),
    ("DataLoader timed out after 600 seconds", "gave no batch in 600 s: it hangs")], ids=["killed", "exited", "hangs"])
def test_each_way_torch_reports_a_lost_loader_worker_is_one_line(message, line):
    """The texts torch's DataLoader raises (its SIGCHLD check, its status check, its time-out),
    as its source writes them: each becomes the one line naming the worker."""
    from multi_train_utils.errors import loader_failure

    assert line in (loader_failure(RuntimeError(message)) or "not recognised")
    assert loader_failure(RuntimeError("something else")) is None


def test_a_resume_inside_an_epoch_at_another_batch_size_puts_the_schedule_at_its_step(tiny_data, tmp_path):
    """Stopped inside epoch 1 at batch 2 (one process), resumed at batch 4: epoch 1's last
    learning rate is that of an uninterrupted batch-4 run (the schedule moved by the batch-4
    steps the trained images make, not by the batch-2 steps)."""
    out, straight = tmp_path / "out", tmp_path / "straight"
    flags = ["--epochs", "2", "--workers", "0", "--checkpoint-every", "0", "--lr", "0.01"]
    stopped = run([PYTHON, PROBE, "single", *train_args(tiny_data, out, *flags, "--batch-size", "2")],
                  env={"PROBE_STOP": "SIGUSR1:step-1-7:self"})
    assert stopped.returncode == 75, stopped.stderr
    assert torch.load(out / "checkpoint.pth", weights_only=True)["position"]["step"] == 8  # 16 of 36 images
    resumed = run([PYTHON, PROBE, "single", *train_args(tiny_data, out, *flags, "--batch-size", "4", "--resume",
                                                        "auto")])
    assert resumed.returncode == 0, resumed.stderr
    whole = run([PYTHON, PROBE, "single", *train_args(tiny_data, straight, *flags, "--batch-size", "4")])
    assert whole.returncode == 0, whole.stderr
    assert read_metrics(out)[1]["lr"] == read_metrics(straight)[1]["lr"]


def test_the_first_step_after_a_resume_counts_steps_of_the_new_batch_size():
    """EpochBatchSampler.first_step: a checkpoint after 5 steps of batch 4 (20 of 36 images), read
    at batch 8: 2 steps of 8 remain of 4, so the epoch goes on at step 2 (not 5); at batch 4, 5."""
    from torch.utils.data import DistributedSampler

    from multi_train_utils.loaders import EpochBatchSampler, EpochPosition

    sampler = DistributedSampler(range(36), num_replicas=1, rank=0, shuffle=True, seed=0)
    position = EpochPosition(epoch=0, done=20, end=36, order_world_size=1, step=5, train_images=36)
    for batch_size, expected in ((8, 2), (4, 5), (2, 10)):
        batches = EpochBatchSampler(sampler, batch_size, world_size=1, rank=0)
        batches.resume_at(position)
        assert batches.first_step() == expected, batch_size


def test_the_gpu_generator_is_saved_and_restored_for_the_gpu_in_use(monkeypatch):
    """rng_state keeps the state of the GPU this process uses (the current device), and
    restore_rng puts it on the GPU in use then, whatever the number of visible GPUs: 8
    visible and GPU 5 in use, then 1 visible (srun --gpus-per-task=1). A checkpoint of an
    earlier version (every GPU's state) is restored only where as many GPUs are visible."""
    from multi_train_utils import checkpoint

    states = {5: torch.tensor([5], dtype=torch.uint8), 0: torch.tensor([0], dtype=torch.uint8)}
    put = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: states[device])
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [states[0]] * 8)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=None: put.append((int(state), device)))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: put.append(("all", len(states))))
    saved = checkpoint.rng_state()
    assert "cuda_device" in saved and "cuda" not in saved
    assert int(saved["cuda_device"]) == 5
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the resume: one GPU visible, index 0
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    checkpoint.restore_rng(saved)
    assert put == [(5, 0)]
    put.clear()
    checkpoint.restore_rng({"cuda": [torch.zeros(1)] * 8})  # an earlier version's, 8 GPUs then, 1 now
    assert put == []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    checkpoint.restore_rng({"cuda": [torch.zeros(1)] * 8})
    assert put == [("all", 8)]


def test_mixing_a_batch_reseeds_no_gpu_generator(monkeypatch):
    """MixUp and CutMix draw from the CPU generator alone: no GPU generator is reseeded behind
    the user's back (torch.manual_seed would reseed them all at every step)."""
    from multi_train_utils.loaders import BatchMixer

    reseeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: reseeded.append(seed))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: reseeded.append(seed))
    mixer = BatchMixer(3, mixup_alpha=0.4, cutmix_alpha=1.0, seed=0, rank=0)
    batch = torch.rand(4, 3, 8, 8)
    before = torch.get_rng_state()
    _, targets = mixer(batch, torch.tensor([0, 1, 2, 0]), epoch=0, step=3)
    assert reseeded == []
    assert torch.equal(torch.get_rng_state(), before)  # the global CPU generator as it was
    assert targets.shape == (4, 3) and torch.allclose(targets.sum(1), torch.ones(4))


@pytest.mark.parametrize("tasks, node, expected", [("2(x3),1", 0, 2), ("2(x3),1", 2, 2), ("2(x3),1", 3, 1),
                                                   ("4(x2)", 1, 4), ("1,3", 1, 3), ("8", 0, 8)])
def test_the_tasks_of_this_node_come_from_its_entry_of_an_uneven_list(monkeypatch, tasks, node, expected):
    """SLURM_STEP_TASKS_PER_NODE of uneven nodes: each node takes its own entry (SLURM_NODEID),
    so the processes of a node wait for as many peers as it has."""
    from multi_train_utils.distributed_utils import read_dist_env

    # (set, then deleted: what read_dist_env writes goes again after the test, also where it was unset)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    for key, value in dict(SLURM_PROCID="6", SLURM_STEP_NUM_TASKS="7", SLURM_LOCALID="0", SLURM_NODEID=str(node),
                           SLURM_STEP_TASKS_PER_NODE=tasks, SLURM_NODELIST="n[1-4]", SLURM_JOB_ID="5").items():
        monkeypatch.setenv(key, value)
    assert read_dist_env().local_world_size == expected


def test_eval_only_evaluates_at_the_runs_precision_unless_amp_is_given(tmp_path):
    """--eval-only takes --amp from the run's args.json (a run trained with --amp off is
    evaluated in fp32, also where auto would pick bf16); --amp on the command line wins."""
    from multi_train_utils.run_files import ARGS_FILE

    data = f'"data_path": "{tmp_path}"'
    (tmp_path / ARGS_FILE).write_text('{"model": "resnet18", "img_size": 32, "amp": "off", ' + data + '}')
    weights = str(tmp_path / "model-best.pth")
    assert parse_flags(False, "--eval-only", "--weights", weights).amp == "off"
    assert parse_flags(True, "--eval-only", "--weights", weights, "--amp", "bf16").amp == "bf16"
    (tmp_path / ARGS_FILE).write_text('{"model": "resnet18", "img_size": 32, "amp": "fast", ' + data + '}')
    from multi_train_utils.errors import UserError

    with pytest.raises(UserError, match='its "amp" is \'fast\' .*one of auto, bf16, fp16, off'):
        parse_flags(False, "--eval-only", "--weights", weights)


def test_a_stop_during_eval_only_says_to_run_it_again_not_to_resume(tmp_path):
    """SIGTERM during --eval-only: there is no checkpoint to continue from, so the line says
    to run the command again."""
    from multi_train_utils.run_files import resume_hint

    args = parse_flags(False, "--output-dir", str(tmp_path))
    assert "--resume auto" in resume_hint(args)
    args.eval_only = True
    assert resume_hint(args) == "the evaluation did not finish and wrote nothing; run the same command again"


def test_a_utf16_list_file_is_refused_in_one_line_without_nul_bytes(tmp_path):
    """A list saved as UTF-16 (a spreadsheet's "Unicode text"): one line that says so, no raw NUL bytes."""
    from multi_train_utils.datasets import _read_label_file
    from multi_train_utils.errors import UserError

    path = tmp_path / "train.csv"
    path.write_bytes("path,label\nimg/a.png,cat\n".encode("utf-16"))
    with pytest.raises(UserError) as error:
        _read_label_file(str(path), "--train-list")
    assert str(error.value) == f"--train-list {path}: saved as UTF-16 text (NUL bytes); save it as UTF-8, a CSV " \
                               "file with the header path,label"
    assert "\x00" not in str(error.value)


def test_a_run_without_ema_says_when_it_reached_the_target():
    """A crossing: --target-accuracy in a run without --model-ema, whose EMA cells are all
    empty: the first epoch whose val accuracy reached the target is named, with its run clock."""
    from multi_train_utils.recorder import time_to_target
    from multi_train_utils.run_files import METRICS_HEADER
    from multi_train_utils.single_label import SingleLabel

    def row(epoch, accuracy, seconds):
        values = dict.fromkeys(METRICS_HEADER, "")
        values.update(epoch=str(epoch), val_accuracy=accuracy, run_seconds=seconds)
        return [values[k] for k in METRICS_HEADER]

    rows = [row(0, "0.4", "61.0"), row(1, "0.75", "122.4"), row(2, "0.9", "183.0")]
    assert time_to_target(0.75, rows, 2, SingleLabel(), METRICS_HEADER) == (
        "run clock: the best epoch (2) after 3m03s of training; val accuracy 0.75 first reached at epoch 1, after 2m02s")


def test_progress_bars_start_no_monitor_thread_that_a_loader_fork_could_race():
    """The validation hang after a resume: a loader forked its worker while tqdm's monitor
    thread was starting or exiting, and on Python 3.11 the child waited forever on the
    interpreter's lock (gdb: PyOS_AfterFork_Child -> _PyThreadState_DeleteExcept). The engine
    turns tqdm's monitor thread off: a progress bar starts no thread."""
    import threading

    from tqdm import tqdm
    from tqdm._monitor import TMonitor

    import multi_train_utils.loaders  # noqa: F401 - what every entry script imports

    with tqdm(total=2, disable=False, file=open(os.devnull, "w")) as bar:
        bar.update(1)
        monitors = [t for t in threading.enumerate() if isinstance(t, TMonitor)]
    assert tqdm.monitor_interval == 0 and monitors == []
