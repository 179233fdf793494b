"""Shared fixtures: tiny generated image folders and the training runs several tests read.

Every training run is a real subprocess (python, torchrun, torch.distributed.launch); runs
that several tests read are session-scoped so that each is launched once.
"""
import concurrent.futures
import contextlib
import csv
import importlib.util
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading

import pytest
from PIL import Image

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A suite started in the background by a shell without job control (``cmd &``) inherits SIGINT
# ignored, and so would every run it starts: the tests of Ctrl-C need it as a terminal gives it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, REPO)

from multi_train_utils.datasets import DEMO_CLASSES, _draw_flower  # noqa: E402

PYTHON = sys.executable
# torchrun whose workers fork from it instead of importing torch afresh (see the helper);
# TESTS_FRESH_PROCESSES=1: plain torchrun
TORCHRUN = ([PYTHON, "-m", "torch.distributed.run"] if os.environ.get("TESTS_FRESH_PROCESSES") == "1"
            else [PYTHON, os.path.join(REPO, "tests", "helpers", "forking_torchrun.py")])


def torchrun_passing_sigusr1():
    """(flags, env) that make torchrun pass SIGUSR1 on to its workers, as docs/multi-gpu.md says:
    its --signals-to-handle flag where it has one (it overwrites the variable), else the variable."""
    from torch.distributed.run import get_args_parser

    signals = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    if any("--signals-to-handle" in action.option_strings for action in get_args_parser()._actions):
        return [f"--signals-to-handle={signals}"], {}
    return [], {"TORCHELASTIC_SIGNALS_TO_HANDLE": signals}
PROBE = os.path.join(REPO, "tests", "helpers", "probe.py")  # a script's main() with probes patched in
PRESTARTED = os.path.join(REPO, "tests", "helpers", "prestarted.py")  # see Prestarted
# Small and fast: a small network (0.35 M parameters, with BatchNorm and an ``fc`` head like a
# ResNet's: 30x fewer than resnet18, whose 11 M parameters cost most of a tiny run in the
# gradient all-reduce, the optimizer step and the checkpoints) on 32 px images, no pictures
# (single_run draws them), every epoch's weights kept (tests compare them); every run also
# gets its own --log-dir.
MODEL = "shufflenet_v2_x0_5"
FAST = ["--model", MODEL, "--img-size", "32", "--batch-size", "4", "--no-plots", "--keep-last", "0"]
CLASSES = list(DEMO_CLASSES)
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RUN_ID", "GROUP_RANK")


CORES = len(os.sched_getaffinity(0))
# The two training scripts and whether their parser is train_multi_gpu.py's (DDP flags).
SCRIPTS = {"train_single.py": False, "train_multi_gpu.py": True}


def parse_flags(distributed, *flags):
    """The flags as the training script's parser (``distributed``: train_multi_gpu.py's) reads them."""
    from multi_train_utils.options import get_args_parser, parse_args

    return parse_args(get_args_parser(distributed), list(flags))


def full_flags(**given):
    """The training scripts' settings as the engine receives them: every flag of both scripts at
    its parser default (train_single.py's), with ``given`` instead."""
    from argparse import Namespace

    from multi_train_utils.options import SINGLE_PROCESS_SETTINGS, get_args_parser

    return Namespace(**{**vars(get_args_parser(False).parse_args([])), **SINGLE_PROCESS_SETTINGS, **given})


def run_recorder(args, data, state=None, checkpoint=None, task=None, **kwargs):
    """The scripts' RunRecorder of the flags ``args``, with their EpochDecider: its end_epoch
    decides (the best epoch, --patience) and then writes, and its finish prints the decider's
    clock, as the scripts' epoch loop does. ``kwargs``: RunRecorder's own."""
    from multi_train_utils.checkpoint import TrainState
    from multi_train_utils.recorder import EpochDecider
    from multi_train_utils.options import config_of
    from multi_train_utils.recorder import RunRecorder

    class DecidingRecorder(RunRecorder):
        def end_epoch(self, epoch, train_stats, eval_result, ema_result=None, seconds=0.0):
            source = self.decider.end_epoch(epoch, eval_result, ema_result)
            super().end_epoch(epoch, train_stats, eval_result, ema_result, seconds=seconds, source=source)

        def finish(self):
            super().finish(self.decider)

    state = state if state is not None else TrainState(None)
    config = config_of(args)
    decider = EpochDecider(state, task, config.run, checkpoint)  # before the recorder: the resume's stop
    recorder = DecidingRecorder(config, data, state, checkpoint=checkpoint, task=task, **kwargs)
    recorder.decider = decider
    return recorder


