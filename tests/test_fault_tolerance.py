"""Never lose work: kill and resume exactly, elastic restarts, Ctrl-C, failing ranks."""
import concurrent.futures
import os
import signal
import subprocess
import time

import pytest
import torch

from conftest import (PYTHON, REPO, TORCHRUN, StartedJob, alive, dump_stacks_then_kill_tree, free_port, kill_tree,
                      pids_of_tree, probe_records, read_metrics, run, script, started_early, train_args)

PROBE = os.path.join(REPO, "tests", "helpers", "probe.py")
EPOCHS = ["--epochs", "4"]


def command(kind, probe, *flags):
    """One process (single) or a 2-process torchrun (ddp) of the script, or of the probe."""
    name = "train_single.py" if kind == "single" else "train_multi_gpu.py"
    if probe:
        entry = [PROBE, "single" if kind == "single" else "multi"]
    else:
        entry = [script(name)]
    prefix = [PYTHON] if kind == "single" else [*TORCHRUN, "--nproc_per_node=2", "--master_port", str(free_port())]
    return [*prefix, *entry, *flags]


def wait_for(path, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


def wait_for_checkpoint(output_dir, epoch, proc, timeout=240):
    """Wait until checkpoint.pth of ``epoch`` can be read; a job that hangs instead prints its
    processes' stacks into the failure."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.communicate()
        if time.monotonic() > deadline:
            dump_stacks_then_kill_tree(proc.pid)
            stdout, stderr = proc.communicate()
            raise AssertionError(f"no checkpoint of epoch {epoch} after {timeout} s; the job's output and stacks:\n"
                                 f"{stdout[-4000:]}\n{stderr[-8000:]}")
        try:
            if torch.load(output_dir / "checkpoint.pth", weights_only=True)["epoch"] >= epoch:
                return
        except (OSError, RuntimeError, EOFError):
            pass
        time.sleep(0.05)


STARTED = []


@pytest.fixture(autouse=True)
def no_process_left_behind():
    """Whatever a test started dies with the test, even when the test fails."""
    yield
    while STARTED:
        job = STARTED.pop()
        if job.poll() is None:
            kill_tree(job.pid)
            job.communicate()


def start(cmd, env=None):
    """Start a job that the test signals or kills (see StartedJob); it dies with the test."""
    STARTED.append(StartedJob(cmd, env))
    return STARTED[-1]


def metric_rows(output_dir):
    return [(r["epoch"], r["train_loss"], r["val_accuracy"], r["lr"]) for r in read_metrics(output_dir)]


def model_flags(kind):
    # the single-process case uses a model with dropout, so that what the model itself draws
    # at random must repeat on resume too
    return ["--model", "mobilenet_v3_small"] if kind == "single" else []


@pytest.fixture(scope="module")
def reference_runs(tiny_data, tmp_path_factory):
    """Uninterrupted runs of 4 epochs, one per kind, made the first time a test asks."""
    done = {}

    def reference(kind):
        if kind not in done:
            out = tmp_path_factory.mktemp(f"uninterrupted-{kind}") / "out"
            flags = train_args(tiny_data, out, *EPOCHS, "--workers", "1", *model_flags(kind))
            result = run(command(kind, False, *flags))
            assert result.returncode == 0, result.stdout + result.stderr
            done[kind] = out
        return done[kind]

    return reference


@pytest.fixture(params=["single", "ddp"])
def uninterrupted(request, reference_runs):
    return request.param, reference_runs(request.param)


def assert_same_final_weights(out, reference, epoch=3):
    final, expected = (torch.load(d / f"model-{epoch}.pth", weights_only=True) for d in (out, reference))
    for key in expected:
        torch.testing.assert_close(final[key], expected[key], rtol=0, atol=1e-6, msg=key)


def test_sigkill_then_resume_equals_an_uninterrupted_run(uninterrupted, tiny_data, tmp_path):
    kind, reference = uninterrupted
    out = tmp_path / "out"
    flags = train_args(tiny_data, out, *EPOCHS, "--keep-last", "2", *model_flags(kind))
    # every process kills itself at epoch 2's second step, after the second checkpoint
    killed = run(command(kind, True, *flags, "--workers", "1"), env={"PROBE_STOP": "SIGKILL:step-2-1:self"})
    assert killed.returncode != 0, killed.stdout + killed.stderr
    saved = torch.load(out / "checkpoint.pth", weights_only=True)["epoch"]
    assert saved == 1
    # README's short form: --data-path and --resume auto; the rest (the model, sizes, epochs,
    # --keep-last, the log folder...) comes from the run's args.json. No loader workers: the
    # result must not depend on them.
    resumed = run(command(kind, False, "--data-path", tiny_data["train"], "--output-dir", str(out), "--workers", "0",
                          "--resume", "auto"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"(epoch {saved} done): epochs {saved + 1} to 3" in resumed.stdout
    assert metric_rows(out) == metric_rows(reference)  # one row per epoch, the same values
    # train.log goes on: the killed run's start and epochs, then the resumed run's, each epoch once
    with open(out / "train.log", encoding="utf-8") as f:
        log = f.read()
    resumed_at = log.index("resuming from")
    assert log.count("resuming from") == 1 and log.index("split: ") < resumed_at
    before, after = log[:resumed_at], log[resumed_at:]
    # (the kill may fall between the last checkpoint and its epoch's line)
    expected_before = [f"[epoch {e}] " for e in range(saved)]
    assert [l[:l.index("]") + 2] for l in before.splitlines() if l.startswith("[epoch ")][:saved] == expected_before
    assert before.count(f"[epoch {saved}] ") <= 1 and f"[epoch {saved + 1}] " not in before
    assert [l[:l.index("]") + 2] for l in after.splitlines() if l.startswith("[epoch ")] == \
        [f"[epoch {e}] " for e in range(saved + 1, 4)]
    assert_same_final_weights(out, reference)
    # --keep-last 2 pruned the older per-epoch files; the best weights are those of the best epoch
    assert sorted(p.name for p in out.glob("model-*.pth")) == ["model-2.pth", "model-3.pth", "model-best.pth"]
    accuracies = [float(r["val_accuracy"]) for r in read_metrics(reference)]
    best_epoch = accuracies.index(max(accuracies))
    best, reference_best = (torch.load(p, weights_only=True) for p in (out / "model-best.pth",
                                                                       reference / f"model-{best_epoch}.pth"))
    for key in reference_best:
        torch.testing.assert_close(best[key], reference_best[key], rtol=0, atol=1e-6, msg=key)
    checkpoint = torch.load(out / "checkpoint.pth", weights_only=True)
    assert checkpoint["epoch"] == 3 and checkpoint["best_epoch"] == best_epoch


def test_elastic_restart_after_a_worker_is_killed(tiny_data, tmp_path, reference_runs):
    """torchrun restarts both workers after one is killed; they resume from the last
    checkpoint and end where an uninterrupted run ends."""
    out = tmp_path / "out"
    cmd = [*TORCHRUN, "--nproc_per_node=2", "--max-restarts=1", "--master_port", str(free_port()), PROBE, "multi",
           *train_args(tiny_data, out, *EPOCHS, "--workers", "0", "--resume", "auto")]
    job = run(cmd, env={"PROBE_STOP": "SIGKILL:step-2-1:rank1"})  # rank 1 killed inside epoch 2
    stdout, stderr = job.stdout, job.stderr
    assert job.returncode == 0, stdout + stderr
    assert stdout.count("resuming from") == 1
    reference = reference_runs("ddp")
    assert metric_rows(out) == metric_rows(reference)  # one row per epoch, the same values
    assert_same_final_weights(out, reference)


@pytest.mark.parametrize("kind,to", [("ddp", "launcher"), ("ddp", "group"), ("single", "group"),
                                     ("spawn", "launcher")])
def test_sigint_stops_every_process_within_10_seconds(kind, to, tiny_data, tmp_path):
    """SIGINT to the launcher (torchrun forwards it) or to the whole process group (what
    Ctrl-C in a terminal does), mid-epoch."""
    out = tmp_path / "out"
    flags = train_args(tiny_data, out, "--epochs", "50", "--workers", "1")
    cmd = [PYTHON, script("train_multi_gpu.py"), "--spawn", "2", *flags] if kind == "spawn" else command(kind, True, *flags)
    job = start(cmd, env={"PROBE_STEP_SLEEP": "0.2", "PROBE_OUT": str(tmp_path / "probe")})
    wait_for_checkpoint(out, 0, job)
    time.sleep(0.5)  # mid-epoch
    pids = pids_of_tree(job.pid)
    assert len(pids) >= (5 if kind != "single" else 2)  # launcher, workers, their loader workers
    sent = time.monotonic()
    if to == "group":
        os.killpg(job.pid, signal.SIGINT)
    else:
        os.kill(job.pid, signal.SIGINT)
    stdout, stderr = job.communicate(timeout=30)
    while any(alive(p) for p in pids) and time.monotonic() - sent < 15:
        time.sleep(0.05)
    elapsed = time.monotonic() - sent
    assert not [p for p in pids if alive(p)], "processes left"
    assert elapsed < 10, elapsed
    assert job.returncode != 0
    if kind == "single":
        assert job.returncode == 130
    if kind == "ddp":  # each worker exits 130 (as the probe saw it leave); torchrun itself returns 1
        assert [r.get("exit_code") for r in probe_records(tmp_path / "probe", 2)] == [130, 130]
        assert job.returncode == 1
    assert "interrupted by SIGINT: to continue from the last checkpoint" in stderr
    assert "run the same command with --resume auto" in stderr
    finished = [int(line.split("]")[0].split()[-1]) for line in stdout.splitlines() if line.startswith("[epoch ")]
    checkpoint = torch.load(out / "checkpoint.pth", weights_only=True)
    assert checkpoint["epoch"] == finished[-1]  # the last epoch reported is the one saved


def wait_for_processes(job, count, timeout=60):
    deadline = time.monotonic() + timeout
    while len(pids_of_tree(job.pid)) < count:
        assert job.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    return pids_of_tree(job.pid)


@pytest.mark.parametrize("workers,step", [("0", None), ("1", "3")])
def test_a_rank_that_raises_ends_the_job(tiny_data, tmp_path, workers, step):
    """At its first step, or mid-epoch with a loader worker running (whose iterator the error's
    traceback keeps alive: Python's exit must not wait for that worker)."""
    job = start([*TORCHRUN, "--nproc_per_node=2", "--master_port", str(free_port()), PROBE, "multi",
                 *train_args(tiny_data, tmp_path / "out", "--epochs", "2", "--workers", workers)],
                env={"PROBE_RAISE_RANK": "1", **({"PROBE_RAISE_STEP": step} if step else {})})
    pids = wait_for_processes(job, 3)  # torchrun and its two workers
    try:
        _, stderr = job.communicate(timeout=60)
    except subprocess.SubprocessError:  # still running after 60 s
        stderr = ""
    assert job.poll() is not None, "the job did not end within 60 s of a rank's error"
    assert job.returncode != 0
    assert "RuntimeError: probe: rank 1 fails" + (f" at step {step}" if step else "") in stderr
    time.sleep(1)
    assert not [p for p in pids if alive(p)]


def hang_until_the_timeout(tiny_data, out):
    """torchrun, 2 processes; rank 1 hangs at its first step, and leaving the process group
    never returns (as NCCL's may wait for work in flight with a peer gone). Returns the exit
    code, stdout, stderr, the seconds from the workers' start to the job's end, and the job's
    processes still alive a second later."""
    job = StartedJob([*TORCHRUN, "--nproc_per_node=2", "--master_port", str(free_port()), PROBE, "multi",
                      *train_args(tiny_data, out, "--epochs", "2", "--workers", "0", "--dist-timeout", "8")],
                     {"PROBE_HANG_RANK": "1", "PROBE_STUCK_DESTROY": "1"})
    try:
        pids = wait_for_processes(job, 3)
        started = time.monotonic()
        try:
            stdout, stderr = job.communicate(timeout=60)
        except subprocess.SubprocessError:  # it did not end: fail on the assertions
            kill_tree(job.pid)
            stdout, stderr = job.communicate()
        elapsed = time.monotonic() - started
        time.sleep(1)
        return job.returncode, stdout, stderr, elapsed, [p for p in pids if alive(p)]
    finally:
        if job.poll() is None:
            kill_tree(job.pid)
            job.communicate()


@pytest.fixture(scope="module", autouse=True)
def hanging_job(request, tiny_data, tmp_path_factory):
    """The hang test's job waits ~10 s for its --dist-timeout: it starts as this module begins,
    and the module's other tests run meanwhile."""
    job = started_early(request, test_a_rank_that_hangs_ends_the_job_after_the_timeout, hang_until_the_timeout,
                        tiny_data, tmp_path_factory.mktemp("hang") / "out")
    yield job
    if job is not None:
        concurrent.futures.wait([job])


def test_a_rank_that_hangs_ends_the_job_after_the_timeout(hanging_job):
    """Rank 0 waits for --dist-timeout, not forever, and the error gets out although leaving the
    process group never returns."""
    code, stdout, stderr, elapsed, left = hanging_job.result()
    assert 8 <= elapsed < 60, (elapsed, stderr[-2000:])  # rank 0 waited for the --dist-timeout, not forever
    assert code != 0
    assert "[rank 0] error: a collective timed out after --dist-timeout" in stderr, stderr
    assert "the process group did not shut down within 2 s" in stderr, stderr
    assert "[rank0]: Traceback" not in stderr  # no traceback from the workers (torchrun prints its own)
    assert not left
