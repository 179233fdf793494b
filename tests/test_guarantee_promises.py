"""Promises of docs/guarantees.md, README.md and docs/flags.md that no other test pins down: restarts, orphans, --spawn, resume notes. In-process."""
import ctypes
import os
import signal
import types
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from conftest import help_blocks, parse_flags, stop_handlers, full_flags


# --- Elastic restarts ----------------------------------------------------------------------------

def test_each_restart_attempt_rendezvouses_under_its_own_key_prefix(monkeypatch):
    """guarantees.md: "Each restart attempt rendezvouses under its own key prefix in torchrun's
    store (TORCHELASTIC_RESTART_COUNT), so restarted workers never read the keys of the attempt
    before." One shared store stands for torchrun's; the attempts' views of it must not overlap."""
    from multi_train_utils import distributed_utils
    from multi_train_utils.distributed_utils import DistEnv

    shared, made = dist.HashStore(), []

    def tcp_store(host, port, world_size, is_master, timeout, multi_tenant):
        made.append((host, port, world_size, is_master))
        return shared

    monkeypatch.setattr(distributed_utils.dist, "TCPStore", tcp_store)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29511")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    views = {}
    for count in ("0", "1", "2"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", count)
        views[count] = distributed_utils._rendezvous_store(DistEnv(0, 2, 0, 2, "torchrun"), timedelta(seconds=5))
    views["0"].set("rank0-address", "of the first attempt")
    views["1"].set("rank1-address", "of the second attempt")
    assert not views["1"].check(["rank0-address"]) and not views["2"].check(["rank0-address"])
    assert not views["0"].check(["rank1-address"]) and not views["2"].check(["rank1-address"])
    # the same attempt (every worker of one restart) shares its keys; no count is the first attempt
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    first = distributed_utils._rendezvous_store(DistEnv(1, 2, 1, 2, "torchrun"), timedelta(seconds=5))
    assert first.get("rank0-address") == b"of the first attempt"
    assert made[0] == ("127.0.0.1", 29511, 2, True) and made[-1] == ("127.0.0.1", 29511, 2, False)  # rank 0 hosts it


# --- No orphans ----------------------------------------------------------------------------------

def _in_a_forked_child(function):
    """What ``function()`` (run in a forked child, no torch work) wrote as text."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write_fd, function().encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    got = os.read(read_fd, 200).decode()
    os.close(read_fd)
    os.waitpid(pid, 0)
    return got


@pytest.mark.skipif(not os.uname().sysname == "Linux", reason="the parent-death signal is Linux's")
def test_a_loader_worker_dies_with_its_trainer_and_ignores_ctrl_c_and_notices():
    """guarantees.md: "loader workers die with their process" / "loader workers die with their
    trainer". The loaders' worker_init_fn asks the kernel for SIGKILL when the trainer dies,
    and ignores SIGINT, SIGTERM and SIGUSR1: the trainer answers them, with its workers
    still loading the batches up to its save."""
    from multi_train_utils import errors as signals
    from multi_train_utils.loaders import make_loader

    loader = make_loader([0], None, 1, torch.device("cpu"))
    assert loader.worker_init_fn is signals.reset_in_worker

    def child():
        signals.reset_in_worker(0)
        value = ctypes.c_int(-1)
        ctypes.CDLL(None).prctl(2, ctypes.byref(value))  # PR_GET_PDEATHSIG
        ignored = [signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)]
        return f"{value.value} {ignored}"

    assert _in_a_forked_child(child) == f"{int(signal.SIGKILL)} [True, True, True]"


def test_off_linux_a_thread_notices_within_a_second_that_the_launcher_died(monkeypatch):
    """guarantees.md: "on Linux each worker ... has the kernel kill it (SIGKILL) when its
    launcher dies, elsewhere a thread notices within a second". Off Linux, die_with_launcher
    starts that thread on the launcher's pid; it looks every second and kills its own process
    (SIGKILL, nothing more written) once the launcher is gone."""
    from multi_train_utils import errors as signals

    started, asked = [], []

    class Thread:
        def __init__(self, target, args, name, daemon):
            self.seen = (target, args, daemon)

        def start(self):
            started.append(self.seen)

    monkeypatch.setattr(signals, "sys", types.SimpleNamespace(platform="darwin"))
    monkeypatch.setattr(signals, "threading", types.SimpleNamespace(Thread=Thread))
    monkeypatch.setattr(signals, "_set_parent_death_signal", lambda signum: asked.append(signum))
    monkeypatch.setattr(signals, "os", types.SimpleNamespace(getppid=lambda: 4242, getpid=lambda: 77,
                                                             kill=lambda pid, signum: asked.append((pid, signum))))
    signals.die_with_launcher()
    assert started == [(signals._watch_parent, (4242,), True)] and asked == []

    # the thread: the launcher is there twice, then the process is re-parented (to 1)
    waits, parents = [], iter([4242, 4242, 1])

    class Event:
        def wait(self, seconds):
            waits.append(seconds)

    monkeypatch.setattr(signals, "threading", types.SimpleNamespace(Event=Event))
    monkeypatch.setattr(signals.os, "getppid", lambda: next(parents))
    signals._watch_parent(4242)
    assert waits and max(waits) <= 1.0 and len(waits) == 2, waits
    assert asked == [(77, signal.SIGKILL)]


# --- --spawn and Ctrl-C ---------------------------------------------------------------------------

class SpawnedProcess:
    def __init__(self, pid, alive=True):
        self.pid, self.alive, self.joined = pid, alive, []

    def is_alive(self):
        return self.alive

    def join(self, timeout=None):
        self.joined.append(timeout)
        self.alive = False

    def kill(self):
        self.alive = False


def spawned_job(monkeypatch, raised):
    """train_multi_gpu.spawn_processes with --spawn 3 whose join raises ``raised``: (the
    processes, the signals sent, the exit code)."""
    import train_multi_gpu

    processes = [SpawnedProcess(101), SpawnedProcess(102), SpawnedProcess(103)]

    class Context:
        def __init__(self):
            self.processes = processes

        def join(self):
            raise raised

    sent = []
    monkeypatch.setattr(train_multi_gpu, "load_data", lambda *a, **k: None)
    monkeypatch.setattr(train_multi_gpu, "start_local_processes", lambda main, n, argv: Context())
    monkeypatch.setattr(train_multi_gpu, "os", types.SimpleNamespace(kill=lambda pid, s: sent.append((pid, s)),
                                                                     environ=os.environ))
    args = parse_flags(True, "--spawn", "3", "--data-path", "d")
    with pytest.raises(SystemExit) as exit_:
        train_multi_gpu.spawn_processes(args, ["--spawn", "3", "--data-path", "d"])
    return processes, sent, exit_.value.code


def test_spawn_passes_ctrl_c_on_to_every_process_and_exits_130(monkeypatch):
    """guarantees.md: "`--spawn` passes Ctrl-C on to its processes"; the exit code is "128 + N
    for signal N" (130 for SIGINT)."""
    processes, sent, code = spawned_job(monkeypatch, KeyboardInterrupt())
    assert sent == [(101, signal.SIGINT), (102, signal.SIGINT), (103, signal.SIGINT)]
    assert code == 130
    assert all(p.joined for p in processes)  # it waits for them


@pytest.mark.parametrize("exit_code, expected", [(2, 2), (1, 1), (-9, 1)])
def test_spawn_exits_with_the_failed_processs_code(monkeypatch, exit_code, expected):
    """guarantees.md: "The exit code is 2 for these [mistakes and faults], 1 for a lost peer,
    128 + N for signal N": a spawned process's 2 or 1 is the launcher's too; one killed by a
    signal (a negative code from multiprocessing) makes it 1, never a success."""
    import torch.multiprocessing as mp

    failed = mp.ProcessExitedException("process 1 terminated", error_index=1, error_pid=102, exit_code=exit_code)
    _, sent, code = spawned_job(monkeypatch, failed)
    assert code == expected and sent == []


# --- Resuming with another number of processes ---------------------------------------------------

def resumed_recorder(tmp_path, saved_world_size, world_size, capsys):
    """What a RunRecorder prints, and gives the start summary to print, when it resumes, in its
    own folder, from a checkpoint of epoch 1 written by ``saved_world_size`` processes, in a run
    of ``world_size``."""
    from multi_train_utils.checkpoint import TrainState, complete_checkpoint
    from conftest import run_recorder

    out = tmp_path / f"run-{saved_world_size}-{world_size}"
    args = parse_flags(False, "--model", "resnet18", "--epochs", "5", "--no-plots", "--output-dir", str(out),
                       "--log-dir", str(tmp_path / "tb"), "--resume", "auto")
    checkpoint = complete_checkpoint({"epoch": 1, "model": {"w": torch.zeros(1)}, "metrics": [],
                                      "world_size": saved_world_size, "best_accuracy": 0.5, "best_value": 0.5,
                                      "best_epoch": 1})
    recorder = run_recorder(args, full_flags(classes=["a", "b"]), TrainState(None), checkpoint=checkpoint,
                           resume_path=str(out / "checkpoint.pth"), enabled=True, world_size=world_size)
    recorder.close()
    return capsys.readouterr().out + "".join(line + "\n" for line in recorder.resume_lines)


def test_a_resume_with_another_number_of_processes_says_the_rate_is_scaled_anew(tmp_path, capsys):
    """guarantees.md: "Resuming with another number of processes is allowed: the learning rate
    is derived again for the new world size ...; the data order then differs." The resumed run
    says so, naming both counts; with the same count it says nothing of it."""
    out = resumed_recorder(tmp_path, 2, 4, capsys)
    assert "(epoch 1 done): epochs 2 to 4" in out
    assert ("note: the checkpoint was written by 2 processes, this run has 4: the learning rate is scaled anew "
            "and the data order differs\n") in out
    assert "note: the checkpoint was written by" not in resumed_recorder(tmp_path, 2, 2, capsys)


# --- docs/flags.md: the groups of --help -------------------------------------------------------------

# docs/flags.md's table, row by row (the DDP row on train_multi_gpu.py only, the multi-GPU row on
# train_single.py only).
FLAG_GROUPS = [
    ("common", ["--data-path", "--demo", "--model", "--weights", "--epochs", "--batch-size", "--lr", "--device",
                "--output-dir", "--resume", "--eval-only"]),
    ("data", ["--val-path", "--train-list", "--val-list", "--multi-label", "--task", "--val-rate", "--check-images", "--num-classes",
              "--img-size", "--val-resize-size", "--workers", "--download", "--freeze-layers"]),
    ("recipe", ["--hflip", "--auto-augment", "--random-erase", "--mixup-alpha", "--cutmix-alpha", "--label-smoothing",
                "--class-weights", "--sampler", "--opt", "--momentum", "--weight-decay", "--norm-bias-decay",
                "--lr-scheduler", "--lrf", "--lr-step-size", "--lr-gamma", "--warmup-epochs", "--model-ema",
                "--model-ema-decay", "--seed"]),
    ("run", ["--overwrite", "--log-dir", "--plots", "--keep-last", "--best-metric", "--tune-thresholds", "--patience",
             "--checkpoint-every", "--requeue", "--target-accuracy", "--eval-output"]),
    ("speed", ["--amp", "--channels-last", "--compile", "--accum-steps", "--clip-grad", "--grad-checkpoint",
               "--print-freq", "--threads"]),
]
DDP_GROUP = ("distributed", ["--scale-lr", "--sync-bn", "--dist-backend", "--dist-url", "--dist-timeout",
                             "--local-rank", "--spawn"])
SINGLE_GROUP = ("multi-GPU", ["--data-parallel"])


@pytest.mark.parametrize("distributed", [False, True])
def test_help_lists_the_flags_in_docs_flags_groups_the_common_ones_first(distributed):
    """flags.md: "`python train_single.py --help` and `python train_multi_gpu.py --help` describe
    every flag with its default, the common ones first. The groups: ..." Each group of --help,
    in order, holds exactly the flags of its row."""
    from multi_train_utils.options import get_args_parser

    parser = get_args_parser(distributed)
    groups = [(group.title.split(":")[0], [a.option_strings[0] for a in group._group_actions])
              for group in parser._action_groups if group._group_actions and group.title not in ("options",
                                                                                                   "optional arguments")]
    assert groups == FLAG_GROUPS + [DDP_GROUP if distributed else SINGLE_GROUP]
    text = parser.format_help()
    assert text.index("\ncommon:") < text.index("\ndata:") < text.index("\nrecipe") < text.index("\nrun") < \
        text.index("\nspeed:")


@pytest.mark.parametrize("distributed", [False, True])
def test_help_states_the_defaults_docs_flags_gives_in_words(distributed):
    """flags.md's defaults that are words, not one value: `--device` (auto: cuda, else mps, else
    cpu), `--weight-decay` (0.005 for SGD, 0.05 for AdamW), `--val-resize-size` (round(img-size
    x 256/224)), `--workers` and `--threads` (this process's share of the cores), `--keep-last`
    (1; 0 keeps all), `--patience` (0: never), `--sync-bn` off, `--scale-lr` on."""
    from multi_train_utils.options import get_args_parser

    blocks = help_blocks(get_args_parser(distributed))
    assert "auto (cuda, else mps, else cpu)" in blocks["--device"]
    assert "(default: 0.005 for SGD, 0.05 for AdamW)" in blocks["--weight-decay"]
    assert "(default: round(img-size x 256/224))" in blocks["--val-resize-size"]
    assert "(default: its share of the cores)" in blocks["--workers"]
    assert "(default: its share of the cores)" in blocks["--threads"]
    assert "0 keeps all" in blocks["--keep-last"] and "default: 1" in blocks["--keep-last"]
    assert "(0: never)" in blocks["--patience"]
    if distributed:
        assert "(default: off" in blocks["--sync-bn"] and "(default: True)" in blocks["--scale-lr"]
        assert "--syncBN" in blocks["--sync-bn"]


# --- What a checkpoint holds ------------------------------------------------------------------------

def test_the_checkpoint_holds_what_guarantees_lists_and_the_one_before_stays_beside_it(tmp_path):
    """guarantees.md: "first `checkpoint.pth` — model, optimizer, epoch, best accuracy and its
    epoch, the `metrics.csv` rows, the run's flags, class names and random-number states (the
    learning-rate schedule is not in it ...) ... The previous checkpoint stays beside it as
    `checkpoint-prev.pth`."
    Two epochs through RunRecorder.end_epoch, as rank 0 saves them."""
    import random

    from multi_train_utils.checkpoint import TrainState
    from conftest import run_recorder
    from multi_train_utils.single_label import EvalResult
    from multi_train_utils.train_eval_utils import TrainStats

    out = tmp_path / "run"
    args = parse_flags(False, "--model", "resnet18", "--epochs", "3", "--no-plots", "--keep-last", "0",
                       "--output-dir", str(out), "--log-dir", str(tmp_path / "tb"), "--seed", "5")
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TrainState(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step))
    recorder = run_recorder(args, full_flags(classes=["cat", "dog"]), state, enabled=True, world_size=1)
    results = [EvalResult(torch.tensor([[2, 1], [0, 3]])), EvalResult(torch.tensor([[3, 0], [1, 2]]))]
    for epoch, result in enumerate(results):
        model.weight.grad = torch.ones_like(model.weight)
        optimizer.step()
        state.lr_scheduler.step()
        recorder.end_epoch(epoch, TrainStats(1.0 - epoch / 10, 8, 1.0, 0.1, 8.0), result)
        if epoch == 0:
            first_torch, first_python = torch.get_rng_state(), random.getstate()
    recorder.close()
    saved = torch.load(out / "checkpoint.pth", weights_only=True)
    before = torch.load(out / "checkpoint-prev.pth", weights_only=True)
    listed = {"model", "optimizer", "epoch", "best_accuracy", "best_epoch", "metrics", "args", "classes", "rng"}
    assert listed <= set(saved) and listed <= set(before), listed - set(saved)
    assert (saved["epoch"], before["epoch"]) == (1, 0)
    assert torch.equal(saved["model"]["weight"], model.weight.detach())
    assert saved["optimizer"]["state"][0]["momentum_buffer"].shape == (2, 2)  # SGD's momentum
    assert "lr_scheduler" not in saved  # never read: the schedule is rebuilt at the saved epoch
    assert (saved["best_accuracy"], saved["best_epoch"]) == (5 / 6, 0)  # epoch 1 ties 5/6: not better
    assert [row[0] for row in saved["metrics"]] == [0, 1] and [row[0] for row in before["metrics"]] == [0]
    assert saved["args"]["seed"] == 5 and saved["args"]["model"] == "resnet18"
    assert saved["classes"] == ["cat", "dog"]
    assert torch.equal(before["rng"]["torch"], first_torch)
    assert tuple(before["rng"]["python"][1]) == first_python[1]


