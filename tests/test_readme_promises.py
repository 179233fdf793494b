"""In-process checks of README promises no other test guards: resume, locks, SLURM, metrics, predict, flags,
offline use, --download, the doctor, what a run shows and draws, speed settings, the layout, stopping."""
import csv
import errno
import json
import os
import random

import pytest
import torch
from PIL import Image
from torch import nn

from conftest import CLASSES, Labelled, help_blocks, stop_handlers, train_args, full_flags
from multi_train_utils.options import config_of  # noqa: E402
from multi_train_utils.checkpoint import TrainState


def run_args(tmp_path, *extra):
    """train_single.py's flags' defaults with a run folder and a TensorBoard folder in ``tmp_path``."""
    from multi_train_utils.options import get_args_parser, parse_args

    return parse_args(get_args_parser(False), ["--model", "resnet18", "--output-dir", str(tmp_path / "out"),
                                                     "--log-dir", str(tmp_path / "tb"), "--no-plots",
                                                     "--keep-last", "0", *extra])


def touch(folder, *names, text="x"):
    os.makedirs(folder, exist_ok=True)
    for name in names:
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)


def save_two_checkpoints(folder):
    """checkpoint-prev.pth (epoch 4) and checkpoint.pth (epoch 5), as a run writes them."""
    from multi_train_utils import checkpoint as ckpt

    state = {"model": {"w": torch.ones(2)}, "optimizer": {}, "classes": ["a", "b"], "args": {}}
    ckpt.save_checkpoint(str(folder), dict(state, epoch=4))
    ckpt.save_checkpoint(str(folder), dict(state, epoch=5))


# --- resume ------------------------------------------------------------------------------------

def test_resume_from_a_checkpoint_elsewhere_checks_the_output_dir_as_a_new_run(tmp_path):
    """Only a checkpoint in --output-dir itself lets a run continue over that folder's checkpoints."""
    from multi_train_utils.errors import UserError
    from multi_train_utils.run_files import check_output_dir

    out = tmp_path / "out"
    touch(out, "model-0.pth")
    with pytest.raises(UserError) as error:
        check_output_dir(str(out), False, resume_path=str(tmp_path / "other" / "checkpoint.pth"))
    assert str(error.value) == (f"--output-dir {out}: holds checkpoints of an earlier run (model-0.pth); pass "
                                "--resume auto to continue it, --overwrite to replace it, or choose another "
                                "--output-dir")
    check_output_dir(str(out), False, resume_path=str(out / "checkpoint.pth"))  # continues its own run
    check_output_dir(str(out), True, resume_path=str(tmp_path / "other" / "checkpoint.pth"))  # --overwrite


def test_a_second_demo_says_its_run_is_kept_and_how_to_train_it_again(tmp_path):
    """README: "A second `--demo` ..." stops, saying the demo's run is kept and --overwrite trains
    it again; over a run that was not a demo, --demo gets the plain refusal."""
    import json

    from multi_train_utils.errors import UserError
    from multi_train_utils.run_files import check_output_dir

    out = tmp_path / "weights"
    touch(out, "model-best.pth")
    refusals = {}
    for was_demo in (True, False):
        (out / "args.json").write_text(json.dumps({"model": "resnet18", "demo": was_demo}))
        with pytest.raises(UserError) as error:
            check_output_dir(str(out), False, demo=True)
        refusals[was_demo] = str(error.value)
    assert refusals[True] == (f"--output-dir {out}: holds the run of an earlier --demo (model-best.pth); the demo's "
                              "data is made once, and its run is kept: add --overwrite to train the demo again in "
                              "its place, or choose another --output-dir to keep both")
    assert refusals[False].startswith(f"--output-dir {out}: holds checkpoints of an earlier run (model-best.pth); pass "
                                      "--resume auto")
    check_output_dir(str(out), True, demo=True)  # --overwrite: trains it again


def test_resume_auto_with_no_readable_checkpoint_is_an_error(tmp_path):
    """Both checkpoints damaged: an error, never (None, None), which would start afresh and
    delete the earlier run's files."""
    from multi_train_utils import checkpoint as ckpt
    from multi_train_utils.errors import UserError

    save_two_checkpoints(tmp_path)
    for name in (ckpt.CHECKPOINT, ckpt.PREVIOUS_CHECKPOINT):
        (tmp_path / name).write_bytes((tmp_path / name).read_bytes()[:100])
    with pytest.raises(UserError, match=r"^--resume auto: no checkpoint in .* can be read \(.*\); resume from a good "
                                        r"copy with --resume PATH, or start over with --overwrite$"):
        ckpt.find_resume_checkpoint("auto", str(tmp_path))
    os.remove(tmp_path / ckpt.CHECKPOINT)  # only a damaged checkpoint-prev.pth left: the same
    with pytest.raises(UserError, match="no checkpoint in"):
        ckpt.find_resume_checkpoint("auto", str(tmp_path))
    os.remove(tmp_path / ckpt.PREVIOUS_CHECKPOINT)  # no checkpoint at all: a fresh start
    assert ckpt.find_resume_checkpoint("auto", str(tmp_path)) == (None, None)


def test_a_damaged_checkpoint_is_renamed_damaged_after_resuming_from_the_previous_one(tmp_path):
    """Left in place, the next save would keep the damaged file as checkpoint-prev.pth."""
    from multi_train_utils.checkpoint import set_aside_damaged_checkpoint

    touch(tmp_path, "checkpoint.pth", "checkpoint-prev.pth")
    set_aside_damaged_checkpoint(str(tmp_path), str(tmp_path / "checkpoint-prev.pth"))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-prev.pth", "checkpoint.pth.damaged"]
    # resumed from the newest checkpoint, or from a folder elsewhere: nothing is renamed
    here = tmp_path / "here"
    touch(here, "checkpoint.pth", "checkpoint-prev.pth")
    set_aside_damaged_checkpoint(str(here), str(here / "checkpoint.pth"))
    set_aside_damaged_checkpoint(str(here), str(tmp_path / "checkpoint-prev.pth"))
    assert sorted(os.listdir(here)) == ["checkpoint-prev.pth", "checkpoint.pth"]


def test_resume_with_another_model_or_freeze_layers_is_refused_naming_both_values(tmp_path):
    from multi_train_utils.checkpoint import check_resume_compatible
    from multi_train_utils.errors import UserError

    args = run_args(tmp_path)
    saved = {"classes": CLASSES, "epoch": 1, "args": {"model": "resnet18", "freeze_layers": False}}
    check_resume_compatible(saved, "ckpt", config_of(args).flags, CLASSES, 4)
    cases = [("model", "resnet50", "trained with --model resnet18, this run has --model resnet50"),
             ("freeze_layers", True, "trained with --no-freeze-layers, this run has --freeze-layers")]
    for flag, value, message in cases:
        changed = full_flags(**dict(vars(args), **{flag: value}))
        with pytest.raises(UserError) as error:
            check_resume_compatible(saved, "ckpt", config_of(changed).flags, CLASSES, 4)
        assert str(error.value) == f"--resume ckpt: {message}; resume with the same, or start a new --output-dir"


def test_resume_of_a_run_that_trained_more_epochs_than_epochs_is_refused(tmp_path):
    """Epoch 4 saved means 5 epochs trained: more than --epochs 4; epoch 3 (4 trained) is a
    complete run, not an error."""
    from multi_train_utils.checkpoint import check_resume_compatible
    from multi_train_utils.errors import UserError

    args = run_args(tmp_path)
    saved = {"classes": CLASSES, "epoch": 4, "args": {"model": "resnet18"}}
    with pytest.raises(UserError) as error:
        check_resume_compatible(saved, "ckpt", config_of(args).flags, CLASSES, 4)
    assert str(error.value) == ("--resume ckpt: already trained 5 epochs, more than --epochs 4; raise --epochs to "
                                "train more")
    check_resume_compatible(dict(saved, epoch=3), "ckpt", config_of(args).flags, CLASSES, 4)


def test_a_fresh_resume_auto_start_replaces_only_the_files_of_an_unfinished_attempt(tmp_path):
    """An attempt stopped before its first checkpoint: its files go, the user's and the lock stay."""
    from multi_train_utils.run_files import clear_earlier_run

    out = tmp_path / "out"
    attempt = ["metrics.csv", "args.json", "class_indices.json", "train.log", ".metrics.csv.abcd1234.tmp"]
    kept = ["notes.txt", "model-final.pth", "run.lock"]  # the user's files, and the lock this run holds
    touch(out, *attempt, *kept)
    clear_earlier_run(full_flags(output_dir=str(out), overwrite=False, resume="auto"), None)
    assert sorted(os.listdir(out)) == sorted(kept)
    # resuming from a checkpoint: only the unfinished write's temporary file goes
    touch(out, *attempt)
    clear_earlier_run(full_flags(output_dir=str(out), overwrite=False, resume="auto"), {"epoch": 0})
    assert sorted(os.listdir(out)) == sorted(set(attempt + kept) - {".metrics.csv.abcd1234.tmp"})


def test_an_earlier_runs_checkpoints_are_refused_before_anything_is_downloaded(tmp_path, monkeypatch):
    from multi_train_utils import run_files as inputs
    from multi_train_utils.errors import UserError
    from my_dataset import build_datasets

    def download(path):
        raise AssertionError(f"downloaded {path} before --output-dir was checked")

    monkeypatch.setattr(inputs, "download_flower_photos", download)
    out = tmp_path / "out"
    touch(out, "model-0.pth")
    args = run_args(tmp_path, "--download", "--data-path", str(tmp_path / "flowers"))
    with pytest.raises(UserError, match="holds checkpoints of an earlier run"):
        inputs.read_inputs(config_of(args), lambda: build_datasets(args), torch.device("cpu"))


def fake_all_reduce(others):
    """dist.all_reduce as two processes do it: this one's tensor and ``others``, reduced by ``op``."""
    import torch.distributed as dist

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        other = torch.tensor(others, dtype=tensor.dtype)
        tensor.copy_(torch.maximum(tensor, other) if op == dist.ReduceOp.MAX else tensor + other)

    return all_reduce


