"""Stop cleanly on Ctrl-C (SIGINT) and SIGTERM, within seconds, on every rank.

A rank blocked in a collective (gloo, NCCL) runs Python signal handlers only when the
collective returns, which can be never. So the handler itself only raises an exception,
and a watchdog thread, woken at once through ``signal.set_wakeup_fd``, prints how to
resume and, if the main thread has not finished unwinding after a grace period, ends the
process. Neither waits on a collective.
"""
import os
import signal
import sys
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; the exit code is 128 + the signal number."""

    def __init__(self, signum=signal.SIGINT):
        super().__init__(signum)
        self.signum = int(signum)


def _raise_interrupted(signum, frame):
    raise TrainingInterrupted(signum)


def install_stop_handlers(message=None, grace_seconds=6.0):
    """Turn SIGINT/SIGTERM into TrainingInterrupted; print ``message`` (if given) at once and
    force the exit after ``grace_seconds`` if unwinding hangs. Main thread only."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for signum in STOP_SIGNALS:
        signal.signal(signum, _raise_interrupted)

    def watchdog():
        while True:
            signum = os.read(read_fd, 1)[0]  # every signal with a Python handler writes its number
            if signum in STOP_SIGNALS:
                break
        if message:
            print(f"\ninterrupted by {signal.Signals(signum).name}: {message}", file=sys.stderr, flush=True)
        threading.Event().wait(grace_seconds)
        os._exit(128 + signum)  # still here: the main thread is stuck, e.g. in a collective

    threading.Thread(target=watchdog, name="stop-watchdog", daemon=True).start()