def help_blocks(parser):
    """{option string: its help text, on one line} from ``parser``'s --help."""
    blocks, current = {}, None
    for line in parser.format_help().splitlines():
        if line.startswith("  -"):
            head = re.split(r"\s{2,}", line.strip())[0]
            current = [line]
            for option in re.findall(r"(?<![\w-])(--?[\w-]+)", head):
                blocks[option] = current
        elif current is not None and line.startswith("   "):
            current.append(line)
        else:
            current = None
    return {option: " ".join(" ".join(lines).split()) for option, lines in blocks.items()}


class Labelled:
    """A dataset of ``targets``. Its images (3x8x8 uint8 zeros) can be read only if
    ``readable``: counting classes or images must not read one."""

    def __init__(self, targets, readable=False):
        self.targets, self.readable = targets, readable

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        import torch

        assert self.readable, "an image was read to count the classes"
        return torch.zeros(3, 8, 8, dtype=torch.uint8), int(self.targets[index])


@contextlib.contextmanager
def stop_handlers(monkeypatch, on_exit, ended, *args, **kwargs):
    """signals.install_stop_handlers(*args, **kwargs) in this process, as if SIGINT and SIGTERM
    were not ignored, with os._exit replaced by ``on_exit``; afterwards (once the Event
    ``ended`` is set, or 5 s have passed, so that the watchdog never calls the real os._exit)
    every handler and the wakeup fd are put back."""
    from multi_train_utils import errors as signals

    saved = {s: signal.getsignal(s) for s in signals.STOP_SIGNALS}
    saved_fd = signal.set_wakeup_fd(-1)
    monkeypatch.setattr(signals.os, "_exit", on_exit)
    try:
        for s in signals.STOP_SIGNALS:  # not ignored, also when pytest runs in the background
            signal.signal(s, signal.default_int_handler)
        signals.install_stop_handlers(*args, **kwargs)
        yield
    finally:
        ended.wait(5)
        signal.set_wakeup_fd(saved_fd)
        for s, handler in saved.items():
            signal.signal(s, handler)


def free_port(low=None, high=None):
    """A TCP port nobody listens on (in [low, high) if given)."""
    for _ in range(200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", random.randrange(low, high) if low else 0))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port")


# No test uses the network: every HTTP(S) request of a test's process goes to a proxy on a
# port where nothing listens, and fails at once (torch.hub, --download and urllib alike).
NO_NETWORK = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
              "HTTPS_PROXY": "http://127.0.0.1:9", "no_proxy": "", "NO_PROXY": ""}
os.environ.update(NO_NETWORK)  # the tests that run in-process too


# A deprecation is a failure, the day it appears: a DeprecationWarning or FutureWarning is an
# error in this process (pytest's filterwarnings) and in every process a test starts
# (PYTHONWARNINGS), where the training scripts run. THIRD_PARTY_INTERNALS would list, after
# them, the warnings a package raises about its own internals, never about a call of ours
# (none today); a test that expects a warning (TorchScript's) passes its own PYTHONWARNINGS.
DEPRECATIONS_AS_ERRORS = ("error::DeprecationWarning", "error::FutureWarning")
THIRD_PARTY_INTERNALS = ()


def pytest_configure(config):
    for line in DEPRECATIONS_AS_ERRORS + THIRD_PARTY_INTERNALS:  # the last matching line wins
        config.addinivalue_line("filterwarnings", line)