def test_processes_that_would_resume_from_different_epochs_all_stop(monkeypatch):
    """Rank 0 found epoch 3's checkpoint, rank 1 none (-1): each rank raises the same line."""
    from multi_train_utils import distributed_utils
    from multi_train_utils.errors import UserError

    monkeypatch.setattr(distributed_utils, "is_dist_avail_and_initialized", lambda: True)
    message = ("the processes disagree about the checkpoint to resume from (from -1 to 3); put --output-dir on a "
               "file system that every node shares")
    for mine, theirs in ((3, -1), (-1, 3)):
        monkeypatch.setattr(distributed_utils.dist, "all_reduce", fake_all_reduce([theirs, -theirs]))
        with pytest.raises(UserError) as error:
            distributed_utils.check_same_on_every_rank(mine, torch.device("cpu"), "the checkpoint to resume from")
        assert str(error.value) == message
    monkeypatch.setattr(distributed_utils.dist, "all_reduce", fake_all_reduce([3, -3]))
    distributed_utils.check_same_on_every_rank(3, torch.device("cpu"), "the checkpoint to resume from")


# --- output folder -----------------------------------------------------------------------------

def test_a_file_system_without_locks_warns_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    from multi_train_utils import files as run_lock

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(run_lock.fcntl, "lockf", no_locks)
    folder = tmp_path / "new"
    try:
        lock = run_lock.lock_output_dir(str(folder))
    except run_lock.UserError as e:  # a refusal would stop every run on such a file system
        lock = e
    assert isinstance(lock, run_lock.RunLock)
    assert capsys.readouterr().err == (f"warning: {folder}/run.lock: this file system does not lock files "
                                       f"({os.strerror(errno.ENOLCK)}); make sure no other run writes into {folder}\n")
    assert folder.is_dir()  # the run can write there
    # bad input found after this writes nothing: at exit the lock file and the new folder go
    lock.discard()
    assert not folder.exists()
    # a run that wrote a file keeps it, and the folder
    lock = run_lock.lock_output_dir(str(folder))
    (folder / "metrics.csv").write_text("epoch\n")
    lock.discard()
    assert sorted(os.listdir(folder)) == ["metrics.csv", "run.lock"]


def test_args_json_holds_every_flag_with_absolute_data_paths(tmp_path, monkeypatch):
    from multi_train_utils.options import config_of, get_args_parser, parse_args
    from multi_train_utils.run_files import write_run_settings

    monkeypatch.chdir(tmp_path)
    here = os.getcwd()
    for distributed in (False, True):
        parser = get_args_parser(distributed)
        args = parse_args(parser, ["--model", "resnet18", "--data-path", "data/x", "--val-path", "data/v"])
        write_run_settings(str(tmp_path), config_of(args).flags, ["a", "b"])
        with open(tmp_path / "args.json") as f:
            saved = json.load(f)
        flags = {action.dest for action in parser._actions if action.dest != "help"}  # argparse's own list
        assert set(saved) == flags | set(parser.other_script_settings) | {"images"}  # and what its images are
        assert (saved["data_path"], saved["val_path"]) == (os.path.join(here, "data/x"), os.path.join(here, "data/v"))
        assert saved["weights"] == "" and saved["resume"] is None and saved["epochs"] == 30
        with open(tmp_path / "class_indices.json") as f:
            assert json.load(f) == {"0": "a", "1": "b"}
    # label files too (round 16: --val-list was left relative)
    args = parse_args(get_args_parser(False), ["--model", "resnet18", "--train-list", "lists/train.csv",
                                               "--val-list", "lists/val.csv"])
    saved = config_of(args).flags
    assert (saved["train_list"], saved["val_list"]) == (os.path.join(here, "lists/train.csv"),
                                                        os.path.join(here, "lists/val.csv"))


# --- SLURM -------------------------------------------------------------------------------------

def no_launcher(monkeypatch):
    """No launcher variables (one process); monkeypatch also undoes what read_dist_env sets."""
    for key in [k for k in os.environ if k.startswith("SLURM_")] + ["RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                     "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                                                     "MASTER_PORT", "TORCHELASTIC_RUN_ID"]:
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)


def slurm_task(monkeypatch):
    """Task 1 of a 2-task srun step of job 123456, and no other launcher variable."""
    no_launcher(monkeypatch)
    for key, value in dict(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2", SLURM_LOCALID="1",
                           SLURM_JOB_ID="123456").items():
        monkeypatch.setenv(key, value)


def test_slurm_address_and_port_come_from_master_addr_node_list_launch_node_and_step(monkeypatch):
    from multi_train_utils.distributed_utils import read_dist_env
    from multi_train_utils.errors import UserError

    slurm_task(monkeypatch)
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.setenv("SLURM_NODELIST", "gpu[03-04]")
    read_dist_env()
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.1.2.3", "29999")  # set: kept

    slurm_task(monkeypatch)
    monkeypatch.setenv("SLURM_LAUNCH_NODE_IPADDR", "10.0.0.5")  # no node list
    monkeypatch.setenv("SLURM_STEP_ID", "2")
    read_dist_env()
    assert os.environ["MASTER_ADDR"] == "10.0.0.5"
    assert os.environ["MASTER_PORT"] == "21456"  # 15000 + (123456 + 1000 x 2) mod 17000 = 15000 + 6456

    slurm_task(monkeypatch)  # the step's 1000 is added before the mod: the sum wraps, not the job id alone
    monkeypatch.setenv("SLURM_LAUNCH_NODE_IPADDR", "10.0.0.5")
    monkeypatch.setenv("SLURM_JOB_ID", "16500")
    monkeypatch.setenv("SLURM_STEP_ID", "1")
    read_dist_env()
    assert os.environ["MASTER_PORT"] == "15500"  # 15000 + (16500 + 1000) mod 17000 = 15000 + 500

    slurm_task(monkeypatch)  # the largest job id below a wrap: the port stays below 32768 (ephemeral ports)
    monkeypatch.setenv("SLURM_LAUNCH_NODE_IPADDR", "10.0.0.5")
    monkeypatch.setenv("SLURM_JOB_ID", str(17000 * 7 - 1))
    read_dist_env()
    assert os.environ["MASTER_PORT"] == "31999"

    slurm_task(monkeypatch)
    with pytest.raises(UserError, match="^SLURM job without SLURM_NODELIST or SLURM_LAUNCH_NODE_IPADDR: set "
                                        "MASTER_ADDR"):
        read_dist_env()


# --- metrics.csv and TensorBoard ---------------------------------------------------------------

class Clock:
    """A perf_counter that moves only when told (seconds of fake work)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def test_images_per_second_counts_every_ranks_images_and_leaves_out_the_first_two_steps(monkeypatch):
    """6 steps of 4 images per rank on 2 ranks; steps 0 and 1 (start-up) take 5 s each, the
    others 1 s: 4 steps x 8 images in 4 s = 8 images/s."""
    from multi_train_utils import train_eval_utils
    from multi_train_utils.train_eval_utils import LoopSettings, train_one_epoch

    clock = Clock()
    monkeypatch.setattr(train_eval_utils, "time", clock)
    monkeypatch.setattr(train_eval_utils, "get_world_size", lambda: 2)

    class Timed(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.steps = nn.Linear(3 * 4 * 4, 3), 0

        def forward(self, x):
            clock.now += 5.0 if self.steps < 2 else 1.0
            self.steps += 1
            return self.linear(x.flatten(1))

    class Loader(list):
        batch_sampler = full_flags(batch_size=4)

    loader = Loader((torch.rand(4, 3, 4, 4), torch.tensor([0, 1, 2, 0])) for _ in range(6))
    model = Timed()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    stats = train_one_epoch(TrainState(model, optimizer), loader, torch.device("cpu"), 0, LoopSettings(print_freq=6))
    assert stats.images == 6 * 4 * 2
    assert stats.images_per_second == pytest.approx(8.0)
    assert stats.seconds == pytest.approx(14.0)


class NoRunLog:
    """RunLog without taking over this process's stdout and stderr."""

    def attach(self, path, append=False):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("name", ["train_single", "train_multi_gpu"])
def test_epoch_seconds_is_the_wall_time_of_training_and_validation(name, tiny_data, tmp_path, monkeypatch):
    """The script's main, in this process, with a training epoch that takes 3 s and a
    validation pass that takes 2 s (on a fake clock): epoch_seconds is 5 for every epoch."""
    import importlib

    from multi_train_utils.single_label import EvalResult
    from multi_train_utils.train_eval_utils import TrainStats

    script = importlib.import_module(name)
    clock = Clock()

    def train_one_epoch(*args, **kwargs):
        clock.now += 3.0
        return TrainStats(mean_loss=1.0, images=32, seconds=3.0, last_lr=0.001, images_per_second=10.0)

    def evaluate(model, loader, device, num_classes, settings=None):
        clock.now += 2.0
        return EvalResult(torch.eye(num_classes, dtype=torch.int64), None, 1.0)

    no_launcher(monkeypatch)  # train_multi_gpu.py as one process
    for attribute, value in (("time", clock), ("train_one_epoch", train_one_epoch), ("evaluate", evaluate),
                             ("install_stop_handlers", lambda *args, **kwargs: None), ("RunLog", NoRunLog)):
        monkeypatch.setattr(script, attribute, value)
    threads = torch.get_num_threads()
    try:
        script.main(train_args(tiny_data, tmp_path / "out", "--epochs", "2", "--workers", "0", "--amp", "off",
                               "--threads", "1", "--model", "mobilenet_v3_small"))  # small checkpoints: quick
    finally:
        torch.set_num_threads(threads)  # --threads sets this process's threads
    with open(tmp_path / "out" / "metrics.csv") as f:
        assert [row["epoch_seconds"] for row in csv.DictReader(f)] == ["5.000", "5.000"]


