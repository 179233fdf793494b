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
    wakeup pipe: it drops the pipe, ignores SIGINT (the main process shuts it down; SIGTERM
    keeps torch's own worker handler, which the shutdown relies on) and dies with its
    parent, so a killed trainer never leaves loader workers behind."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