def subprocess_env(extra=None):
    """This environment without any launcher's variables, with no network, deprecations as
    errors (DEPRECATIONS_AS_ERRORS), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("SLURM_")}
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=REPO, PYTHONWARNINGS=",".join(DEPRECATIONS_AS_ERRORS), **NO_NETWORK,
               PYTHONFAULTHANDLER="1")  # a crash (SIGABRT, SIGSEGV) prints every thread's Python stack
    env.update(extra or {})
    return env


def pids_of_tree(pid):
    """``pid`` and all its descendants (from /proc)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in os.listdir(f"/proc/{current}/task") if os.path.exists(f"/proc/{current}/task") else []:
            try:
                with open(f"/proc/{current}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
            except OSError:
                pass
    return found


def dump_stacks_then_kill_tree(pid):
    """A hung run: its processes print their threads' Python stacks (PYTHONFAULTHANDLER, on
    SIGABRT) into the run's output; then the tree is killed."""
    import signal
    import time

    pids = pids_of_tree(pid)
    for p in pids:
        try:
            os.kill(p, signal.SIGABRT)
        except OSError:
            pass
    deadline = time.monotonic() + 3
    while any(alive(p) for p in pids) and time.monotonic() < deadline:  # each ends once it has printed
        time.sleep(0.05)
    kill_tree(pid)


def alive(pid):
    """Whether process ``pid`` runs (a zombie has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


class TimeoutExpiredWithStacks(subprocess.TimeoutExpired):
    """A run's time-out whose message ends with the end of its output: the stacks of where
    its processes hung."""

    def __str__(self):
        tail = "\n".join(str(part or "")[-6000:] for part in (self.stdout, self.stderr))
        return f"{super().__str__()}; the end of its output and stacks:\n{tail}"


def kill_tree(pid):
    """SIGKILL a process and everything it started (torchrun's workers sit in sessions of their own)."""
    import signal

    for p in pids_of_tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


# A time-out guards a hang only: the longest run (the 3-epoch demo) takes ~30 s on an idle
# 2-core machine and ~110 s beside two busy loops.
RUN_TIMEOUT = 600


class Prestarted:
    """The session's prestarted Python (tests/helpers/prestarted.py), started at first use: a
    script run forks from it instead of paying torch's import again. TESTS_FRESH_PROCESSES=1
    starts every script as a new interpreter instead (slower)."""

    def __init__(self):
        self.server, self.folder, self.count = None, None, 0
        self.lock = threading.Lock()

    def start(self, argv, env, cwd):
        """Fork ``python argv...``; return (pid, stdout path, stderr path, exit-code path)."""
        import tempfile

        with self.lock:
            if self.server is None or self.server.poll() is not None:
                self.folder = tempfile.mkdtemp(prefix="prestarted-")
                # the server imports third-party packages only; each child applies its own PYTHONWARNINGS
                server_env = {k: v for k, v in subprocess_env().items() if k != "PYTHONWARNINGS"}
                self.server = subprocess.Popen([PYTHON, PRESTARTED], cwd=REPO, env=server_env,
                                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self.count += 1
            prefix = os.path.join(self.folder, str(self.count))
            paths = {"stdout": prefix + ".out", "stderr": prefix + ".err", "rc": prefix + ".rc"}
            request = dict(paths, argv=list(argv), env=env, cwd=str(cwd))
            self.server.stdin.write((json.dumps(request) + "\n").encode())
            self.server.stdin.flush()
            pid = int(self.server.stdout.readline())
        return pid, paths

    def stop(self):
        import shutil

        if self.server is not None:
            self.server.stdin.close()
            self.server.wait(timeout=60)
            self.server.stdout.close()
            shutil.rmtree(self.folder, ignore_errors=True)


PRESTARTED_PYTHON = Prestarted()


@pytest.hookimpl(trylast=True)  # after the fixtures' teardown (-x, Ctrl-C), whose jobs it may still run
def pytest_sessionfinish(session, exitstatus):
    PRESTARTED_PYTHON.stop()


@pytest.fixture(scope="session", autouse=True)
def small_on_disk(tmp_path_factory, request):
    """The suite leaves little on disk (its runs write ~10 GB of checkpoints): at the end,
    everything in this session's temporary folder goes when every test passed; after a
    failure only files over 1 MB (weights, checkpoints) go, and the logs stay to be read."""
    import shutil

    yield
    base = tmp_path_factory.getbasetemp()
    passed = request.session.testsfailed == 0
    for entry in list(base.iterdir()):
        if passed:
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            continue
        for folder, _, files in os.walk(entry):
            for name in files:
                path = os.path.join(folder, name)
                if not os.path.islink(path) and os.path.getsize(path) > 1 << 20:
                    os.remove(path)


def forks_from_prestarted(cmd):
    """Whether ``cmd`` is ``python SCRIPT.py ...`` or ``python -m MODULE ...`` (torchrun among
    them: the launcher forks, its workers are new interpreters), which the prestarted Python runs."""
    return (len(cmd) > 2 and cmd[0] == PYTHON and (str(cmd[1]).endswith(".py") or cmd[1] == "-m")
            and os.environ.get("TESTS_FRESH_PROCESSES") != "1")


class ScriptProcess:
    """``python SCRIPT.py ...`` forked from the prestarted Python, or a new interpreter with
    TESTS_FRESH_PROCESSES=1; ``finish`` waits for it (killing its tree after ``deadline``)."""

    def __init__(self, cmd, env, cwd):
        self.cmd = cmd
        if forks_from_prestarted(cmd):
            self.pid, self.paths = PRESTARTED_PYTHON.start([str(c) for c in cmd[1:]], subprocess_env(env), cwd)
            self.proc = None
        else:
            self.proc = subprocess.Popen(cmd, cwd=cwd, env=subprocess_env(env), stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)
            self.pid = self.proc.pid

    def finish(self, deadline):
        """(exit code, stdout, stderr, timed out)."""
        import locale
        import time

        if self.proc is not None:
            try:
                stdout, stderr = self.proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
                return self.proc.returncode, stdout, stderr, False
            except subprocess.TimeoutExpired:
                dump_stacks_then_kill_tree(self.pid)
                stdout, stderr = self.proc.communicate()
                return self.proc.returncode, stdout, stderr, True
        timed_out = False
        while not os.path.exists(self.paths["rc"]):
            if not timed_out and time.monotonic() > deadline:
                dump_stacks_then_kill_tree(self.pid)
                timed_out = True
            time.sleep(0.01)
        encoding = locale.getpreferredencoding(False)
        with open(self.paths["stdout"], encoding=encoding) as out, \
                open(self.paths["stderr"], encoding=encoding) as err, open(self.paths["rc"]) as rc:
            stdout, stderr, code = out.read(), err.read(), int(rc.read())
        for path in self.paths.values():
            os.remove(path)
        return code, stdout, stderr, timed_out


class StartedJob:
    """A job a test signals or kills while it runs, started as a terminal would: in a session of
    its own, Ctrl-C (SIGINT) not ignored, also when pytest itself runs in the background of a
    script (where SIGINT is ignored, and a job started from there rightly keeps ignoring it).
    ``python SCRIPT.py ...`` forks from the prestarted Python (a session of its own; its SIGINT is
    a new interpreter's, as this file restores pytest's); anything else, or every job with
    TESTS_FRESH_PROCESSES=1, is a new process. Popen's pid, poll, wait, communicate, returncode."""

    def __init__(self, cmd, env=None):
        self.cmd, self.popen, self.returncode, self.output = cmd, None, None, None
        if forks_from_prestarted(cmd):
            self.process = ScriptProcess(cmd, env, REPO)
            self.pid = self.process.pid
        else:  # its output into files, as the prestarted Python's: a pipe nobody reads could fill and block it
            import tempfile

            self.files = [tempfile.TemporaryFile("w+") for _ in range(2)]
            self.popen = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(env), stdout=self.files[0],
                                          stderr=self.files[1], text=True, start_new_session=True,
                                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
            self.pid = self.popen.pid

    def poll(self):
        if self.popen is not None:
            self.returncode = self.popen.poll()
            if self.returncode is not None and self.output is None:
                for f in self.files:
                    f.seek(0)
                self.output = tuple(f.read() for f in self.files)
        elif self.output is None and os.path.exists(self.process.paths["rc"]):
            self.returncode, stdout, stderr, _ = self.process.finish(float("inf"))
            self.output = (stdout, stderr)
        return self.returncode

    def wait(self, timeout=None):
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.cmd, timeout)
            time.sleep(0.01)
        return self.returncode

    def communicate(self, timeout=None):
        """(stdout, stderr) once the job has ended; subprocess.TimeoutExpired after ``timeout``."""
        self.wait(timeout)
        return self.output


EARLY = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="early-job")


def started_early(request, test, function, *args):
    """``function(*args)`` in a thread of the suite, if ``test`` is among the tests this session
    runs (else None); ``.result()`` gives its return value or raises its exception. For jobs
    that mostly wait (for a time-out, a slow scontrol): a module-scoped fixture starts them as
    the module begins, and the module's other tests run while they wait."""
    if not any(getattr(item, "function", None) is test for item in request.session.items):
        return None
    return EARLY.submit(function, *args)


def torchcodec_decodes():
    """True where the loader decodes JPEGs with TorchCodec; False where TorchCodec is not
    installed at all (CI's aarch64 pair, whose torch has no TorchCodec with image decoders);
    a failure where it is installed but not used (a version that does not load, a broken import)."""
    from multi_train_utils import images

    if images.decode_jpeg is None and importlib.util.find_spec("torchcodec") is not None:
        pytest.fail(f"TorchCodec is installed but JPEGs are decoded by {images.JPEG_DECODER}")
    return images.decode_jpeg is not None


def run_ranks(world_size, cmd, timeout=RUN_TIMEOUT, env=None, cwd=REPO):
    """Run ``python SCRIPT.py ...`` as ``world_size`` processes of one job, each told its
    rank by the variables srun and torchrun set (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT): DDP for real over gloo, as srun launches
    it, without a launcher process. Returns a CompletedProcess with rank 0's stdout, every
    rank's stderr and the first non-zero exit code; a time-out kills every rank."""
    import time

    port = str(free_port())
    ranks = [ScriptProcess(cmd, dict(env or {}, RANK=str(r), WORLD_SIZE=str(world_size), LOCAL_RANK=str(r),
                                     LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
                           cwd) for r in range(world_size)]
    deadline = time.monotonic() + timeout
    results = [rank.finish(deadline) for rank in ranks]
    stdout, stderr = results[0][1], "".join(r[2] for r in results)
    if any(r[3] for r in results):
        raise TimeoutExpiredWithStacks(cmd, timeout, stdout, stderr)
    code = next((r[0] for r in results if r[0] != 0), 0)
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


def run(cmd, timeout=RUN_TIMEOUT, env=None, cwd=REPO):
    """Run a command to completion; return the CompletedProcess (stdout and stderr as text).
    On a time-out the whole process tree is killed, so no worker is left behind.
    ``python SCRIPT.py ...`` forks from the prestarted Python (see Prestarted)."""
    import time

    code, stdout, stderr, timed_out = ScriptProcess(cmd, env, cwd).finish(time.monotonic() + timeout)
    if timed_out:
        raise TimeoutExpiredWithStacks(cmd, timeout, stdout, stderr)
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


def outcome(call):
    """What ``call()`` returned, or the exception it raised (tests assert on either)."""
    try:
        return call()
    except Exception as e:  # noqa: BLE001 (the tests look at which one)
        return e


def script(name):
    return os.path.join(REPO, name)


def probe_records(prefix, world_size):
    """The JSON records that tests/helpers/probe.py wrote, one per rank."""
    import json

    records = []
    for rank in range(world_size):
        with open(f"{prefix}.rank{rank}.json") as f:
            records.append(json.load(f))
    return records


def cpuinfo_lists_bf16():
    """Whether /proc/cpuinfo lists bf16 instructions (AVX512-BF16 or AMX-BF16): read here,
    independently of the product's own check."""
    with open("/proc/cpuinfo") as f:
        flags = set(f.read().split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def read_metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.csv")) as f:
        return list(csv.DictReader(f))


TIMING_COLUMNS = ("images_per_second", "epoch_seconds", "run_seconds")


def metrics_without_timing(output_dir):
    """metrics.csv's rows without the columns that measure time: what two equal runs share."""
    return [{k: v for k, v in row.items() if k not in TIMING_COLUMNS} for row in read_metrics(output_dir)]


def top1_line(stdout):
    lines = [l for l in stdout.splitlines() if l.strip()]
    assert lines, "no output"
    return lines[-1]


def write_class_folder(folder, name, count, rng, size_range=(40, 72), formats=("jpg",)):
    """``count`` small flower-like images of class ``name`` in ``folder/name``."""
    petal, centre, petals = DEMO_CLASSES[name]
    os.makedirs(os.path.join(folder, name), exist_ok=True)
    for i in range(count):
        size = (rng.randint(*size_range), rng.randint(*size_range))
        img = _draw_flower(rng, petal, centre, petals, size)
        fmt = formats[i % len(formats)]
        img.save(os.path.join(folder, name, f"{name}_{i:03d}.{fmt}"))


def add_odd_files(folder):
    """Images in other modes and extensions, plus files that must be ignored or skipped."""
    rng = random.Random(1)
    daisy = _draw_flower(rng, *DEMO_CLASSES["daisy"], (50, 60))
    daisy.convert("L").save(os.path.join(folder, "daisy", "gray.PNG"))  # grayscale, upper-case extension
    daisy.convert("RGBA").save(os.path.join(folder, "daisy", "rgba.png"))
    roses = _draw_flower(rng, *DEMO_CLASSES["roses"], (64, 48))
    roses.convert("P", palette=Image.ADAPTIVE).save(os.path.join(folder, "roses", "palette.png"))
    roses.convert("CMYK").save(os.path.join(folder, "roses", "cmyk.JPEG"))
    tulips = _draw_flower(rng, *DEMO_CLASSES["tulips"], (56, 56))
    tulips.save(os.path.join(folder, "tulips", "photo.webp"))
    _draw_flower(rng, *DEMO_CLASSES["sunflowers"], (60, 50)).save(os.path.join(folder, "sunflowers", "bitmap.bmp"))
    tulips.save(os.path.join(folder, "tulips", ".hidden.jpg"))  # hidden: ignored
    with open(os.path.join(folder, "sunflowers", "notes.txt"), "w") as f:  # not an image: ignored
        f.write("not an image")
    with open(os.path.join(folder, "dandelion", "broken.jpg"), "wb") as f:  # undecodable: skipped
        f.write(b"this is not a jpeg")
    os.makedirs(os.path.join(folder, ".cache"))  # hidden folder: not a class


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A training folder (5 classes, 6 images each + 6 in other modes/formats = 36 images, a
    number that 2 ranks x batch 2 and 1 rank x batch 4 both use up exactly) and a separate
    validation folder of exactly 7 images (2, 2, 1, 1, 1)."""
    root = tmp_path_factory.mktemp("tiny")
    rng = random.Random(0)
    train, val = str(root / "train"), str(root / "val")
    for name in CLASSES:
        write_class_folder(train, name, 6, rng, formats=("jpg", "png", "jpeg"))
    add_odd_files(train)
    for name, count in zip(CLASSES, (2, 2, 1, 1, 1)):
        write_class_folder(val, name, count, rng)
    return {"train": train, "val": val, "root": str(root)}


def train_args(tiny_data, output_dir, *extra):
    """Flags of a tiny run on ``tiny_data`` with the 7-image validation folder; --check-images
    skips broken.jpg before training, so that the 36 images divide into whole batches."""
    return ["--data-path", tiny_data["train"], "--val-path", tiny_data["val"], "--check-images", *FAST,
            "--output-dir", str(output_dir), "--log-dir", str(output_dir) + "-tb", *extra]


@pytest.fixture(scope="session")
def single_run(tiny_data, tmp_path_factory):
    """python train_single.py (through the probe), 2 epochs, one loader worker."""
    out = tmp_path_factory.mktemp("single") / "out"
    result = run([PYTHON, PROBE, "single", *train_args(tiny_data, out, "--epochs", "2", "--workers", "1", "--plots")],
                 env={"PROBE_OUT": f"{out}.probe"})
    assert result.returncode == 0, result.stdout + result.stderr
    return {"out": str(out), "result": result, "probe": probe_records(f"{out}.probe", 1)[0]}


@pytest.fixture(scope="session")
def ddp_run(tiny_data, tmp_path_factory):
    """torchrun --nproc_per_node=2 train_multi_gpu.py (through the probe), 2 epochs. Rank 1
    resets its BatchNorm statistics after training each epoch: evaluation must not use them."""
    out = tmp_path_factory.mktemp("ddp") / "out"
    result = run([*TORCHRUN, "--nproc_per_node=2", "--master_port", str(free_port()), PROBE, "multi",
                  *train_args(tiny_data, out, "--epochs", "2", "--workers", "0")],
                 env={"PROBE_OUT": f"{out}.probe", "PROBE_SKEW_BN": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    return {"out": str(out), "result": result, "probe": probe_records(f"{out}.probe", 2)}


def assert_exact_accuracy(stdout, output_dir, epochs, val_images=7):
    """Every epoch line prints ``(correct/total)`` with total = the validation size (no image
    padded in or left out), and metrics.csv's val_accuracy is exactly correct/total."""
    import re

    counts = [(int(e), int(c), int(n)) for e, c, n in
              re.findall(r"^\[epoch (\d+)\] .*val_accuracy: [\d.]+ \((\d+)/(\d+)\)", stdout, flags=re.M)]
    assert [e for e, _, _ in counts] == list(range(epochs)), stdout
    assert all(n == val_images for _, _, n in counts), counts
    rows = read_metrics(output_dir)
    assert [r["val_accuracy"] for r in rows] == [f"{c / n:.6f}" for _, c, n in counts], (rows, counts)
    return [c for _, c, _ in counts]


def assert_run_outputs(output_dir, epochs, lr=0.001, steps_per_epoch=9, num_classes=5, stdout=None):
    """The files a finished run leaves: weights per epoch that load strictly, metadata, metrics;
    with ``stdout``, the exact accuracy counts it printed."""
    import json

    import torch

    from model import create_model

    for epoch in range(epochs):
        path = os.path.join(output_dir, f"model-{epoch}.pth")
        state = torch.load(path, map_location="cpu", weights_only=True)
        assert not any(k.startswith(("module.", "_orig_mod.")) for k in state)
        create_model(MODEL, num_classes).load_state_dict(state, strict=True)
    assert not os.path.exists(os.path.join(output_dir, f"model-{epochs}.pth"))
    best = torch.load(os.path.join(output_dir, "model-best.pth"), map_location="cpu", weights_only=True)
    create_model(MODEL, num_classes).load_state_dict(best, strict=True)
    checkpoint = torch.load(os.path.join(output_dir, "checkpoint.pth"), map_location="cpu", weights_only=True)
    assert checkpoint["epoch"] == epochs - 1 and checkpoint["classes"] == CLASSES
    assert checkpoint["model"].keys() == state.keys()
    with open(os.path.join(output_dir, "class_indices.json")) as f:
        assert json.load(f) == {str(i): name for i, name in enumerate(CLASSES)}
    with open(os.path.join(output_dir, "args.json")) as f:
        assert json.load(f)["epochs"] == epochs
    with open(os.path.join(output_dir, "metrics.csv")) as f:
        assert f.readline().strip() == ("epoch,train_loss,val_accuracy,lr,images_per_second,epoch_seconds,"
                                        "val_loss,val_balanced_accuracy,val_macro_f1,val_top5_accuracy,"
                                        "ema_val_accuracy,ema_val_loss,ema_val_balanced_accuracy,ema_val_macro_f1,"
                                        "best_source,val_map,val_micro_f1,val_micro_precision,val_micro_recall,"
                                        "ema_val_map,run_seconds")
    rows = read_metrics(output_dir)
    assert [int(r["epoch"]) for r in rows] == list(range(epochs))
    for r in rows:
        assert 0 < float(r["train_loss"]) < 10
        assert 0 <= float(r["val_accuracy"]) <= 1
        assert 0 < float(r["val_loss"]) < 10 and 0 <= float(r["val_macro_f1"]) <= 1
        assert r["val_top5_accuracy"] == r["ema_val_accuracy"] == "" and r["best_source"] == "model"
        assert r["val_map"] == r["val_micro_f1"] == r["ema_val_map"] == ""  # multi-label runs' columns
        assert float(r["images_per_second"]) > 0 and float(r["epoch_seconds"]) > 0
        assert 0 < float(r["run_seconds"]) < 600  # the run's clock at the epoch's end
    # the lr of each epoch's last step on the per-step cosine schedule (lr * lrf at the very end)
    steps = steps_per_epoch
    for epoch, r in enumerate(rows):
        last_step, total = (epoch + 1) * steps - 1, epochs * steps
        factor = 0.1 + 0.9 * (1 + math.cos(math.pi * last_step / total)) / 2
        assert float(r["lr"]) == pytest.approx(lr * factor, rel=1e-5), (epoch, r["lr"])
    if stdout is not None:
        assert_exact_accuracy(stdout, output_dir, epochs)
    return rows