def record_epochs(tmp_path, classes, results, extra=(), ema_results=None):
    """A RunRecorder (rank 0) of a tiny model through one epoch per EvalResult of ``results``;
    returns (recorder, the weights of each epoch)."""
    from multi_train_utils.model_setup import ModelEma
    from conftest import run_recorder
    from multi_train_utils.train_eval_utils import TrainStats

    args = run_args(tmp_path, *extra, *(["--model-ema"] if ema_results else []))
    model = nn.Linear(2, len(classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    ema = ModelEma(model, 0.9) if ema_results else None
    state = TrainState(model, optimizer, scheduler, ema=ema)
    recorder = run_recorder(args, full_flags(classes=classes), state, enabled=True)
    weights = []
    for epoch, result in enumerate(results):
        with torch.no_grad():
            model.weight.fill_(epoch)  # each epoch's weights are told apart by their value
        weights.append({k: v.clone() for k, v in model.state_dict().items()})
        stats = TrainStats(mean_loss=1.5, images=8, seconds=2.0, last_lr=0.01, images_per_second=4.0)
        recorder.end_epoch(epoch, stats, result, ema_results[epoch] if ema_results else None, seconds=2.5)
    recorder.close()
    return recorder, weights


def seven_class_result(top5_correct):
    """10 validation images of 7 classes, 4 of them right."""
    from multi_train_utils.single_label import EvalResult

    confusion = torch.zeros(7, 7, dtype=torch.int64)
    for true, predicted in [(0, 0), (1, 1), (2, 2), (3, 3), (0, 1), (1, 2), (4, 5), (5, 6), (6, 0), (6, 1)]:
        confusion[true, predicted] += 1
    return EvalResult(confusion, top5_correct, loss_sum=12.0)


def test_val_top5_accuracy_is_written_with_more_than_5_classes_and_empty_with_5(tmp_path):
    from multi_train_utils.single_label import EvalResult

    names = [f"c{i}" for i in range(7)]
    record_epochs(tmp_path / "seven", names, [seven_class_result(top5_correct=8)])
    with open(tmp_path / "seven" / "out" / "metrics.csv") as f:
        row = next(csv.DictReader(f))
    assert row["val_accuracy"] == "0.400000" and row["val_top5_accuracy"] == "0.800000"  # 8 of 10
    record_epochs(tmp_path / "five", CLASSES, [EvalResult(torch.eye(5, dtype=torch.int64), None, 1.0)])
    with open(tmp_path / "five" / "out" / "metrics.csv") as f:
        assert next(csv.DictReader(f))["val_top5_accuracy"] == ""


def test_tensorboard_logs_top5_accuracy_and_the_emas_figures_under_ema(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    classes = [f"c{i}" for i in range(7)]
    recorder, _ = record_epochs(tmp_path, classes, [seven_class_result(top5_correct=8)],
                                ema_results=[seven_class_result(top5_correct=9)])
    events = EventAccumulator(recorder.log_dir)
    events.Reload()
    logged = {tag: events.Scalars(tag)[0].value for tag in events.Tags()["scalars"]}
    names = ["accuracy", "balanced_accuracy", "macro_f1", "top5_accuracy", "val_loss"]
    assert set(logged) == {"loss", "learning_rate", "images_per_second", *names, *("ema/" + n for n in names)}
    for prefix, top5 in (("", 0.8), ("ema/", 0.9)):
        assert logged[prefix + "top5_accuracy"] == pytest.approx(top5)
        assert logged[prefix + "accuracy"] == pytest.approx(0.4)
        assert logged[prefix + "val_loss"] == pytest.approx(1.2)  # 12 over 10 images


def test_val_loss_balanced_accuracy_and_macro_f1_cells_hold_the_epochs_figures(tmp_path):
    """By hand, for 10 images of 3 classes (rows true, columns predicted):
    recall 3/4, 2/4, 1/2 -> balanced accuracy 0.583333; F1 = 2TP / (2TP + FP + FN):
    6/8, 4/7, 2/5 -> macro-F1 0.573810; val_loss 7.5 / 10."""
    from multi_train_utils.single_label import EvalResult

    confusion = torch.tensor([[3, 1, 0], [0, 2, 2], [1, 0, 1]])
    record_epochs(tmp_path, ["a", "b", "c"], [EvalResult(confusion, None, loss_sum=7.5)])
    with open(tmp_path / "out" / "metrics.csv") as f:
        row = next(csv.DictReader(f))
    assert (row["val_accuracy"], row["val_loss"], row["val_balanced_accuracy"], row["val_macro_f1"]) == \
        ("0.600000", "0.750000", "0.583333", "0.573810")
    assert row["epoch_seconds"] == "2.500" and row["images_per_second"] == "4.00"


def test_tensorboard_continues_the_same_run_on_resume_in_its_folder(tmp_path, monkeypatch):
    """The resumed recorder, started another day, logs into the checkpoint's TensorBoard
    folder; a resume from a checkpoint elsewhere starts a new one under --log-dir."""
    import time
    import types

    from multi_train_utils import recorder
    from conftest import run_recorder
    from multi_train_utils.single_label import EvalResult

    first, _ = record_epochs(tmp_path, CLASSES, [EvalResult(torch.eye(5, dtype=torch.int64), None, 1.0)])
    later = types.SimpleNamespace(strftime=lambda fmt: "20990101-000000", perf_counter=time.perf_counter)
    monkeypatch.setattr(recorder, "time", later)  # a new folder would not be named like the first one
    path = tmp_path / "out" / "checkpoint.pth"
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    args = run_args(tmp_path)
    resumed = run_recorder(args, full_flags(classes=CLASSES), enabled=False, checkpoint=checkpoint,
                          resume_path=str(path))
    assert resumed.log_dir == first.log_dir and os.path.isdir(first.log_dir)
    elsewhere = run_recorder(run_args(tmp_path / "new"), full_flags(classes=CLASSES), enabled=False,
                            checkpoint=checkpoint,
                            resume_path=str(path))
    assert os.path.dirname(elsewhere.log_dir) == str(tmp_path / "new" / "tb")


def test_best_metric_balanced_accuracy_picks_the_epoch_with_the_higher_balanced_accuracy(tmp_path):
    """8 images of class a, 2 of b. Epoch 0: accuracy 0.9, balanced accuracy (1 + 1/2) / 2 =
    0.75; epoch 1: accuracy 0.7, balanced accuracy (5/8 + 1) / 2 = 0.8125. model-best.pth
    must hold epoch 1's weights (epoch 1's accuracy is below epoch 0's balanced accuracy too)."""
    from multi_train_utils.single_label import EvalResult

    epoch0 = EvalResult(torch.tensor([[8, 0], [1, 1]]), None, 1.0)
    epoch1 = EvalResult(torch.tensor([[5, 3], [0, 2]]), None, 1.0)
    recorder, weights = record_epochs(tmp_path, ["a", "b"], [epoch0, epoch1],
                                      extra=["--best-metric", "balanced_accuracy"])
    assert recorder.state.best.epoch == 1 and recorder.state.best.value == pytest.approx(0.8125)
    best = torch.load(tmp_path / "out" / "model-best.pth", weights_only=True)
    assert torch.equal(best["weight"], weights[1]["weight"])
    with open(tmp_path / "out" / "metrics.csv") as f:
        assert [row["val_balanced_accuracy"] for row in csv.DictReader(f)] == ["0.750000", "0.812500"]


# --- the data ----------------------------------------------------------------------------------

def small_image(path, colour=(200, 40, 40), size=(20, 16), mode="RGB"):
    Image.new("RGB", size, colour).convert(mode).save(path)


def test_gif_and_tif_images_are_found_by_extension_in_any_case(tmp_path):
    from utils import read_split_data

    for name in ("a", "b"):
        os.makedirs(tmp_path / name)
    small_image(tmp_path / "a" / "one.GIF", mode="P")
    small_image(tmp_path / "a" / "two.tiff")
    small_image(tmp_path / "a" / "three.Tif")
    for name in ("a/x1.jpg", "a/x2.jpg", "b/y1.png", "b/y2.png"):
        small_image(tmp_path / name)
    split = read_split_data(str(tmp_path), val_rate=0.5)
    found = sorted(os.path.relpath(p, tmp_path) for p in split.train_images_path + split.val_images_path)
    assert found == ["a/one.GIF", "a/three.Tif", "a/two.tiff", "a/x1.jpg", "a/x2.jpg", "b/y1.png", "b/y2.png"]


def test_a_16_bit_image_becomes_rgb_with_its_top_8_bits(tmp_path):
    from multi_train_utils.images import read_image_uint8

    values = [0x1234, 0xFF00, 0x12FF, 0x00FF, 0x8000]
    image = Image.new("I;16", (len(values), 1))
    for x, value in enumerate(values):
        image.putpixel((x, 0), value)
    image.save(tmp_path / "deep.png")
    assert Image.open(tmp_path / "deep.png").mode == "I;16"  # really 16 bits on disk
    pixels = read_image_uint8(str(tmp_path / "deep.png"))
    assert pixels.dtype == torch.uint8 and pixels.shape == (3, 1, len(values))
    assert pixels[:, 0].tolist() == [[v >> 8 for v in values]] * 3  # 0x1234 -> 0x12, every channel


def test_a_label_file_without_val_list_is_split_by_val_rate_as_folders_are(tmp_path):
    from utils import read_label_files, read_split_data

    rows = []
    for name in ("cat", "dog"):
        os.makedirs(tmp_path / "images" / name)
        for i in range(5):
            small_image(tmp_path / "images" / name / f"{i}.png", colour=(i * 40, 10, 10))
            rows.append((f"images/{name}/{i}.png", name))
    with open(tmp_path / "train.csv", "w", newline="") as f:
        csv.writer(f).writerows([("path", "label"), *rows])
    split = read_label_files(str(tmp_path / "train.csv"), val_rate=0.4, seed=3)
    assert split.val_images_label.count(0) == split.val_images_label.count(1) == 2  # round(5 x 0.4)
    assert len(split.train_images_path) == 6 and not set(split.train_images_path) & set(split.val_images_path)
    folders = read_split_data(str(tmp_path / "images"), val_rate=0.4, seed=3)
    assert split.val_images_path == folders.val_images_path  # the same files, the same seed: the same split
    assert split.train_images_path == folders.train_images_path


# --- augmentation ------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["randaugment", "autoaugment"])
def test_auto_augment_randaugment_and_autoaugment_reach_the_transforms(policy, tmp_path):
    from torchvision.transforms import v2

    from my_dataset import augment_settings
    from multi_train_utils.images import build_transforms

    train, _ = build_transforms(32, **augment_settings(run_args(tmp_path, "--auto-augment", policy)))
    kinds = [type(t) for t in train.transforms]
    assert kinds == [v2.RandomResizedCrop, v2.RandomHorizontalFlip,
                     {"randaugment": v2.RandAugment, "autoaugment": v2.AutoAugment}[policy]]


def test_mixup_and_cutmix_together_give_each_batch_one_of_the_two():
    """A MixUp batch is lam x image + (1 - lam) x the image before it, everywhere; in a
    CutMix batch every pixel is one of the two images'. Over 20 steps both kinds occur."""
    from multi_train_utils.loaders import BatchMixer

    g = torch.Generator().manual_seed(3)
    images, labels = torch.randn(8, 3, 16, 16, generator=g), torch.arange(8) % 5
    partner = images.roll(1, 0)
    mixer = BatchMixer(5, mixup_alpha=0.4, cutmix_alpha=1.0, seed=0)
    kinds = []
    for step in range(20):
        mixed, targets = mixer(images, labels, epoch=0, step=step)
        lam = float(targets[0, labels[0]])
        own, pasted = (mixed == images).all(dim=1), (mixed == partner).all(dim=1)
        if torch.allclose(mixed, lam * images + (1 - lam) * partner, atol=1e-6) and not (own | pasted).all():
            kinds.append("mixup")
        elif (own | pasted).all():
            kinds.append("cutmix")
        else:
            kinds.append("neither")
    assert "neither" not in kinds and {"mixup", "cutmix"} == set(kinds), kinds


# --- errors and exit codes ---------------------------------------------------------------------

def raising(error):
    def main(argv):
        raise error
    return main


def test_a_lost_peer_exits_1_with_one_line(monkeypatch, capsys):
    import torch.distributed as dist

    from multi_train_utils.errors import run_cli

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    cases = [(dist.DistBackendError("Connection closed by peer"),
              "error: lost contact with another process (it failed or was stopped; see its error): Connection "
              "closed by peer\n"),
             (RuntimeError("[../gloo/transport.cc:42] Timed out waiting 1800000ms for recv operation"),
              "error: a collective timed out after --dist-timeout: another process stopped answering (it hangs or "
              "is gone): [../gloo/transport.cc:42] Timed out waiting 1800000ms for recv operation\n")]
    for error, line in cases:
        with pytest.raises(SystemExit) as exit_:
            run_cli(raising(error))
        assert exit_.value.code == 1
        assert capsys.readouterr().err == line


# --- flags -------------------------------------------------------------------------------------

def test_flag_defaults_are_the_readmes_and_demo_sets_resnet18_96_px_3_epochs():
    import predict
    from multi_train_utils.options import get_args_parser, parse_args

    readme = {"img_size": 224, "epochs": 30, "batch_size": 16, "lr": 0.001, "lrf": 0.1, "lr_step_size": 30,
              "lr_gamma": 0.1, "warmup_epochs": 0, "momentum": 0.9, "weight_decay": 0.005, "model_ema_decay": 0.9998,
              "seed": 0, "accum_steps": 1, "print_freq": 20, "output_dir": "weights", "log_dir": "runs",
              "keep_last": 1, "patience": 0, "val_rate": 0.2, "amp": "auto", "best_metric": "accuracy",
              "opt": "sgd", "lr_scheduler": "cosine", "dist_url": "env://", "dist_timeout": 1800, "sync_bn": None,
              "auto_augment": "none", "random_erase": 0.0, "mixup_alpha": 0.0, "cutmix_alpha": 0.0,
              "label_smoothing": 0.0, "class_weights": "none", "sampler": "shuffle", "scale_lr": True}
    args = vars(parse_args(get_args_parser(True), []))
    assert {k: args[k] for k in readme} == readme
    assert parse_args(get_args_parser(False), ["--opt", "adamw"]).weight_decay == 0.05
    demo = parse_args(get_args_parser(False), ["--demo"])
    assert (demo.model, demo.img_size, demo.epochs, demo.data_path) == ("resnet18", 96, 3, "data/demo")
    assert predict.get_args_parser().parse_args(["--weights", "w", "--image", "i"]).top_k == 3


# --- predict.py --------------------------------------------------------------------------------

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 5-class resnet18 of 32 px with a head that ranks classes 1, 3, 2 first, as
    checkpoint.pth (with args.json and class_indices.json beside it) and as a plain state
    dict alone in another folder; and a test image."""
    import torchvision

    root = tmp_path_factory.mktemp("trained")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5).eval()
    with torch.no_grad():
        model.fc.bias.copy_(torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0]))
    state = model.state_dict()
    run = root / "run"
    os.makedirs(run)
    torch.save({"model": state, "optimizer": {}, "epoch": 1, "classes": CLASSES, "args": {}}, run / "checkpoint.pth")
    with open(run / "args.json", "w") as f:
        json.dump({"model": "resnet18", "img_size": 32}, f)
    with open(run / "class_indices.json", "w") as f:
        json.dump({str(i): name for i, name in enumerate(CLASSES)}, f)
    alone = root / "alone"
    os.makedirs(alone)
    torch.save(state, alone / "weights.pth")
    rng = random.Random(0)
    image = Image.new("RGB", (48, 40))
    image.putdata([(rng.randrange(256), rng.randrange(256), rng.randrange(256)) for _ in range(48 * 40)])
    image.save(root / "photo.png")
    found = {"root": root, "run": run, "alone": alone, "model": model, "image": str(root / "photo.png")}
    return dict(found, top3=expected_top3(found))


def expected_top3(trained):
    """The top 3 (class, probability) of the test image, computed here: shorter side to
    round(32 x 256 / 224) = 37, center crop 32, ImageNet normalisation, softmax."""
    from torchvision.transforms.v2 import functional as F

    pixels = F.pil_to_tensor(Image.open(trained["image"]).convert("RGB"))
    pixels = F.center_crop(F.resize(pixels, [37], antialias=True), [32, 32])
    x = (pixels.float()[None] / 255 - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    with torch.no_grad():
        probabilities = torch.softmax(trained["model"](x), dim=1)[0]
    top = torch.topk(probabilities, 3)
    return [(CLASSES[int(i)], float(p)) for p, i in zip(top.values, top.indices)]


def run_predict(argv, capsys, monkeypatch):
    """predict.py's main as its command line runs it: (exit code, stdout, stderr). On one
    thread: the suite's other processes share the cores, and 2 threads then wait on each other."""
    import predict
    from multi_train_utils.errors import run_cli

    monkeypatch.setattr(predict, "configure_cpu_threads", lambda device: torch.set_num_threads(1))
    threads = torch.get_num_threads()
    try:
        run_cli(predict.main, [*argv, "--workers", "0", "--device", "cpu"])
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_top3_line(stdout, trained):
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(trained["image"] + ": "), stdout
    shown = [item.rsplit(" ", 1) for item in lines[0][len(trained["image"]) + 2:].split(", ")]
    expected = trained["top3"]
    assert [name for name, _ in shown] == [name for name, _ in expected]
    assert [float(p) for _, p in shown] == pytest.approx([p for _, p in expected], abs=2e-3)


def test_predict_takes_a_checkpoint_pth_as_weights(trained, capsys, monkeypatch):
    code, out, err = run_predict(["--weights", str(trained["run"] / "checkpoint.pth"), "--image", trained["image"]],
                                 capsys, monkeypatch)
    assert code == 0, err
    assert_top3_line(out, trained)


def test_predict_loads_strictly_and_names_the_tensor_that_does_not_fit(trained, tmp_path, capsys, monkeypatch):
    """Three class names against 5-class weights: refused, never a model with a random head."""
    with open(tmp_path / "three.json", "w") as f:
        json.dump({"0": "a", "1": "b", "2": "c"}, f)
    weights = str(trained["run"] / "checkpoint.pth")
    code, out, err = run_predict(["--weights", weights, "--image", trained["image"], "--class-indices",
                                  str(tmp_path / "three.json")], capsys, monkeypatch)
    assert code == 2 and out == ""
    assert err == (f"error: --weights {weights} does not match this model exactly: fc.bias is (5,) in the file but "
                   "(3,) in the model; pass the --model and --num-classes it was trained with\n")


def test_predict_flags_model_img_size_and_class_indices_win_over_the_run_files(trained, capsys, monkeypatch):
    alone = trained["alone"]
    argv = ["--weights", str(alone / "weights.pth"), "--image", trained["image"], "--model", "resnet18",
            "--img-size", "32", "--class-indices", str(trained["run"] / "class_indices.json")]
    code, out, err = run_predict(argv, capsys, monkeypatch)  # no args.json nor class_indices.json beside the weights
    assert code == 0, err
    assert_top3_line(out, trained)
    with open(alone / "args.json", "w") as f:  # run files that say otherwise: the flags win
        json.dump({"model": "resnet34", "img_size": 64}, f)
    with open(alone / "class_indices.json", "w") as f:
        json.dump({str(i): name for i, name in enumerate(reversed(CLASSES))}, f)
    try:
        code, out, err = run_predict(argv, capsys, monkeypatch)
    finally:
        os.remove(alone / "args.json")
        os.remove(alone / "class_indices.json")
    assert code == 0, err
    assert_top3_line(out, trained)


# --- class names -------------------------------------------------------------------------------

def test_class_names_cannot_escape_the_output_folder(tmp_path, capsys):
    """Names from a label file or class_indices.json may hold anything: every file written
    with them (args.json, class_indices.json, the confusion matrix, --eval-output's metrics)
    lands in the folder, under the fixed names."""
    from multi_train_utils.options import get_args_parser, parse_args
    from multi_train_utils.pictures import save_confusion_matrix
    from multi_train_utils.options import config_of
    from multi_train_utils.run_files import write_run_settings
    from multi_train_utils.recorder import report_evaluation
    from multi_train_utils.single_label import EvalResult
    from multi_train_utils.datasets import Datasets, MyDataSet

    classes = ["../../escaped", "../sibling", "..", "c\\d", "e"]
    out, evaluation = tmp_path / "deep" / "out", tmp_path / "deep" / "eval"
    os.makedirs(out)
    args = parse_args(get_args_parser(False), ["--eval-only", "--weights", str(out / "model-best.pth"),
                                               "--eval-output", str(evaluation), "--data-path", str(tmp_path)])
    write_run_settings(str(out), config_of(args).flags, classes)
    confusion = torch.eye(5, dtype=torch.int64)
    save_confusion_matrix(confusion, classes, str(out), "best epoch 0")
    labels = list(range(5))
    data = Datasets(MyDataSet(["x"] * 5, labels), MyDataSet(["y"] * 5, labels), classes)
    report_evaluation(lambda: EvalResult(confusion, None, 1.0), data, config_of(args))
    capsys.readouterr()
    written = sorted(os.path.relpath(os.path.join(folder, name), tmp_path)
                     for folder, _, names in os.walk(tmp_path) for name in names)
    assert written == sorted(["deep/out/args.json", "deep/out/class_indices.json", "deep/out/confusion_matrix.png",
                              "deep/out/confusion_matrix.csv", "deep/eval/confusion_matrix.png",
                              "deep/eval/confusion_matrix.csv", "deep/eval/overall_metrics.csv",
                              "deep/eval/per_class_metrics.csv"])
    with open(out / "class_indices.json") as f:
        assert json.load(f) == {str(i): name for i, name in enumerate(classes)}


# --- offline, and the files git ignores --------------------------------------------------------

class NoNetwork:
    """socket's ways out, each refused and noted: what a machine without a network gives."""

    def __init__(self, monkeypatch):
        import socket

        self.attempts = []
        for owner, name in ((socket, "getaddrinfo"), (socket, "create_connection"), (socket.socket, "connect"),
                            (socket.socket, "connect_ex")):
            monkeypatch.setattr(owner, name, self._refuse(name))

    def _refuse(self, name):
        def refuse(*args, **kwargs):
            self.attempts.append((name, args[1:] if name.startswith("connect") else args))
            raise OSError(errno.ENETUNREACH, "no network in this test")
        return refuse


def train_in_process(tiny_data, out, monkeypatch, *extra):
    """train_single.py's main in this process (1 epoch of FAST on tiny_data, one thread),
    without its Ctrl-C handlers and without taking over stdout for train.log."""
    import train_single

    monkeypatch.setattr(train_single, "install_stop_handlers", lambda *args, **kwargs: None)
    monkeypatch.setattr(train_single, "RunLog", NoRunLog)
    threads = torch.get_num_threads()
    try:
        train_single.main(train_args(tiny_data, out, "--epochs", "1", "--workers", "0", "--amp", "off",
                                     "--threads", "1", *extra))
    finally:
        torch.set_num_threads(threads)  # --threads sets this process's threads


def test_training_works_offline_without_touching_the_network(tiny_data, tmp_path, monkeypatch, capsys):
    """Everything but --download and --weights DEFAULT works offline: a whole run, with every
    way out of the machine refused, trains and writes its files without trying one."""
    network = NoNetwork(monkeypatch)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # and nothing downloaded before
    failure = None
    try:
        train_in_process(tiny_data, tmp_path / "out", monkeypatch, "--model", "mobilenet_v3_small")  # small: quick
    except Exception as e:  # noqa: BLE001 - the assertions below name it
        failure = e
    capsys.readouterr()
    assert network.attempts == []
    assert failure is None, repr(failure)
    with open(tmp_path / "out" / "metrics.csv") as f:
        assert [row["epoch"] for row in csv.DictReader(f)] == ["0"]


def test_weights_runs_and_data_are_git_ignored():
    """What runs write goes to folders git ignores (read from the .gitignore files, as git
    reads these simple patterns: "dir/" at the top, or "*" in the folder's own .gitignore)."""
    from conftest import REPO

    def patterns(path):
        if not os.path.isfile(path):
            return set()
        with open(path) as f:
            return {line.strip() for line in f if line.strip() and not line.startswith("#")}

    top = patterns(os.path.join(REPO, ".gitignore"))
    for folder in ("weights", "runs", "data"):
        own = patterns(os.path.join(REPO, folder, ".gitignore"))
        assert {f"{folder}/", f"/{folder}/", folder, f"/{folder}"} & top or "*" in own, folder
        assert {p for p in own if p.startswith("!")} <= {"!.gitignore"}, own  # nothing of a run taken back in


# --- --download --------------------------------------------------------------------------------

def fake_download(monkeypatch, example_data, archive=b""):
    """_fetch, check_archive and extract_dataset replaced by recorders: what download_flower_photos
    asks for, without the network. Returns the record."""
    asked = {}

    def fetch(url, file, size, root):
        asked.update(url=url, size=size)
        file.write(archive)

    monkeypatch.setattr(example_data, "_fetch", fetch)
    monkeypatch.setattr(example_data, "check_archive", lambda path, size, sha256: asked.update(sha256=sha256))
    monkeypatch.setattr(example_data, "extract_dataset", lambda path, root, counts: asked.update(counts=counts))
    return asked


def test_download_checks_the_url_size_and_sha256_that_tensorflow_datasets_records(tmp_path, monkeypatch):
    """TFDS's tf_flowers checksums.tsv: 228813984 bytes, this SHA-256; the README's URL."""
    from multi_train_utils import datasets as example_data

    asked = fake_download(monkeypatch, example_data)
    example_data.download_flower_photos(str(tmp_path / "flower_photos"))
    assert asked["url"] == "https://storage.googleapis.com/download.tensorflow.org/example_images/flower_photos.tgz"
    assert asked["size"] == 228_813_984
    assert asked["sha256"] == "4c54ace7911aaffe13a365c34f650e71dd5bf1be0a58b464e5a7183e3e595d9c"


def test_download_expects_the_readmes_images_per_class(tmp_path, monkeypatch):
    from multi_train_utils import datasets as example_data

    asked = fake_download(monkeypatch, example_data)
    example_data.download_flower_photos(str(tmp_path / "flower_photos"))
    assert asked["counts"] == {"daisy": 633, "dandelion": 898, "roses": 641, "sunflowers": 699, "tulips": 799}


def test_an_interrupted_download_never_looks_like_a_dataset(tmp_path, monkeypatch):
    """Ctrl-C while fetching, or while extracting a complete archive: no data/flower_photos,
    and nothing else left beside it."""
    import hashlib
    import io
    import tarfile

    from multi_train_utils import datasets as example_data

    data, root = tmp_path / "data", tmp_path / "data" / "flower_photos"

    def fetch_then_interrupt(url, file, size, root):
        file.write(b"\x1f\x8b" + b"x" * 1000)  # the start of an archive
        raise KeyboardInterrupt

    monkeypatch.setattr(example_data, "_fetch", fetch_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        example_data.download_flower_photos(str(root))
    assert os.listdir(data) == []

    buffer = io.BytesIO()  # a complete archive: flower_photos/daisy/0.png
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("flower_photos/daisy/0.png")
        info.size = len(png.getvalue())
        tar.addfile(info, io.BytesIO(png.getvalue()))
    archive = buffer.getvalue()
    monkeypatch.setattr(example_data, "_fetch", lambda url, file, size, root: file.write(archive))
    extractall = tarfile.TarFile.extractall

    def extract_then_interrupt(self, path=".", *args, **kwargs):
        extractall(self, path, *args, **kwargs)  # every file out, and then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(tarfile.TarFile, "extractall", extract_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        example_data.download_flower_photos(str(root), size=len(archive), sha256=hashlib.sha256(archive).hexdigest(),
                                            counts={"daisy": 1})
    assert os.listdir(data) == []


# --- model and device --------------------------------------------------------------------------

def test_weights_default_asks_torchvision_for_the_models_default_weights(monkeypatch):
    """ResNet-50's DEFAULT is IMAGENET1K_V2 in torchvision, not the first weights it lists."""
    import torchvision

    from multi_train_utils.model_setup import read_weights

    asked = []

    def load_state_dict_from_url(url, *args, **kwargs):
        asked.append(url)
        return {"fc.bias": torch.zeros(1000)}

    monkeypatch.setattr(torchvision.models._api, "load_state_dict_from_url", load_state_dict_from_url)
    default = "https://download.pytorch.org/models/resnet50-11ad3fa6.pth"
    assert torchvision.models.get_model_weights("resnet50").DEFAULT.url == default  # torchvision's own
    state = read_weights("DEFAULT", "resnet50", progress=False)
    assert asked == [default] and list(state) == ["fc.bias"]
    read_weights("IMAGENET1K_V1", "resnet50", progress=False)
    assert asked[1] == "https://download.pytorch.org/models/resnet50-0676ba61.pth"


def test_an_own_nn_module_returned_by_create_model_trains(tiny_data, tmp_path, monkeypatch, capsys):
    """README's example: create_model returns a small Sequential for --model tiny; a run
    trains it (the loss moves its weights) and saves weights that load into it strictly."""
    import model as model_module
    import train_single

    torchvision_model = model_module.create_model

    def create_model(name="resnet34", num_classes=5, channels=3):
        if name == "tiny":
            return nn.Sequential(nn.Conv2d(channels, 32, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                 nn.Flatten(), nn.Linear(32, num_classes))
        return torchvision_model(name, num_classes, channels)

    monkeypatch.setattr(train_single, "create_model", create_model)  # what the entry script hands the engine
    torch.manual_seed(0)  # the run's own seed decides its initial weights (--seed 0)
    initial = create_model("tiny", 5).state_dict()
    failure = None
    try:
        train_in_process(tiny_data, tmp_path / "out", monkeypatch, "--model", "tiny")
    except Exception as e:  # noqa: BLE001 - the assertion below names it
        failure = e
    capsys.readouterr()
    assert failure is None, repr(failure)
    trained = torch.load(tmp_path / "out" / "model-0.pth", weights_only=True)
    own = create_model("tiny", 5)
    own.load_state_dict(trained, strict=True)
    assert not torch.equal(trained["4.weight"], initial["4.weight"])
    with open(tmp_path / "out" / "metrics.csv") as f:
        assert 0 < float(next(csv.DictReader(f))["train_loss"]) < 10


def test_device_auto_takes_mps_where_there_is_no_cuda(monkeypatch):
    from multi_train_utils.distributed_utils import select_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert select_device("auto") == torch.device("mps")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert select_device("auto") == torch.device("cpu")


# --- what a run shows and draws ----------------------------------------------------------------

def test_class_distribution_png_counts_images_per_class_from_targets(tmp_path, monkeypatch):
    from multi_train_utils import recorder as recorder_module
    from conftest import run_recorder
    from multi_train_utils.datasets import Datasets

    class Preview(torch.utils.data.Dataset):  # what batch_preview.png draws, asked as (epoch, index)
        def __len__(self):
            return 4

        def __getitem__(self, key):
            return torch.zeros(3, 8, 8, dtype=torch.uint8), key[1] % 3

    drawn, save_figure = {}, recorder_module.save_figure

    def keep(fig, path, *args, **kwargs):
        drawn[os.path.basename(path)] = fig
        return save_figure(fig, path, *args, **kwargs)

    monkeypatch.setattr(recorder_module, "save_figure", keep)
    data = Datasets(Labelled([0, 0, 2, 0, 1, 2]), Labelled([2, 0]), ["a", "b", "c"])
    recorder = run_recorder(run_args(tmp_path, "--plots"), data, enabled=True)
    recorder.plot_data(data, Preview())
    recorder.close()
    assert (tmp_path / "out" / "class_distribution.png").is_file()
    ax = drawn["class_distribution.png"].axes[0]
    assert [[bar.get_height() for bar in bars] for bars in ax.containers] == [[3, 1, 2], [1, 0, 1]]  # train, val
    assert [text.get_text() for text in ax.get_legend().get_texts()] == ["train (6)", "val (2)"]


def test_the_pictures_command_draws_curves_of_a_run_not_yet_finished(tmp_path, capsys):
    """A run after its first epoch: one row in metrics.csv, no checkpoint, no pictures yet."""
    from multi_train_utils import pictures
    from multi_train_utils.errors import run_cli

    run_dir = tmp_path / "run"
    os.makedirs(run_dir)
    (run_dir / "metrics.csv").write_text(
        "epoch,train_loss,val_accuracy,lr,images_per_second,epoch_seconds,val_loss,val_balanced_accuracy,"
        "val_macro_f1,val_top5_accuracy,ema_val_accuracy,ema_val_loss,ema_val_balanced_accuracy,ema_val_macro_f1,"
        "best_source\n0,1.612345,0.400000,0.00097553,12.50,8.200,1.500000,0.400000,0.350000,,,,,,model\n")
    try:
        run_cli(pictures.main, [str(run_dir)])  # as its command line runs it
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    assert code == 0, out.err
    assert out.out == f"wrote {run_dir / 'curves.png'} (1 epochs)\n"
    with Image.open(run_dir / "curves.png") as img:
        assert img.format == "PNG" and min(img.size) >= 200


def test_no_picture_opens_a_window():
    """Every picture is a bare matplotlib Figure: no pyplot, so no window manager and no GUI
    backend, whatever the machine has (a pyplot figure has a manager even under Agg)."""
    from multi_train_utils.pictures import (plot_batch_preview, plot_class_distribution, plot_confusion_matrix,
                                            plot_training_curves, save_figure)

    rows = [{"epoch": "0", "train_loss": "1.5", "val_accuracy": "0.5", "lr": "0.001"}]
    figures = [plot_class_distribution(["a", "b"], [3, 1], [1, 0]),
               plot_batch_preview(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), [0, 1], ["a", "b"]),
               plot_training_curves(rows), plot_confusion_matrix(torch.eye(2, dtype=torch.int64), ["a", "b"])]
    for fig in figures:
        assert fig.canvas.manager is None, type(fig.canvas)
    assert save_figure(figures[0], os.devnull) == os.devnull  # drawn by Agg all the same


def start_summary(tmp_path, monkeypatch, capsys, flags, model=None, lr=0.001, world_size=1):
    """The lines of print_start_summary for a train_multi_gpu.py run with ``flags``."""
    from multi_train_utils.options import get_args_parser, parse_args
    from multi_train_utils import recorder as summary
    from multi_train_utils.recorder import print_start_summary
    from multi_train_utils.train_eval_utils import LoopSettings
    from multi_train_utils.datasets import Datasets

    monkeypatch.chdir(tmp_path)
    args = parse_args(get_args_parser(True), ["--model", "resnet18", *flags])
    data = Datasets(Labelled([0, 1, 0, 1]), Labelled([0, 1]), ["a", "b"])
    model = model or nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))  # 4 x 3 + 3 + 3 x 2 + 2 = 23 parameters
    monkeypatch.setattr(summary, "get_world_size", lambda: world_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    print_start_summary(config_of(args), data, TrainState(model, optimizer), LoopSettings(), torch.device("cpu"),
                        log_dir="runs/x")
    return capsys.readouterr().out.splitlines()


def test_start_summary_prints_the_parameter_count_and_the_learning_rate_schedule(tmp_path, monkeypatch, capsys):
    lines = start_summary(tmp_path, monkeypatch, capsys, ["--warmup-epochs", "1", "--epochs", "4"])
    assert "model: resnet18 (23 parameters)" in lines
    assert "lr: 0.001; 1 warm-up epochs, then cosine to 0.0001 at epoch 3" in lines
    frozen = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    frozen[0].requires_grad_(False)
    lines = start_summary(tmp_path, monkeypatch, capsys, ["--epochs", "4"], frozen, lr=0.002, world_size=2)
    assert "model: resnet18 (23 parameters, 8 trainable)" in lines
    assert "lr: 0.002 (0.001 x 2 processes); cosine to 0.0002 at epoch 3" in lines  # lrf of the scaled rate
    lines = start_summary(tmp_path, monkeypatch, capsys, ["--lr-scheduler", "step", "--lr-step-size", "2",
                                                          "--lr-gamma", "0.5"])
    assert "lr: 0.001; x 0.5 every 2 epochs" in lines


def test_the_epoch_line_shows_the_learning_rate_and_the_speed(tmp_path, capsys):
    """The epoch's last lr (0.01 here, not --lr 0.001) and its images/s (4.0)."""
    from multi_train_utils.single_label import EvalResult

    record_epochs(tmp_path, ["a", "b", "c"], [EvalResult(torch.tensor([[3, 1, 0], [0, 2, 2], [1, 0, 1]]), None, 7.5)])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[epoch")]
    assert lines == ["[epoch 0] train_loss: 1.5000  val_accuracy: 0.6000 (6/10)  lr: 0.01  4.0 img/s"]


def test_the_training_bar_shows_images_per_second_the_eta_and_the_loss(capsys):
    import re

    from multi_train_utils.train_eval_utils import LoopSettings, train_one_epoch

    class Loader(list):
        batch_sampler = full_flags(batch_size=4)

    torch.manual_seed(0)
    loader = Loader((torch.rand(4, 3, 4, 4), torch.tensor([0, 1, 2, 0])) for _ in range(6))
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 3))
    stats = train_one_epoch(TrainState(model, torch.optim.SGD(model.parameters(), lr=0.01)), loader,
                            torch.device("cpu"), 0, LoopSettings(print_freq=2))
    final = capsys.readouterr().out.split("\r")[-1].strip()  # the bar as it ends
    bar = re.fullmatch(r"\[train epoch 0\]: 100%\|\S+\| 24/24 \[\d\d:\d\d<\d\d:\d\d, +[\d.]+img/s, loss=(\S+)\]",
                       final)
    assert bar, final
    assert bar.group(1) == f"{stats.mean_loss:.3f}"


# --- flags -------------------------------------------------------------------------------------

def test_help_describes_every_flag_with_its_default():
    from multi_train_utils.options import get_args_parser

    readme = {"--img-size": "224", "--epochs": "30", "--batch-size": "16", "--lr": "0.001", "--lrf": "0.1",
              "--lr-step-size": "30", "--lr-gamma": "0.1", "--warmup-epochs": "0", "--momentum": "0.9",
              "--model-ema-decay": "0.9998", "--seed": "0", "--accum-steps": "1", "--print-freq": "20",
              "--amp": "auto", "--output-dir": "weights", "--log-dir": "runs", "--val-rate": "0.2",
              "--patience": "0"}
    for distributed in (False, True):
        parser = get_args_parser(distributed)
        blocks = help_blocks(parser)
        for action in parser._actions:
            if action.dest != "help":
                block = blocks[action.option_strings[0]]
                assert "default" in block, block
        expected = dict(readme, **({"--dist-url": "env://", "--dist-timeout": "1800"} if distributed else {}))
        for flag, value in expected.items():
            assert f"(default: {value})" in blocks[flag], blocks[flag]
        assert "default: 1, the last epoch's" in blocks["--keep-last"]


# --- the doctor --------------------------------------------------------------------------------

def node_facts(**changes):
    """What local_facts gathers on a healthy node, with ``changes``."""
    facts = {"rank": 0, "local_rank": 0, "host": "node0", "pid": 1000, "device": "cpu", "gpu": None,
             "torch": "2.14.1", "cores": 8, "cores_per_process": 4, "cpus": list(range(8)), "shm_total": 8 << 30,
             "shm_free": 8 << 30, "output_dir": "/runs/x", "disk_free": 10**11, "interfaces": ["lo", "eth0"],
             "variables": {}}
    facts.update(changes)
    return facts


def one_rank_doctor_store(monkeypatch, prefix, facts):
    """(the TCPStore server, doctor's store on it) of a 1-process job at MASTER_ADDR:MASTER_PORT,
    with rank 0's ``facts`` joined: what check_collectives reads."""
    from datetime import timedelta

    import torch.distributed as dist

    from conftest import free_port
    from tools import doctor

    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    server = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=10), wait_for_workers=False)
    store = doctor._Store(server, prefix)
    store.set("joined/0", facts)
    return server, store


