"""How a run ends: user-facing errors in one line, and stops on a signal, never a traceback.

Bad input is a UserError: one clear line and a non-zero exit. Ctrl-C stops every rank within
seconds; SIGTERM and SIGUSR1 are preemption notices (the run saves, then stops).
"""
import contextlib
import ctypes
import errno
import gc
import io
import multiprocessing
import os
import re
import signal
import sys
import threading

import torch
import torch.distributed as dist


# --- Stop on Ctrl-C within seconds on every rank; take SIGTERM and SIGUSR1 as preemption notices ---
# Ctrl-C (SIGINT) stops at once. While the epochs run, SIGTERM and SIGUSR1 are a notice:
# training saves, then stops.
#
# A notice (SLURM's ``--signal=USR1@120``, the SIGTERM that Kubernetes, spot machines and
# torchrun send before a grace period) only sets a flag while the epochs run (``arm_notices``);
# the training loop reads it at its next step, saves a checkpoint of that step and exits with
# PREEMPTED_EXIT_CODE (see train_eval_utils.MidEpochCheckpoints). Further notices change nothing then, and nothing
# ends the save but SIGINT or SIGKILL. Before the epochs run (start-up, --eval-only), a notice
# stops at once as SIGINT does: there is nothing new to save.
#
# A rank blocked in a collective (gloo, NCCL) runs Python signal handlers only when the
# collective returns, which can be never. So the handler itself only raises an exception
# (once), and a watchdog thread, woken at once through ``signal.set_wakeup_fd``, ends the
# process if the main thread has not finished unwinding after a grace period. Neither waits
# on a collective.

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
    for child in children:  # reaped; one in a read that never returns (a dead NFS mount) cannot die: not waited for
        child.join(timeout=1)


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


# Exit code for bad input (argparse uses it for unknown flags too).
EXIT_USER_ERROR = 2


class UserError(Exception):
    """A mistake in the user's input (paths, flags, data). Its message says what to do.

    Every rank checks the same input and fails the same way, so only local rank 0 prints
    it. Takes a single string so that a DataLoader worker can re-raise it in the main
    process as the same type.
    """

    rank_specific = False


class RankError(UserError):
    """An error only this rank saw (an image file in its shard): printed by this rank."""

    rank_specific = True


class MidRunError(RankError):
    """A fault in the middle of a run (an image file gone): the training script's recorder
    adds which checkpoint is intact and how to resume (``RunRecorder.explain_faults``)."""


class UnreadableImage(MidRunError):
    """An image file met by the loader that cannot be read or decoded (gone, no permission,
    corrupt, too many pixels): ``my_dataset.MyDataSet`` replaces it (training) or leaves it
    out (validation)."""


def printable(name):
    """``name`` (text, or a path as bytes) safe to print and to write as UTF-8: the bytes of a
    file name that are not UTF-8 (which Python holds as lone surrogates) appear as ``\\xe9``
    escapes instead of raising UnicodeEncodeError."""
    text = os.fsdecode(name)
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a lone surrogate that no file name decodes to
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


class ResourceError(MidRunError):
    """The machine ran out of something (disk space, memory) while this rank worked. A
    training run adds which checkpoint is intact and how to resume."""


# What a full disk and exhausted memory say, also where only the text of an error survives
# (an error re-raised from a DataLoader worker, one raised by C++ code).
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXTS = ("No space left on device", "Disk quota exceeded")
_OUT_OF_MEMORY_TEXTS = ("can't allocate memory", "out of memory", "not enough memory", "Cannot allocate memory")


def _chain(error):
    """``error`` and the errors it was raised from or while handling (``__cause__``, an
    unsuppressed ``__context__``): torch.save's own error hides the OSError of the write there."""
    seen = []
    while error is not None and all(error is not e for e in seen):
        seen.append(error)
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return seen


def _disk_full_reason(error):
    """"No space left on device" or "Disk quota exceeded" if that is what ``error`` comes from, else None."""
    for e in _chain(error):
        if isinstance(e, OSError) and e.errno in _DISK_FULL_ERRNOS:
            return os.strerror(e.errno)
        found = [text for text in _DISK_FULL_TEXTS if text in str(e)]
        if found:
            return found[0]
    return None


def _allocation_size(text):
    """" of 30.0 GB" from an allocator's "tried to allocate 30000000000 bytes" (CPU), " of
    20.00 GiB" from "Tried to allocate 20.00 GiB" (CUDA); "" if the text does not say."""
    match = re.search(r"[Tt]ried to allocate ([\d.]+) ?(bytes|[KMGT]i?B)", text)
    if not match:
        return ""
    if match.group(2) == "bytes":
        return f" of {int(float(match.group(1))) / 1e9:.1f} GB"
    return f" of {match.group(1)} {match.group(2)}"


def _is_out_of_memory(error):
    """Whether ``error`` comes from an allocation that failed (CPU, CUDA, MPS or Python's own)."""
    out_of_memory = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    return any(isinstance(e, (MemoryError, out_of_memory)) or
               (isinstance(e, RuntimeError) and any(text in str(e) for text in _OUT_OF_MEMORY_TEXTS))
               for e in _chain(error))


