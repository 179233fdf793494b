"""A careless or hostile world: two runs in one folder, a launcher killed with kill -9,
SIGTERM to every process, the user's files, bad files and flags of every kind."""
import os
import re
import signal
import time

import pytest
import torch

from conftest import PROBE, PYTHON, TORCHRUN, free_port, pids_of_tree, run, script, train_args
from test_fault_tolerance import alive, no_process_left_behind, start, wait_for_checkpoint  # noqa: F401 (autouse)


# --- One writer per folder, no orphans -------------------------------------------------------------


def listing(folder):
    """{name: (size, mtime)} of a folder's files."""
    return {entry.name: (entry.stat().st_size, entry.stat().st_mtime_ns) for entry in os.scandir(folder)}


def test_a_second_run_is_refused_and_a_killed_launcher_leaves_no_worker(tiny_data, tmp_path):
    """A torchrun job trains in OUT; a second run into OUT stops at once, naming the first;
    kill -9 of torchrun then ends every worker (and loader worker) before it writes again,
    and the folder's lock is free."""
    out = tmp_path / "out"
    job = start([*TORCHRUN, "--nproc_per_node=2", "--master_port", str(free_port()), PROBE, "multi",
                 *train_args(tiny_data, out, "--epochs", "50", "--workers", "1")], env={"PROBE_STEP_SLEEP": "0.2"})
    wait_for_checkpoint(out, 0, job)
    pids = pids_of_tree(job.pid)
    assert len(pids) >= 5  # torchrun, two workers, their loader workers

    # (--epochs 1: without the lock it would end at once, resumed or refused, not run for long)
    second = run([PYTHON, script("train_single.py"), *train_args(tiny_data, out, "--resume", "auto", "--epochs", "1")],
                 timeout=60)
    assert second.returncode == 2, second.stdout + second.stderr
    holder = re.fullmatch(rf"error: --output-dir {re.escape(str(out))}: another run is writing there \(held by pid "
                          r"(\d+) on \S+, started [\d\-T:+]+\); wait for it to finish, stop it, or choose another "
                          r"--output-dir", second.stderr.strip())
    assert holder and int(holder.group(1)) in pids[1:], second.stderr
    assert "split:" not in second.stdout  # stopped before reading the data

    os.kill(job.pid, signal.SIGKILL)  # torchrun only, as the OOM killer would
    killed = time.monotonic()
    job.wait()  # (not its output: workers left running would hold the pipes open)
    try:
        time.sleep(1)
        after_1s = listing(out)
        while [p for p in pids if alive(p)] and time.monotonic() - killed < 15:
            time.sleep(0.1)
        assert not [p for p in pids if alive(p)], "workers left running"
        assert listing(out) == after_1s  # nothing written after the launcher died (and no one left to write)
    finally:
        for pid in pids[1:]:  # re-parented survivors are no longer in the job's tree
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    assert_lock_is_free(str(out))  # the kernel released the dead rank 0's lock


def assert_lock_is_free(folder):
    from multi_train_utils.errors import UserError
    from multi_train_utils.files import lock_output_dir

    try:
        lock = lock_output_dir(folder)
    except UserError as e:
        lock = e
    assert not isinstance(lock, UserError), f"the lock outlived its holder: {lock}"
    lock.discard()


def hold_lock_in_child(folder, with_worker=False):
    """Fork a process that takes ``folder``'s lock (and, if asked, forks a loader-like worker
    that outlives it), then sleeps; returns (pid, worker pid or None)."""
    from multi_train_utils.files import lock_output_dir

    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no torch work
        try:
            lock_output_dir(folder)
            worker = os.fork() if with_worker else 0
            if worker == 0 and with_worker:
                os.close(ready_w)
                time.sleep(60)
                os._exit(0)
            os.write(ready_w, str(worker).encode())
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(ready_w)
    worker = int(os.read(ready_r, 32) or b"0")
    os.close(ready_r)
    return pid, worker or None


def test_the_lock_names_its_holder_and_dies_with_it_not_with_its_forked_workers(tmp_path):
    from multi_train_utils.errors import UserError
    from multi_train_utils.files import lock_output_dir

    folder = str(tmp_path / "run")
    holder, worker = hold_lock_in_child(folder, with_worker=True)
    try:
        with pytest.raises(UserError, match=rf"another run is writing there \(held by pid {holder} on "):
            lock_output_dir(folder)
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
        assert alive(worker)  # a forked worker of the dead holder lives on, but does not hold the lock
        assert_lock_is_free(folder)
        assert os.listdir(folder) == ["run.lock"]  # it existed: discard leaves it
    finally:
        for pid in (holder, worker):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def test_the_lock_checks_the_folder_can_be_written_and_bad_input_leaves_no_trace(tmp_path, monkeypatch):
    import tempfile

    from multi_train_utils import files as run_lock
    from multi_train_utils.errors import UserError

    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="--output-dir .*file: is a file; give a folder"):
        run_lock.lock_output_dir(str(tmp_path / "file"))
    lock = run_lock.lock_output_dir(str(tmp_path / "new" / "run"))
    lock.discard()  # what a run that then finds bad input does: the folder it made is gone again
    assert os.listdir(tmp_path / "new") == []

    def refused(*args, **kwargs):  # CI runs as root, whom file modes do not stop: inject the refusal
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "TemporaryFile", refused)
    with pytest.raises(UserError, match=r"--output-dir \S+ro: cannot write there \(Permission denied\); choose a "
                                        "folder you can write to"):
        run_lock.lock_output_dir(str(tmp_path / "ro"))


def test_sigterm_to_every_process_is_a_notice_answered_with_a_save_not_a_crash(tiny_data, tmp_path):
    """SLURM's scancel and a cluster's preemption send SIGTERM to the loader workers too: they
    keep loading, the trainer saves where it is, says how to continue and exits with 75, with
    no DataLoader traceback."""
    out = tmp_path / "out"
    job = start([PYTHON, PROBE, "single", *train_args(tiny_data, out, "--epochs", "50", "--workers", "2")],
                env={"PROBE_STEP_SLEEP": "0.2"})
    wait_for_checkpoint(out, 0, job)
    time.sleep(0.5)
    pids = pids_of_tree(job.pid)
    assert len(pids) >= 3  # the trainer and its two loader workers
    os.killpg(job.pid, signal.SIGTERM)
    stdout, stderr = job.communicate(timeout=30)
    assert job.returncode == 75, stderr
    assert "on a preemption notice (SIGTERM)" in stderr and "run the same command with --resume auto" in stderr
    assert "Traceback" not in stderr and "killed by signal" not in stderr, stderr
    checkpoint = torch.load(out / "checkpoint.pth", weights_only=True)
    assert checkpoint["epoch"] >= 0 and (checkpoint["position"] is None or checkpoint["position"]["step"] > 0)
    time.sleep(0.5)
    assert not [p for p in pids if alive(p)]