def test_doctor_times_64_mib_on_gpus_and_8_on_cpus(tmp_path, monkeypatch, capsys):
    """check_collectives of a 1-process job on a real store, its collectives replaced by a
    recorder of the all-reduce size they are given."""
    from tools import doctor
    from multi_train_utils.distributed_utils import DistEnv

    sizes = []

    def run_collectives(state, store, env, device, backend, deadline, size_mb):
        sizes.append(size_mb)
        state.update(phase="done", low=1.0, high=1.0, seconds=0.01, bytes=int(size_mb * 2**20))

    monkeypatch.setattr(doctor, "run_collectives", run_collectives)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    env = DistEnv(rank=0, world_size=1, launcher="env")
    for device, flags, size in (("cuda", [], 64), ("cpu", [], 8), ("cuda", ["--size-mb", "3"], 3)):
        server, store = one_rank_doctor_store(monkeypatch, f"test/{device}/{size}/", node_facts(device=device))
        args = doctor.get_args_parser().parse_args(["--timeout", "5", *flags])
        assert doctor.check_collectives(args, env, torch.device(device), "gloo", store) == 0
        assert sizes[-1] == size
        assert f"in all {size:g} MiB" in capsys.readouterr().out
        del server


def test_doctor_bus_bandwidth_is_counted_as_nccl_tests_count_it():
    """nccl-tests' all-reduce bus bandwidth: size / time x 2 (n - 1) / n. 128 MiB in 0.1 s is
    1.342 GB/s of algorithm bandwidth: x 1 on 2 ranks, x 1.5 on 4."""
    from tools.doctor import _all_reduce_text

    for world_size, expected in ((2, "1.34"), (4, "2.01")):
        total = world_size * (world_size + 1) / 2
        results = {r: {"phase": "done", "low": total, "high": total, "seconds": 0.1, "bytes": 2**27}
                   for r in range(world_size)}
        assert _all_reduce_text(results, world_size).endswith(f"5 runs of 100.0 ms, bus bandwidth {expected} GB/s")
    # the slowest rank's time: rank 1 took 0.2 s, so half of 2 ranks' 1.34 GB/s
    results = {0: {"phase": "done", "low": 3.0, "high": 3.0, "seconds": 0.1, "bytes": 2**27},
               1: {"phase": "done", "low": 3.0, "high": 3.0, "seconds": 0.2, "bytes": 2**27}}
    assert _all_reduce_text(results, 2).endswith("5 runs of 200.0 ms, bus bandwidth 0.67 GB/s")