def disk_full_error(error, path=None):
    """``error`` as a ResourceError naming the file (``path``, if given) if it comes from a
    full disk, else None."""
    if isinstance(error, ResourceError):
        return error  # already named its file
    reason = _disk_full_reason(error)
    if reason is None:
        return None
    path = path or next((e.filename for e in _chain(error) if isinstance(e, OSError) and e.filename), None)
    return ResourceError(f"disk full: could not write {path or 'a file'} ({reason}); free space on that disk")


def resource_error(error):
    """``error`` as one ResourceError saying what to do, if it comes from a full disk or from
    exhausted memory; else None."""
    if isinstance(error, ResourceError):
        return error
    full = disk_full_error(error)
    if full is not None:
        return full
    if _is_out_of_memory(error):
        size = _allocation_size("\n".join(str(e) for e in _chain(error)))
        return ResourceError(f"out of memory: could not allocate a block{size}; use a smaller --batch-size or "
                             "--img-size")
    return None


def one_line(error):
    """The message of ``error`` as one printable line (a worker-raised error carries the
    worker's traceback text: its last line)."""
    text = str(error).strip()
    line = text.splitlines()[-1] if text else type(error).__name__
    for prefix in (f"{type(error).__module__}.{type(error).__name__}: ", f"{type(error).__name__}: "):
        line = line.removeprefix(prefix)
    return printable(line)


def report_error(error):
    """Print ``error: ...`` on stderr, once per node (or from the rank it concerns)."""
    rank, world_size = os.environ.get("RANK", "0"), int(os.environ.get("WORLD_SIZE", "1"))
    if error.rank_specific:
        prefix = f"[rank {rank}] " if world_size > 1 else ""
    elif os.environ.get("LOCAL_RANK", "0") == "0":
        prefix = ""
    else:
        return
    print(f"{prefix}error: {one_line(error)}", file=sys.stderr, flush=True)


def _collective_failure(error):
    """One line for a collective that failed because of another process, else None."""
    text = str(error)
    if isinstance(error, (dist.DistStoreError, dist.DistNetworkError)) or not isinstance(error, RuntimeError):
        return None  # the rendezvous itself failed, or not a collective: report as it is
    if "timed out" in text.lower() or "timeout" in text.lower():
        return ("a collective timed out after --dist-timeout: another process stopped answering (it hangs or is "
                f"gone): {one_line(error)}")
    if isinstance(error, dist.DistBackendError) or "Connection closed by peer" in text or "Connection reset" in text:
        return f"lost contact with another process (it failed or was stopped; see its error): {one_line(error)}"
    return None


def loader_failure(error):
    """One line for a data loader whose worker died or hung (torch's RuntimeError), else None."""
    text = str(error)
    if not isinstance(error, RuntimeError):
        return None
    hung = re.search(r"DataLoader timed out after ([\d.]+) seconds", text)
    if hung:
        return (f"a data loader's worker gave no batch in {float(hung.group(1)):g} s: it hangs (a file system that stopped "
                "answering?); check the data's disk, or run with --workers 0 to load in the process itself")
    died = re.search(r"DataLoader worker \(pids?\(?s?\)? ?([\d, ]+)\)? (?:is )?(exited unexpectedly|killed by signal: "
                     r"[^.]*)", text)
    if died:
        return (f"a data loader's worker (pid {died.group(1).strip()}) ended: {died.group(2).strip()} (the "
                "out-of-memory killer, or a crash); use fewer --workers, or --workers 0 to see its error")
    return None


def run_cli(main, argv=None):
    """Run an entry script's ``main(argv)``: a UserError, a full disk or exhausted memory
    becomes one line and exit code 2; a collective that lost its peer one line and exit code
    1; Ctrl-C / SIGTERM one line on how to resume (rank 0) and exit code 128 + the signal number
    (75 after a preemption notice's save); any other error its traceback. On every way out, this
    process's loader workers are ended first: an error's traceback keeps the loader alive, and
    Python's exit would wait for its workers. Then what the run built is freed while the
    interpreter is whole: a model left in a reference cycle, or in the handled error's
    traceback, would otherwise be torn down during the interpreter's exit, and DDP's process
    group with it (gloo then aborts the process now and then: "terminate called ...")."""
    print_lines_in_order()
    code = _exit_code(main, argv)
    gc.collect()  # the handled error and its frames are gone by now; cycles go here
    if code:
        sys.exit(code)


def print_lines_in_order():
    """stdout written to a file or a pipe: flushed at each line, as on a terminal, so that its
    lines and stderr's (never held back) reach the file in the order they were printed."""
    if isinstance(sys.stdout, io.TextIOWrapper) and not sys.stdout.line_buffering:
        sys.stdout.reconfigure(line_buffering=True)


def _exit_code(main, argv):
    """``main(argv)``'s exit code, its error reported as run_cli says; other errors raised."""
    try:
        try:
            main(argv)
        finally:
            # on an error, while its traceback holds the loader: freeing it joins each worker
            # for 5 s, one that hangs included, and meanwhile the other ranks wait
            end_loader_workers()
        return 0
    except UserError as e:
        report_error(e)
        return EXIT_USER_ERROR
    except TrainingInterrupted as e:  # also Preempted: saved, exit code 75
        if e.report():
            print(f"\n{e.report()}", file=sys.stderr, flush=True)
        return e.exit_code
    except Exception as e:
        fault = resource_error(e)
        if fault is not None:
            report_error(fault)
            return EXIT_USER_ERROR
        message = loader_failure(e) or _collective_failure(e)
        if message is None:
            raise
        report_error(RankError(message))
        return 1
