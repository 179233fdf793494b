"""Stop on Ctrl-C within seconds on every rank; take SIGTERM and SIGUSR1 as preemption notices.

Ctrl-C (SIGINT) stops at once. While the epochs run, SIGTERM and SIGUSR1 are a notice:
training saves, then stops.

A notice (SLURM's ``--signal=USR1@120``, the SIGTERM that Kubernetes, spot machines and
torchrun send before a grace period) only sets a flag while the epochs run (``arm_notices``);
the training loop reads it at its next step, saves a checkpoint of that step and exits with
PREEMPTED_EXIT_CODE (see ``mid_epoch``). Further notices change nothing then, and nothing
ends the save but SIGINT or SIGKILL. Before the epochs run (start-up, --eval-only), a notice
stops at once as SIGINT does: there is nothing new to save.

A rank blocked in a collective (gloo, NCCL) runs Python signal handlers only when the
collective returns, which can be never. So the handler itself only raises an exception
(once), and a watchdog thread, woken at once through ``signal.set_wakeup_fd``, ends the
process if the main thread has not finished unwinding after a grace period. Neither waits
on a collective.
"""
import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
NOTICE_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # a preemption notice, once the epochs run
_notice = {"armed": False, "signum": None}
_held = {"depth": 0, "signum": None, "message": None}  # a stop that waits for a file's write (hold_stops)


def arm_notices():
    """From now on SIGTERM and SIGUSR1 are preemption notices (the epochs run)."""
    _notice["armed"] = True


def notice_received():
    """The signal number of the preemption notice received, or None."""
    return _notice["signum"]


def _takes_notice(signum):
    return signum in NOTICE_SIGNALS and _notice["armed"]


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT, or SIGTERM / SIGUSR1 before the epochs run, arrived; the exit code is 128 + the signal number. ``message`` says
    how to resume (rank 0 only)."""

    def __init__(self, signum=signal.SIGINT, message=None):
        super().__init__(signum)
        self.signum = int(signum)
        self.message = message

    @property
    def exit_code(self):
        return 128 + self.signum

    def report(self):
        """The line rank 0 prints, or None."""
        return f"interrupted by {signal.Signals(self.signum).name}: {self.message}" if self.message else None


# EX_TEMPFAIL of sysexits.h, "a temporary failure; the user is invited to retry": the run
# saved where it stopped, and goes on with --resume auto. Ctrl-C stays 130 (128 + SIGINT).
PREEMPTED_EXIT_CODE = 75


class Preempted(TrainingInterrupted):
    """A preemption notice was answered: the checkpoint is saved; every rank exits with
    PREEMPTED_EXIT_CODE, rank 0 printing ``message``."""

    def __init__(self, message=None):
        super().__init__(notice_received() or signal.SIGTERM, message)

    @property
    def exit_code(self):
        return PREEMPTED_EXIT_CODE

    def report(self):
        return self.message


@contextlib.contextmanager
def hold_stops():
    """Inside: a stop (Ctrl-C) waits until the block is done, then raises TrainingInterrupted.
    Around a file's write: torch.save's writer, interrupted half-way, fails with an error of
    its own instead of the interruption. The watchdog still ends a write that takes longer
    than its grace (the file is written atomically: the old one stays)."""
    _held["depth"] += 1
    try:
        yield
    finally:
        _held["depth"] -= 1
    if _held["depth"] == 0 and _held["signum"] is not None:
        signum, _held["signum"] = _held["signum"], None
        raise TrainingInterrupted(signum, _held["message"])


def install_stop_handlers(message=None, grace_seconds=3.0):
    """Turn SIGINT (and SIGTERM / SIGUSR1 until ``arm_notices``) into TrainingInterrupted; if
    unwinding hangs for ``grace_seconds``, print ``message`` (if given) and end the process;
    once armed, the first SIGTERM or SIGUSR1 is kept as a notice, and later ones ignored.
    Call from the main thread."""
    _notice.update(armed=False, signum=None)
    _held.update(depth=0, signum=None, message=message)

    def raise_interrupted(signum, frame):
        if _takes_notice(signum):
            _notice["signum"] = _notice["signum"] or signum  # the training loop saves at its next step
            return
        for other in STOP_SIGNALS:  # once: a second signal must not interrupt the clean-up
            signal.signal(other, signal.SIG_IGN)
        if _held["depth"]:  # a file is being written: raised when it is done (hold_stops)
            _held["signum"] = signum
            return
        raise TrainingInterrupted(signum, message)

    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:  # started in the background: stay so
            signal.signal(signum, raise_interrupted)

    def watchdog():
        while True:
            signum = os.read(read_fd, 1)[0]  # every signal with a Python handler writes its number
            if signum in STOP_SIGNALS and not _takes_notice(signum):  # a notice: the save may take long
                break
        threading.Event().wait(grace_seconds)
        if message:
            os.write(2, f"\ninterrupted by {signal.Signals(signum).name}: {message}\n".encode())
        os._exit(128 + signum)  # still here: the main thread is stuck, e.g. in a collective

    threading.Thread(target=watchdog, name="stop-watchdog", daemon=True).start()


def reset_in_worker(worker_id=None):
    """DataLoader ``worker_init_fn``. A forked loader worker inherits the handlers and the
    wakeup pipe: it drops the pipe, ignores SIGINT and leaves quietly on SIGTERM (the main
    process shuts it down and reports the interruption), ignores SIGTERM and SIGUSR1 (SLURM
    may send them to every process: a notice the trainer answers, with these workers still
    loading the batches up to its save), and it dies with its parent, so a killed trainer
    never leaves loader workers behind."""
    signal.set_wakeup_fd(-1)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        _set_parent_death_signal(signal.SIGKILL)


def end_loader_workers():
    """Kill this process's loader workers (its daemonic multiprocessing children). An error's
    traceback keeps the DataLoader's iterator alive until Python exits, and Python's exit then
    waits for workers that ignore SIGTERM: the rank would never end, nor would its job. (The
    DataLoader's SIGCHLD handler, which would report them as crashed, goes first.)"""
    children = [child for child in multiprocessing.active_children() if child.daemon]
    if children and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        child.kill()


def die_with_launcher():
    """End this process at once (SIGKILL: nothing more is written) when the launcher that
    started it dies, e.g. a torchrun killed with kill -9 or by the OOM killer, whose
    workers would otherwise train on, re-parented, beside the next run."""
    launcher = os.getppid()
    if sys.platform.startswith("linux"):
        _set_parent_death_signal(signal.SIGKILL)
    else:
        threading.Thread(target=_watch_parent, args=(launcher,), name="launcher-watch", daemon=True).start()
    if os.getppid() != launcher:  # it died before the signal was set
        os.kill(os.getpid(), signal.SIGKILL)


def _set_parent_death_signal(signum):
    """Linux: the kernel sends ``signum`` to this process when its parent ends."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum))


def _watch_parent(parent, interval=1.0):
    """Elsewhere: notice within ``interval`` seconds that the parent is gone (re-parented)."""
    while os.getppid() == parent:
        threading.Event().wait(interval)
    os.kill(os.getpid(), signal.SIGKILL)