def test_doctor_report_names_each_gpu_with_its_uuid(tmp_path, monkeypatch):
    """As nvidia-smi -L spells it: the name, then GPU-<uuid>."""
    import types

    from tools import doctor
    from multi_train_utils.distributed_utils import DistEnv

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        name="NVIDIA H200", uuid="5e6f7a8b-1111-2222-3333-444455556666"))
    args = doctor.get_args_parser().parse_args(["--output-dir", str(tmp_path)])
    env = DistEnv(rank=0, world_size=1, launcher="env")
    facts = doctor.local_facts(args, env, torch.device("cuda:0"), "nccl")
    assert facts["gpu"] == {"name": "NVIDIA H200", "uuid": "GPU-5e6f7a8b-1111-2222-3333-444455556666"}
    report = doctor.format_report({0: facts}, {}, [], world_size=1, backend="nccl", rendezvous="127.0.0.1:29500",
                                  timeout=20).splitlines()
    assert (f"  rank 0: cuda:0 NVIDIA H200 GPU-5e6f7a8b-1111-2222-3333-444455556666 (local rank 0, pid {os.getpid()})"
            in report)


class DictStore:
    """The doctor's store (_Store's set and get), in memory."""

    def __init__(self, values=None):
        self.values = dict(values or {})

    def set(self, key, value):
        self.values[key] = json.loads(json.dumps(value))

    def get(self, key):
        return self.values[key]


