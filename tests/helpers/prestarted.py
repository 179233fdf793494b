"""Test helper: a Python that has already imported torch, and forks a fresh process per script run.

    python tests/helpers/prestarted.py        # then one JSON request per line on stdin

Importing torch and torchvision costs ~5 s of every process; the suite starts ~100 script
processes. This server pays it once: for each request it forks a child that becomes what
``python SCRIPT ARGS`` or ``python -m MODULE ARGS`` would be (its own pid, environment, working folder, stdin, stdout
and stderr files, exit code; atexit handlers and threads finished as at a normal exit).
Only third-party packages are imported before the fork; the project's own modules are
imported afresh in every child, as in a new process. The server itself never runs a torch
operation, so no thread pool exists to be lost in the fork.

Request: {"argv": [script, args...] or ["-m", module, args...], "env": {...}, "cwd": dir, "stdout": path, "stderr": path,
          "rc": path}. Reply: the child's pid, one line on stdout. When the child has ended,
the server writes its exit code (as subprocess reports it: -N for a signal) to the "rc" path.
"""
import json
import os
import select
import sys
import warnings

import matplotlib  # noqa: F401  (the heavy third-party imports of the project, once)
import matplotlib.backends.backend_agg  # noqa: F401  (what the pictures import where they are drawn)
import matplotlib.figure  # noqa: F401
import numpy
import PIL.Image  # noqa: F401
import torch  # noqa: F401
import torch.distributed  # noqa: F401
import torch.export  # noqa: F401  (export.py; its tracer's modules load on first use)
import torch.export._trace  # noqa: F401
import torch.export.pt2_archive._package  # noqa: F401  (what torch.export.load reads a .pt2 with: 2.4 s)
import torch.fx.experimental.symbolic_shapes  # noqa: F401
import torch.utils.data  # noqa: F401
import torch.utils.tensorboard  # noqa: F401  (the recorder's SummaryWriter)
import torchvision  # noqa: F401
import torchvision.transforms.v2  # noqa: F401
import tqdm  # noqa: F401

BASE_PATH = list(sys.path[1:])  # without this helper's own folder
FILTERS = list(warnings.filters)  # a new process's warning filters after these imports, before PYTHONWARNINGS


def run_child(request):
    """In the forked child: become ``python argv...`` and exit with its exit code."""
    os.setsid()  # its own session, so that killing its tree never reaches the server
    stdin = os.open(os.devnull, os.O_RDONLY)
    stdout = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    stderr = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    run_as_main(request["argv"], request["env"], request["cwd"])


def run_as_main(argv, env, cwd):
    """In a forked child whose descriptors 0-2 are its own: run ``python argv...`` as a new
    interpreter would (its environment, working folder, warning filters, unbuffered text
    streams, sys.path and sys.argv) and exit with its exit code. Never returns."""
    import atexit
    import runpy
    import threading

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # the child's PYTHONWARNINGS, as a new interpreter reads it at start (-W's own parser)
    warnings.filters[:] = FILTERS
    sys.warnoptions[:] = [option for option in os.environ.get("PYTHONWARNINGS", "").split(",") if option]
    warnings._processoptions(sys.warnoptions)
    # unbuffered text streams, as PYTHONUNBUFFERED=1 gives a new process
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", buffering=1, encoding=sys.__stdout__.encoding, errors=sys.__stdout__.errors,
                      closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding=sys.__stderr__.encoding, errors="backslashreplace",
                      closefd=False)
    sys.__stdout__, sys.__stderr__, sys.__stdin__ = sys.stdout, sys.stderr, sys.stdin
    numpy.random.seed()  # a new process draws a new NumPy seed
    argv = list(argv)
    module = argv[1] if argv[0] == "-m" else None
    # sys.path[0]: the script's folder, or for -m the working folder (as python sets them)
    first = os.getcwd() if module else os.path.dirname(os.path.abspath(argv[0]))
    sys.path[:] = [first] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + BASE_PATH
    sys.argv = [module] + argv[2:] if module else argv  # run_module sets argv[0] to the module's file
    code = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # as the interpreter reports an uncaught error: kept in sys.last_* through the exit
        sys.last_type, sys.last_value, sys.last_traceback = sys.exc_info()
        sys.excepthook(*sys.exc_info())
        code = 1
    try:  # what the interpreter does at exit: wait for threads, run atexit, flush
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


def write_exit_code(path, status):
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    with open(path + ".tmp", "w") as f:
        f.write(str(code))
    os.replace(path + ".tmp", path)


def serve():
    """Read requests until stdin closes; reap children as they end."""
    running = {}  # pid -> rc path
    buffer = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.02)
        if ready:
            chunk = os.read(0, 65536)
            if not chunk:
                break
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    run_child(request)
                running[pid] = request["rc"]
                os.write(1, f"{pid}\n".encode())
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            write_exit_code(running.pop(pid), status)


if __name__ == "__main__":
    serve()
