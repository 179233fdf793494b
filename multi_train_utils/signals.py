"""Stop cleanly on Ctrl-C (SIGINT) and SIGTERM, within seconds, on every rank.

A rank blocked in a collective (gloo, NCCL) runs Python signal handlers only when the
collective returns, which can be never. So the handler itself only raises an exception
(once), and a watchdog thread, woken at once through ``signal.set_wakeup_fd``, ends the
process if the main thread has not finished unwinding after a grace period. Neither waits
on a collective.
"""
import ctypes
import os
import signal
import sys
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; the exit code is 128 + the signal number. ``message`` says
    how to resume (rank 0 only)."""

    def __init__(self, signum=signal.SIGINT, message=None):
        super().__init__(signum)
        self.signum = int(signum)
        self.message = message


def install_stop_handlers(message=None, grace_seconds=3.0):
    """Turn SIGINT/SIGTERM into TrainingInterrupted; if unwinding hangs for ``grace_seconds``,
    print ``message`` (if given) and end the process. Call from the main thread."""
    def raise_interrupted(signum, frame):
        for other in STOP_SIGNALS:  # once: a second signal must not interrupt the clean-up
            signal.signal(other, signal.SIG_IGN)
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
            if signum in STOP_SIGNALS:
                break
        threading.Event().wait(grace_seconds)
        if message:
            os.write(2, f"\ninterrupted by {signal.Signals(signum).name}: {message}\n".encode())
        os._exit(128 + signum)  # still here: the main thread is stuck, e.g. in a collective

    threading.Thread(target=watchdog, name="stop-watchdog", daemon=True).start()


def reset_in_worker(worker_id=None):
    """DataLoader ``worker_init_fn``. A forked loader worker inherits the handlers and the
    wakeup pipe: it drops the pipe, ignores SIGINT and leaves quietly on SIGTERM (the main
    process shuts it down and reports the interruption; SLURM and torchrun send SIGTERM to
    every process, and a worker killed by it would be reported as a crash instead), and it
    dies with its parent, so a killed trainer never leaves loader workers behind."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _leave_quietly)
    if sys.platform.startswith("linux"):
        _set_parent_death_signal(signal.SIGKILL)


def _leave_quietly(signum, frame):
    os._exit(0)


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