def test_doctor_lowest_rank_that_joined_reports_when_rank_0_is_missing(monkeypatch, capsys):
    from tools import doctor
    from multi_train_utils.distributed_utils import DistEnv

    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    args = doctor.get_args_parser().parse_args([])
    joined = {f"joined/{r}": node_facts(rank=r, local_rank=r, pid=1000 + r) for r in (1, 2)}
    for rank, reports in ((1, True), (2, False)):
        store = DictStore(joined)
        assert doctor.report_missing(args, DistEnv(rank=rank, world_size=3, launcher="env"), "gloo", store, [0]) == 1
        lines = capsys.readouterr().out.splitlines()
        if reports:
            assert lines, "rank 1, the lowest that joined, printed no report"
            assert lines[0] == ("doctor: 2 of 3 ranks joined, on 1 node(s); backend gloo; store 10.0.0.1:29500; "
                                "torch 2.14.1")
            assert "problem: rank 0 never joined within 20 s (expected world size 3; joined: ranks 1-2)" in lines
            assert lines[-1] == "1 problem found"
        else:  # the report is rank 1's alone
            assert lines == [] and "abort" not in store.values


def test_doctor_exits_2_for_a_wrong_flag(capsys):
    from tools import doctor
    from multi_train_utils.errors import run_cli

    cases = [(["--bad-flag"], "error: unrecognized arguments: --bad-flag (see --help)\n"),
             (["--timeout", "soon"], "error: argument --timeout: invalid float value: 'soon' (see --help)\n"),
             (["--timeout", "0"], "error: --timeout 0.0: give a positive number of seconds\n")]
    for argv, line in cases:
        with pytest.raises(SystemExit) as exit_:
            run_cli(doctor.main, argv)
        assert exit_.value.code == 2
        assert capsys.readouterr().err == line


