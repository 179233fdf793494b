"""Test helper: torchrun whose workers start without importing torch again.

    python tests/helpers/forking_torchrun.py [torchrun's flags] SCRIPT [ARGS...]

This is torchrun itself (torch.distributed.run's main: its agent, rendezvous, signal
forwarding, restarts and exit codes), in a Python that has imported torch and torchvision
once (prestarted.py's imports). One thing differs: where torchrun starts a worker as
``python -u SCRIPT ARGS`` with subprocess.Popen, Popen's child (its own session, its stdio,
every other descriptor closed, torchrun its parent) does not execute a new interpreter: it
becomes the script as prestarted.py's children do, with the signal handlers, environment,
warning filters and exit code of a new interpreter, the project's modules imported afresh.
A worker then starts in a fraction of a second instead of ~3 s of imports.
The tests run torchrun as ``TORCHRUN`` in tests/conftest.py; TESTS_FRESH_PROCESSES=1 runs the
plain ``python -m torch.distributed.run`` instead.
"""
import os
import runpy
import signal
import subprocess
import sys
import warnings
import weakref

import prestarted  # noqa: F401  (the heavy imports, once; and how a child becomes a script)
import torch
from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

# The handlers a new interpreter started from here would have: this process's before torchrun
# installed its own (a signal ignored stays ignored across exec, as here).
HANDLERS_AT_START = {number: signal.getsignal(number) for number in signal.valid_signals()
                     if number not in (signal.SIGKILL, signal.SIGSTOP)}
IGNORED_BY_PYTHON = [getattr(signal, name) for name in ("SIGPIPE", "SIGXFSZ") if hasattr(signal, name)]
popen = subprocess_handler.SubprocessHandler._popen


def become_the_worker(argv, env):
    """Popen's preexec_fn for a worker: run ``python -u argv...`` in this child and exit, never
    reaching exec."""
    import gc
    import traceback

    os.closerange(3, 65536)  # Popen's pipe that waits for exec: closed, so torchrun goes on
    try:
        gc.enable()  # Popen disabled it around the fork
        for number, handler in HANDLERS_AT_START.items():
            if signal.getsignal(number) != handler:  # torchrun's own handlers
                signal.signal(number, signal.SIG_DFL if handler is None else handler)
        for number in IGNORED_BY_PYTHON:  # Popen set them to SIG_DFL for exec; Python ignores them at start
            signal.signal(number, signal.SIG_IGN)
        for finalizer in list(weakref.finalize._registry):  # torchrun's clean-up at exit is not the worker's
            finalizer.atexit = False
    except BaseException:  # Popen's error pipe is closed: say it here
        traceback.print_exc()
        os._exit(1)
    prestarted.run_as_main(argv, env, os.getcwd())


def forking_popen(self, args, env):
    """SubprocessHandler._popen: ``python -u ...`` forks; anything else starts as torchrun starts it."""
    if len(args) < 3 or args[0] != sys.executable or args[1] != "-u":
        return popen(self, args, env)
    with warnings.catch_warnings():  # Python 3.12+ warns of a fork in a process with threads (the store's)
        warnings.simplefilter("ignore", DeprecationWarning)
        return subprocess.Popen(args=args, env=env, stdout=self._stdout, stderr=self._stderr, start_new_session=True,
                                preexec_fn=lambda: become_the_worker(list(args[2:]), env))


if __name__ == "__main__":
    # CUDA cannot be used in a forked child once this process has asked about it (torchrun's
    # launch config does): where a GPU is visible, workers start as torchrun starts them
    if not torch.cuda.is_available():
        subprocess_handler.SubprocessHandler._popen = forking_popen
    sys.argv[0] = "-m"  # as ``python -m torch.distributed.run`` runs it
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
