"""User-facing errors: one clear line and a non-zero exit, never a traceback."""
import os
import signal
import sys

import torch.distributed as dist

from multi_train_utils.signals import TrainingInterrupted

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
    """A fault in the middle of a run (an image file gone): its line ends with how to resume,
    once the training script has said how (``set_resume_hint``)."""


_resume_hint = []  # [text] once a training run has set it


def set_resume_hint(text):
    """What a MidRunError's line adds: how to continue from the last finished epoch."""
    _resume_hint[:] = [text]


def printable(text):
    """``text`` safe to print and log: bytes of a file name that are not UTF-8 (which Python
    holds as lone surrogates) shown as ``\\xe9`` escapes instead of failing the write."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        try:
            raw = text.encode("utf-8", "surrogateescape")  # the name's bytes, as on disk
        except UnicodeEncodeError:
            raw = text.encode("utf-8", "backslashreplace")
        return raw.decode("utf-8", "backslashreplace")


def _one_line(error):
    """The message; a worker-raised error carries the worker's traceback text: keep its last line."""
    text = str(error).strip()
    line = text.splitlines()[-1] if text else type(error).__name__
    for prefix in (f"{type(error).__module__}.{type(error).__name__}: ", f"{type(error).__name__}: "):
        line = line.removeprefix(prefix)
    if isinstance(error, MidRunError) and _resume_hint:
        line = f"{line}; {_resume_hint[0]}"
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
    print(f"{prefix}error: {_one_line(error)}", file=sys.stderr, flush=True)


def _collective_failure(error):
    """One line for a collective that failed because of another process, else None."""
    text = str(error)
    if isinstance(error, (dist.DistStoreError, dist.DistNetworkError)) or not isinstance(error, RuntimeError):
        return None  # the rendezvous itself failed, or not a collective: report as it is
    if "timed out" in text.lower() or "timeout" in text.lower():
        return ("a collective timed out after --dist-timeout: another process stopped answering (it hangs or is "
                f"gone): {_one_line(error)}")
    if isinstance(error, dist.DistBackendError) or "Connection closed by peer" in text or "Connection reset" in text:
        return f"lost contact with another process (it failed or was stopped; see its error): {_one_line(error)}"
    return None


def run_cli(main, argv=None):
    """Run an entry script's ``main(argv)``: a UserError becomes one line and exit code 2;
    a collective that lost its peer one line and exit code 1; Ctrl-C / SIGTERM one line on
    how to resume (rank 0) and exit code 128 + the signal number."""
    try:
        main(argv)
    except UserError as e:
        report_error(e)
        sys.exit(EXIT_USER_ERROR)
    except TrainingInterrupted as e:
        if e.message:
            print(f"\ninterrupted by {signal.Signals(e.signum).name}: {e.message}", file=sys.stderr, flush=True)
        sys.exit(128 + e.signum)
    except Exception as e:
        message = _collective_failure(e)
        if message is None:
            raise
        report_error(RankError(message))
        sys.exit(1)