def test_doctor_finds_a_master_addr_that_does_not_resolve(monkeypatch):
    """A rank other than 0 (rank 0 hosts the store); no name is looked up for real."""
    import socket

    from tools import doctor
    from multi_train_utils.distributed_utils import DistEnv

    def unknown(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    def refused(*args, **kwargs):
        raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")

    monkeypatch.setattr(doctor.socket, "getaddrinfo", unknown)
    monkeypatch.setattr(doctor.socket, "create_connection", refused)
    monkeypatch.setattr(doctor.socket, "gethostname", lambda: "node7")
    monkeypatch.setenv("MASTER_ADDR", "gpu-head.cluster")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    store, found = doctor.connect_store(DistEnv(rank=3, world_size=4, launcher="env"), timeout=0.5)
    assert store is None
    assert (found["kind"], found["what"]) == ("problem", "rank 3 on node node7: MASTER_ADDR=gpu-head.cluster is not "
                                                         "a known host name here")
    assert "MASTER_ADDR" in found["fix"]


def test_doctor_finds_under_5_gb_free_in_the_output_dir(monkeypatch):
    from tools.doctor import disk_finding, node_findings

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    low = disk_finding("/runs/x", 4.9e9)
    assert low is not None
    assert (low["kind"], low["what"]) == ("problem", "only 4.9 GB free in /runs/x: checkpoints may not fit")
    assert disk_finding("/runs/x", 5e9) is None and disk_finding("/runs/x", None) is None
    assert node_findings(node_facts(disk_free=4.9e9), "gloo", 1) == [low]
    assert node_findings(node_facts(disk_free=5e9), "gloo", 1) == []


def test_doctor_hints_at_several_consumer_gpus_on_a_node(monkeypatch):
    from tools.doctor import exit_code, node_findings

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    geforce = {"name": "NVIDIA GeForce RTX 4090", "uuid": "GPU-1"}
    found = node_findings(node_facts(gpu=geforce, device="cuda:0"), "nccl", 2)
    assert [(f["kind"], f["what"]) for f in found] == [
        ("hint", "NVIDIA GeForce RTX 4090: consumer GPUs often hang NCCL's first all-reduce over P2P")]
    assert "NCCL_P2P_DISABLE=1" in found[0]["fix"] and exit_code(found) == 0
    assert node_findings(node_facts(gpu=geforce, device="cuda:0"), "nccl", 1) == []  # one GPU: no P2P
    assert node_findings(node_facts(gpu={"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-2"}), "nccl", 8) == []


def test_doctor_hints_at_a_slurm_job_without_kill_bad_exit(monkeypatch):
    from tools.doctor import node_findings

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_KILL_BAD_EXIT", raising=False)
    found = node_findings(node_facts(), "gloo", 1)
    assert [(f["kind"], f["what"]) for f in found] == [
        ("hint", "SLURM: a task that fails leaves the others waiting for it until the time-out")]
    assert "--kill-on-bad-exit=1" in found[0]["fix"]
    monkeypatch.setenv("SLURM_KILL_BAD_EXIT", "1")
    assert node_findings(node_facts(), "gloo", 1) == []
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.delenv("SLURM_KILL_BAD_EXIT")
    assert node_findings(node_facts(), "gloo", 1) == []  # not a SLURM job


def test_doctor_hints_at_fewer_than_2_cpu_cores_per_process(monkeypatch):
    from tools.doctor import cores_finding, node_findings

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    one = cores_finding(1)
    assert one is not None
    assert (one["kind"], one["what"]) == ("hint", "1 CPU core per process: loader workers and the model share it "
                                                  "(slow)")
    assert cores_finding(2) is None
    assert node_findings(node_facts(cores_per_process=1), "gloo", 8) == [one]
    assert node_findings(node_facts(cores_per_process=2), "gloo", 4) == []


# --- performance -------------------------------------------------------------------------------

GRAD_CHECKPOINT_STAGES = {
    "efficientnet_b0": [f"features.{i}" for i in range(9)],  # the stem, 7 stages of MBConv blocks, the head conv
    "convnext_tiny": [f"features.{i}" for i in range(8)],  # the stem, then 4 stages with 3 downsamplings between
    "regnet_y_400mf": [f"trunk_output.block{i}" for i in range(1, 5)],
    "vit_b_16": [f"encoder.layers.encoder_layer_{i}" for i in range(12)],
}


@pytest.mark.parametrize("name", list(GRAD_CHECKPOINT_STAGES))
def test_grad_checkpoint_finds_the_stages_of_efficientnet_convnext_regnet_and_vit(name):
    """The stages each architecture is checkpointed in (named by hand from torchvision's
    models); the recomputation itself, with the plain gradients and BatchNorm statistics, is
    test_speed.py's test of ResNet, MobileNet and DenseNet. On the meta device where a
    model can be built there: no weights, no forward pass."""
    from model import create_model
    from multi_train_utils.model_setup import enable_grad_checkpoint, model_stages

    with torch.device("cpu" if name.startswith("regnet") else "meta"):  # RegNet computes its widths on tensors
        model = create_model(name, 5)
    keys = list(model.state_dict())
    assert [stage for stage, _ in model_stages(model)] == GRAD_CHECKPOINT_STAGES[name]
    assert enable_grad_checkpoint(model, name) == GRAD_CHECKPOINT_STAGES[name]
    assert [type(model.get_submodule(stage)).__name__.startswith("Checkpointed")
            for stage in GRAD_CHECKPOINT_STAGES[name]] == [True] * len(GRAD_CHECKPOINT_STAGES[name])
    assert list(model.state_dict()) == keys  # checkpoints stay loadable anywhere


def test_channels_last_is_on_for_convolutional_nets_only():
    from multi_train_utils.model_setup import wants_channels_last

    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 16), nn.ReLU(), nn.Linear(16, 2))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [wants_channels_last(None, conv, d) for d in (cpu, cuda)] == [True, True]
    assert [wants_channels_last(None, mlp, d) for d in (cpu, cuda)] == [False, False]
    assert wants_channels_last(True, mlp, cpu) is True and wants_channels_last(False, conv, cpu) is False


