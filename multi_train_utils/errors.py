"""User-facing errors: one clear line and a non-zero exit, never a traceback."""
import os
import sys

# Exit codes the entry scripts use (argparse itself exits 2 on unknown flags).
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """A mistake in the user's input (paths, flags, data). Its message says what to do.

    Takes a single string so that a DataLoader worker can re-raise it in the main process
    as the same type.
    """


def run_cli(main, argv=None):
    """Run an entry script's ``main(argv)``; turn a UserError into one line on stderr.

    Only global rank 0 prints (every rank sees the same input, so every rank fails the same
    way); every rank exits non-zero.
    """
    try:
        main(argv)
    except UserError as e:
        if os.environ.get("RANK", "0") == "0":
            # A worker-raised error carries the worker's traceback text: keep its last line.
            message = str(e).strip().splitlines()[-1] if str(e).strip() else "error"
            message = message.removeprefix(f"{UserError.__module__}.UserError: ")
            message = message.removeprefix("UserError: ")
            print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