# --- Ctrl-C and SIGTERM ----------------------------------------------------------------------------

def test_a_second_stop_signal_is_ignored_and_a_stuck_process_exits_143_after_sigterm(monkeypatch):
    """guarantees.md: "Every process of the job exits within seconds (a watchdog ends a process
    still stuck in a collective 3 s after the signal ...), with a non-zero exit code (130 for
    SIGINT and 143 for SIGTERM ...)". SIGTERM to every process often comes with a Ctrl-C: the
    first signal unwinds, a second one must not interrupt that clean-up; the watchdog then ends
    a process still stuck with 128 + SIGTERM (0.2 s here, os._exit recorded instead of run)."""
    import threading
    import time

    from multi_train_utils import errors as signals

    codes, ended = [], threading.Event()

    def exit_(code):
        codes.append(code)
        ended.set()

    with stop_handlers(monkeypatch, exit_, ended, None, grace_seconds=0.2):
        with pytest.raises(signals.TrainingInterrupted) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        # unwinding now: Ctrl-C and another SIGTERM change nothing
        while_unwinding = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    watchdog_ended = ended.is_set()
    assert while_unwinding == (signal.SIG_IGN, signal.SIG_IGN)
    assert watchdog_ended, "the watchdog did not end the process"
    assert stop.value.signum == signal.SIGTERM
    assert codes == [143]