def test_training_images_keep_twice_the_crop_size(monkeypatch):
    """Large JPEGs are decoded down to no less than 2 x --img-size for training (random crops
    of a quarter of the image lose nothing), and to the resize size for validation."""
    import types

    import multi_train_utils.datasets as my_dataset

    split = types.SimpleNamespace(train_images_path=["t.jpg"], train_images_label=[0], val_images_path=["v.jpg"],
                                  val_images_label=[0], classes=["a"], skipped=[], skip_reasons={}, notes=[])
    read = []

    def read_image_uint8(path, keep_side=None, channels=3):
        read.append((path, keep_side))
        return torch.zeros(channels, 100, 100, dtype=torch.uint8)

    monkeypatch.setattr(my_dataset, "read_image_uint8", read_image_uint8)
    data = my_dataset.image_file_datasets(split, 32)
    data.train[0], data.val[0]
    assert read == [("t.jpg", 64), ("v.jpg", 37)]  # validation: round(32 x 256 / 224)
    assert my_dataset.image_file_datasets(split, 96).train.keep_side == 192


def test_pin_memory_on_cuda_only():
    from torch.utils.data import BatchSampler

    from multi_train_utils.loaders import make_loader

    data = list(range(4))
    sampler = BatchSampler(range(4), 2, drop_last=False)
    for device, pinned in (("cpu", False), ("cuda", True), ("mps", False)):
        loaders = [make_loader(data, sampler, 0, torch.device(device), validation=v) for v in (False, True)]
        assert [loader.pin_memory for loader in loaders] == [pinned, pinned], device


def test_benchmark_writes_runs_benchmark_json_by_default():
    import benchmark

    assert benchmark.get_args_parser().parse_args([]).json == "runs/benchmark.json"
    assert benchmark.get_args_parser().parse_args(["--quick"]).json == "runs/benchmark.json"


# --- layout ------------------------------------------------------------------------------------

def product_files():
    """The project's own Python files (tests and docs left out)."""
    from conftest import REPO

    files = [os.path.join(REPO, name) for name in sorted(os.listdir(REPO)) if name.endswith(".py")]
    package = os.path.join(REPO, "multi_train_utils")
    return files + [os.path.join(package, name) for name in sorted(os.listdir(package)) if name.endswith(".py")]


def test_train_multi_gpu_numbers_its_distributed_steps_1_to_8_in_run_order():
    """The README's eight steps, each numbered comment followed by the call it names, in order."""
    import re

    from conftest import REPO

    with open(os.path.join(REPO, "train_multi_gpu.py")) as f:
        lines = f.read().splitlines()
    steps = [(int(m.group(1)), i) for i, line in enumerate(lines) for m in [re.search(r"# (\d)\. ", line)] if m]
    assert [number for number, _ in steps] == list(range(1, 9)), steps
    calls = ["init_distributed_mode(", "make_train_sampler(", "convert_sync_batchnorm(", "DDP(", ".set_epoch(",
             "train_one_epoch(", "recorder.end_epoch(", "cleanup("]
    ends = [line for _, line in steps[1:]] + [len(lines)]
    for (number, start), end, call in zip(steps[:7], ends, calls):
        assert any(call in line.split("#")[0] for line in lines[start:end]), (number, call)
    # 8.: main is wrapped in leaves_process_group, which calls cleanup() on the way out
    assert lines[lines.index("def main(argv=None):") - 1].startswith("@leaves_process_group")
    import inspect

    from multi_train_utils.distributed_utils import leaves_process_group
    assert "cleanup(failed=" in inspect.getsource(leaves_process_group)


def test_run_files_is_the_one_module_that_names_args_json_class_indices_json_and_metrics_csv():
    """Those three names as plain strings (in messages they may appear) only in run_files.py,
    so every reader and writer goes through it."""
    import ast

    names = {"args.json", "class_indices.json", "metrics.csv"}
    found = []
    for path in product_files():
        with open(path) as f:
            tree = ast.parse(f.read())
        in_messages = {id(node) for joined in ast.walk(tree) if isinstance(joined, ast.JoinedStr)
                       for node in ast.walk(joined)}
        found += [(os.path.relpath(path, os.path.dirname(product_files()[0])), node.lineno, node.value)
                  for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in names
                  and id(node) not in in_messages]
    assert sorted((path, name) for path, _, name in found) == [("multi_train_utils/run_files.py", "args.json"),
                                                               ("multi_train_utils/run_files.py", "class_indices.json"),
                                                               ("multi_train_utils/run_files.py", "metrics.csv")], found


def test_ci_installs_then_runs_the_readmes_test_command():
    from conftest import REPO

    with open(os.path.join(REPO, ".ci", "run")) as f:
        commands = [line.strip() for line in f if line.strip() and not line.strip().startswith("#")]
    assert commands[-1] == "python3 -m pytest -q tests"  # README: python -m pytest -q tests
    installs = [i for i, command in enumerate(commands) if "pip install" in command and "-r requirements.txt" in command]
    assert installs and installs[0] < len(commands) - 1


# --- stopping ----------------------------------------------------------------------------------

def test_a_process_stuck_after_a_stop_signal_is_ended_by_the_watchdog(monkeypatch, capfd):
    """The main thread never finishes unwinding (as one blocked in a collective): the watchdog
    prints the hint and ends the process with 128 + the signal, grace_seconds after the
    signal (3 s by default; 0.3 s here, with os._exit recorded instead of run)."""
    import inspect
    import signal
    import threading
    import time

    from multi_train_utils import errors as signals

    assert inspect.signature(signals.install_stop_handlers).parameters["grace_seconds"].default == 3.0
    ended, done = [], threading.Event()

    def exit_(code):
        ended.append((code, time.monotonic()))
        done.set()

    with stop_handlers(monkeypatch, exit_, done, "to continue, run it again", grace_seconds=0.3):
        sent = time.monotonic()
        with pytest.raises(signals.TrainingInterrupted) as stop:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        assert done.wait(3), "the watchdog did not end the process"
    assert stop.value.signum == signal.SIGINT
    (code, at), = ended
    assert code == 130 and 0.3 <= at - sent < 1.5, (code, at - sent)
    assert capfd.readouterr().err == "\ninterrupted by SIGINT: to continue, run it again\n"


@pytest.mark.skipif(not os.uname().sysname == "Linux", reason="the parent-death signal is Linux's")
def test_spawned_workers_die_with_their_launcher(monkeypatch):
    """Each --spawn process asks the kernel for SIGKILL when its launcher dies, before it runs
    anything (a forked child shows what die_with_launcher leaves set)."""
    import ctypes
    import signal

    from multi_train_utils import distributed_utils, errors as signals

    calls = []
    monkeypatch.setattr(distributed_utils, "die_with_launcher", lambda: calls.append("die_with_launcher"))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # set here, so that monkeypatch puts them back

    def main(argv):
        calls.append(("main", argv, os.environ["RANK"]))

    distributed_utils._run_local_rank(1, main, 2, 29999, ["--epochs", "1"])
    assert calls == ["die_with_launcher", ("main", ["--epochs", "1"], "1")]

    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no torch work
        try:
            signals.die_with_launcher()
            value = ctypes.c_int(-1)
            ctypes.CDLL(None).prctl(2, ctypes.byref(value))  # PR_GET_PDEATHSIG
            os.write(write_fd, str(value.value).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    got = os.read(read_fd, 16)
    os.close(read_fd)
    os.waitpid(pid, 0)
    assert int(got) == signal.SIGKILL


def test_doctor_reports_a_hung_all_reduce_within_its_timeout_naming_the_step(monkeypatch, capsys):
    """check_collectives of a 1-process job whose all-reduce never returns: within --timeout it
    reports the hang with the step, exits 1 and leaves the stuck thread (os._exit)."""
    import threading
    import time

    from tools import doctor
    from multi_train_utils.distributed_utils import DistEnv

    release = threading.Event()

    def hanging_collectives(state, store, env, device, backend, deadline, size_mb):
        state.update(phase="all-reduce")
        release.wait(15)  # a collective that does not return within --timeout

    class Exited(Exception):
        pass

    def fake_exit(code):
        raise Exited(code)

    monkeypatch.setattr(doctor, "run_collectives", hanging_collectives)
    monkeypatch.setattr(doctor.os, "_exit", fake_exit)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    server, store = one_rank_doctor_store(monkeypatch, "test/hang/", node_facts())
    args = doctor.get_args_parser().parse_args(["--timeout", "2"])
    start = time.monotonic()
    try:
        with pytest.raises(Exited) as exited:
            doctor.check_collectives(args, DistEnv(rank=0, world_size=1, launcher="env"), torch.device("cpu"),
                                     "gloo", store)
    finally:
        release.set()
    assert exited.value.args == (1,)
    assert time.monotonic() - start < 2 + 3 + 5  # --timeout, rank 0's grace for late results, a busy machine
    out = capsys.readouterr().out
    assert "problem: the all-reduce did not finish within 2 s on rank 0 (a hang)\n" in out, out
    assert out.rstrip().endswith("1 problem found")
    del server


@pytest.mark.parametrize("checkpoint, compared", [(None, (-1, -1)), ({"epoch": 0}, (0, -1)), ({"epoch": 4}, (4, -1)),
                                                  ({"epoch": -1, "position": {"done": 8}}, (-1, 8)),
                                                  ({"epoch": 4, "position": {"done": 0}}, (4, 0))],
                         ids=["none", "epoch_0", "epoch_4", "inside_epoch_0", "inside_epoch_5"])
def test_the_ranks_compare_the_epoch_and_position_of_their_checkpoint(monkeypatch, checkpoint, compared):
    """read_inputs hands check_same_on_every_rank the checkpoint's epoch, -1 for none, then the
    images done inside the next epoch, -1 for a save at an epoch's end: a rank with no
    checkpoint and one with epoch 0's (one epoch done) disagree, and so do a rank with the end
    of epoch 4 and one with a save inside epoch 5 (its "epoch" is 4 too)."""
    from multi_train_utils import run_files as inputs

    seen = []
    monkeypatch.setattr(inputs, "_prepare", lambda *a, **k: (None, "ckpt", checkpoint))
    monkeypatch.setattr(inputs, "load_data", lambda *a, **k: None)
    monkeypatch.setattr(inputs, "_check_resume_and_weights", lambda *a, **k: None)
    monkeypatch.setattr(inputs, "check_same_on_every_rank", lambda value, device, what: seen.append((value, what)))
    assert inputs.read_inputs(config_of(full_flags()), None, torch.device("cpu")).checkpoint is checkpoint
    assert seen == [(compared[0], "the checkpoint to resume from"),
                    (compared[1], "the images done inside the epoch of the checkpoint to resume from (-1: none)")]
