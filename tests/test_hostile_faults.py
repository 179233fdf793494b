"""Faults answered with one line instead of a traceback: a full disk, exhausted memory, flags
that are not finite numbers, image sizes and batches a model cannot take, run files whose
fields are of the wrong kind."""
import errno
import json
import os
import shutil

import pytest
import torch

from conftest import MODEL, PYTHON, run, script, train_args, full_flags
from multi_train_utils import checkpoint as ckpt
from multi_train_utils.errors import ResourceError, UserError, run_cli

CPU_OUT_OF_MEMORY = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                     "tried to allocate 30000000000 bytes. Error code 12 (Cannot allocate memory)")


def cli_result(main, capsys):
    """(exit code, stderr) of ``run_cli(main)``; an exception that escapes it is returned instead
    of an exit code, so that a missing conversion fails an assertion."""
    capsys.readouterr()
    try:
        run_cli(main)
        code = 0
    except SystemExit as e:
        code = e.code
    except Exception as e:  # the traceback a user would have seen
        code = f"escaped: {type(e).__name__}: {e}"
    return code, capsys.readouterr().err


def error_of(call, *args):
    """The exception ``call(*args)`` raises (None if none): a wrong kind fails an assertion
    rather than the test's run."""
    try:
        call(*args)
    except Exception as e:
        return e
    return None


def raising(error):
    def main(argv=None):
        raise error
    return main


class FillingFile:
    """A file object whose disk fills up after ``room`` bytes."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, data):
        if len(data) > self.room:
            self.f.write(data[:self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.f.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def __getattr__(self, name):
        return getattr(self.f, name)


def state(epoch):
    return {"model": {"w": torch.full((64,), float(epoch))}, "optimizer": {}, "epoch": epoch, "classes": ["a", "b"],
            "args": {}}


def epoch_of(path):
    return torch.load(path, weights_only=True)["epoch"]


# --- A full disk ------------------------------------------------------------------------------

def test_a_full_disk_while_saving_keeps_both_checkpoints_and_names_the_file(tmp_path, monkeypatch):
    """The new checkpoint is written in full before the old one is kept as previous: a write
    that does not fit (torch.save's error hides the ENOSPC in its chain) leaves checkpoint.pth
    and checkpoint-prev.pth as they were, no temporary file, and one ResourceError."""
    ckpt.save_checkpoint(str(tmp_path), state(0))
    ckpt.save_checkpoint(str(tmp_path), state(1))
    real_fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: FillingFile(real_fdopen(fd, *a, **k), room=100))
    error = error_of(ckpt.save_checkpoint, str(tmp_path), state(2))
    monkeypatch.setattr(os, "fdopen", real_fdopen)
    assert isinstance(error, ResourceError) and str(error) == (
        f"disk full: could not write {tmp_path / ckpt.CHECKPOINT} (No space left on device); free space on that disk")
    assert sorted(os.listdir(tmp_path)) == [ckpt.PREVIOUS_CHECKPOINT, ckpt.CHECKPOINT]
    assert epoch_of(tmp_path / ckpt.CHECKPOINT) == 1 and epoch_of(tmp_path / ckpt.PREVIOUS_CHECKPOINT) == 0

    # Without hard links the previous checkpoint is a copy, which may be what does not fit.
    def copy_that_does_not_fit(src, dst):
        with open(dst, "wb") as f:
            f.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    def no_hard_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_hard_links)
    monkeypatch.setattr(shutil, "copyfile", copy_that_does_not_fit)
    error = error_of(ckpt.save_checkpoint, str(tmp_path), state(2))
    assert isinstance(error, ResourceError) and str(error).startswith(
        f"disk full: could not write {tmp_path / ckpt.PREVIOUS_CHECKPOINT} (No space left on device)"), error
    assert sorted(os.listdir(tmp_path)) == [ckpt.PREVIOUS_CHECKPOINT, ckpt.CHECKPOINT]
    assert epoch_of(tmp_path / ckpt.CHECKPOINT) == 1 and epoch_of(tmp_path / ckpt.PREVIOUS_CHECKPOINT) == 0


def test_train_log_on_a_full_disk_stops_copying_with_one_warning(tmp_path, capsys):
    from multi_train_utils.files import RunLog

    log, failure = RunLog(), None
    try:
        log.attach(str(tmp_path / "train.log"))
        print("before")
        log.file = FillingFile(log.file, room=0)  # the disk is full from now on
        print("after")
        print("and later")
    except OSError as e:
        failure = e
    finally:
        log.close()
    out, err = capsys.readouterr()
    assert failure is None
    assert out == "before\nafter\nand later\n"  # the terminal gets everything
    assert err == (f"warning: {tmp_path / 'train.log'}: cannot write (No space left on device); no longer copying "
                   "the output there\n")
    assert (tmp_path / "train.log").read_text() == "before\n"


def test_a_full_disk_in_training_is_one_line_naming_the_intact_checkpoint(tiny_data, tmp_path):
    """End to end: the checkpoint of epoch 1 does not fit. One line, exit 2, the checkpoint of
    epoch 0 intact and named, no temporary file left."""
    out = tmp_path / "out"
    fill_disk_at_epoch_1 = (
        "import errno, runpy, sys, torch\n"
        "real_save = torch.save\n"
        "class Full:\n"
        "    def __init__(self, f): self.f = f\n"
        "    def write(self, data): raise OSError(errno.ENOSPC, 'No space left on device')\n"
        "    def flush(self): self.f.flush()\n"
        "def save(obj, f, *args, **kwargs):\n"
        "    full = isinstance(obj, dict) and obj.get('epoch') == 1 and 'optimizer' in obj\n"
        "    return real_save(obj, Full(f) if full else f, *args, **kwargs)\n"
        "torch.save = save\n"
        f"sys.argv = [{script('train_single.py')!r}] + sys.argv[1:]\n"
        f"runpy.run_path({script('train_single.py')!r}, run_name='__main__')\n")
    result = run([PYTHON, "-c", fill_disk_at_epoch_1, *train_args(tiny_data, out, "--epochs", "3", "--workers", "0",
                                                                  "--model", "squeezenet1_1")])  # small files
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: disk full: could not write {out / 'checkpoint.pth'} (No space left on device); free space on that "
        f"disk; {out / 'checkpoint.pth'} (epoch 0) is intact: continue from it with --resume auto")
    assert not [name for name in os.listdir(out) if name.endswith(".tmp")]
    assert epoch_of(out / "checkpoint.pth") == 0
    assert "model-0.pth" in os.listdir(out) and "model-1.pth" not in os.listdir(out)


# --- Exhausted memory -------------------------------------------------------------------------

def test_exhausted_memory_is_one_line_suggesting_smaller_batches_or_images(capsys):
    advice = "use a smaller --batch-size or --img-size"
    worker = RuntimeError("Caught RuntimeError in DataLoader worker process 0.\nOriginal Traceback (most recent call "
                          f"last):\n  File \"x.py\", line 1, in f\nRuntimeError: {CPU_OUT_OF_MEMORY}\n")
    cuda = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity "
                                       "of 139.81 GiB of which 1.00 GiB is free.")
    assert cli_result(raising(RuntimeError(CPU_OUT_OF_MEMORY)), capsys) == (
        2, f"error: out of memory: could not allocate a block of 30.0 GB; {advice}\n")
    assert cli_result(raising(worker), capsys) == (2, f"error: out of memory: could not allocate a block of 30.0 GB; "
                                                      f"{advice}\n")
    assert cli_result(raising(cuda), capsys) == (2, f"error: out of memory: could not allocate a block of 20.00 GiB; "
                                                    f"{advice}\n")
    # A full disk met outside the atomic writer (TensorBoard, a user's own code)
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/runs/events.out")
        except OSError:
            raise RuntimeError("write failed")
    except RuntimeError as e:
        chained = e
    assert cli_result(raising(chained), capsys) == (
        2, "error: disk full: could not write /runs/events.out (No space left on device); free space on that disk\n")
    # The raw errors themselves, not RuntimeErrors: Python's MemoryError, an OSError of a full
    # disk or a quota met by a writer of ours or of a library's
    assert cli_result(raising(MemoryError()), capsys) == (
        2, f"error: out of memory: could not allocate a block; {advice}\n")
    assert cli_result(raising(OSError(errno.ENOSPC, "No space left on device", "/runs/a.png")), capsys) == (
        2, "error: disk full: could not write /runs/a.png (No space left on device); free space on that disk\n")
    assert cli_result(raising(OSError(errno.EDQUOT, "Disk quota exceeded", "/runs/b.csv")), capsys) == (
        2, "error: disk full: could not write /runs/b.csv (Disk quota exceeded); free space on that disk\n")
    code, _ = cli_result(raising(RuntimeError("a bug")), capsys)
    assert code == "escaped: RuntimeError: a bug"  # other errors are not dressed up as these


def test_run_cli_frees_the_run_in_reference_cycles_and_in_its_handled_error_before_the_exit(capsys):
    """What a run leaves in a reference cycle, or in the traceback of the error run_cli
    handled (a stop after a notice's save, bad input), is freed before run_cli returns or
    exits: a DDP model torn down by the interpreter's exit takes gloo down with it now and then
    (SIGABRT, "terminate called without an active exception")."""
    import gc
    import weakref

    from multi_train_utils.errors import Preempted

    class Model:
        pass

    left = []

    def built(argv):
        model = Model()
        model.itself = model  # a cycle: refcounting alone never frees it
        left.append(weakref.ref(model))
        return model

    def finishes(argv):
        built(argv)

    def stops(argv):
        model = built(argv)  # noqa: F841 - in the frame that the error's traceback holds
        raise Preempted("stopped and saved")

    def refuses(argv):
        model = built(argv)  # noqa: F841
        raise UserError("--data-path x: no such folder")

    codes, alive = [], []
    gc.disable()  # the collector never runs by itself here
    try:
        for main in (finishes, stops, refuses):
            codes.append(cli_result(main, capsys)[0])
            alive.append(left[-1]() is not None)  # before the next run_cli, which collects too
    finally:
        gc.enable()
    assert codes == [0, 75, 2]
    assert alive == [False, False, False]


def test_an_error_ends_the_loader_workers_before_its_traceback_frees_the_loader(capsys, monkeypatch):
    """A rank whose loader gave up on a worker (or that failed otherwise with its loader's
    iterator in the error's traceback) ends its workers before the traceback is freed: freeing
    it shuts the loader down, which joins each live worker for 5 s (a hung one included) while
    the other ranks wait in a collective. Seen from the shut-down: no worker is alive by then.
    The line names the rank, also one that is not its node's first (rank 3, local rank 1)."""
    from torch.utils.data import dataloader

    from multi_train_utils.errors import reset_in_worker

    alive_at_shutdown = []
    shutdown = dataloader._MultiProcessingDataLoaderIter._shutdown_workers

    def recorded(self):
        if not alive_at_shutdown:
            alive_at_shutdown.append([w.is_alive() for w in self._workers])
        shutdown(self)

    monkeypatch.setattr(dataloader._MultiProcessingDataLoaderIter, "_shutdown_workers", recorded)

    def fails_with_a_worker_running(argv):
        loader = torch.utils.data.DataLoader(list(range(64)), batch_size=2, num_workers=1,
                                             worker_init_fn=reset_in_worker)
        batches = iter(loader)  # noqa: F841 - in the frame that the error's traceback holds
        next(batches)
        raise RuntimeError("DataLoader timed out after 5 seconds")  # torch's words for a worker that hangs

    for name, value in dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1").items():
        monkeypatch.setenv(name, value)
    code, err = cli_result(fails_with_a_worker_running, capsys)
    assert code == 1 and err.startswith("[rank 3] error: a data loader's worker ") and \
        "gave no batch in 5 s: it hangs" in err, (code, err)
    assert alive_at_shutdown == [[False]]


def test_a_fault_in_the_middle_of_a_run_says_which_checkpoint_is_intact(tmp_path):
    from conftest import run_recorder

    from multi_train_utils.single_label import EvalResult

    args = full_flags(output_dir=str(tmp_path), log_dir=str(tmp_path / "tb"), patience=0,
                              best_metric="accuracy")
    resumed = run_recorder(args, full_flags(classes=["a", "b"]), enabled=False, checkpoint=state(3),
                          resume_path=str(tmp_path / "checkpoint.pth"))
    with pytest.raises(ResourceError) as raised:
        with resumed.explain_faults():
            raise RuntimeError(CPU_OUT_OF_MEMORY)
    assert str(raised.value) == (f"out of memory: could not allocate a block of 30.0 GB; use a smaller --batch-size "
                                 f"or --img-size; {tmp_path / 'checkpoint.pth'} (epoch 3) is intact: continue from it "
                                 "with --resume auto")
    fresh = run_recorder(args, full_flags(classes=["a", "b"]), enabled=False)
    with pytest.raises(ResourceError, match=r"free space on that disk; no checkpoint was written yet$"):
        with fresh.explain_faults():
            raise ResourceError("disk full: could not write x (No space left on device); free space on that disk")
    fresh.end_epoch(0, None, EvalResult(torch.eye(2, dtype=torch.int64)))  # rank != 0
    with pytest.raises(ResourceError, match=r"\(epoch 0\) is intact: continue from it with --resume auto$"):
        with fresh.explain_faults():
            raise RuntimeError(CPU_OUT_OF_MEMORY)
    with pytest.raises(ValueError, match="^a bug$"):
        with fresh.explain_faults():
            raise ValueError("a bug")
    # resumed from a checkpoint of another folder: nothing of this run's folder is intact yet
    elsewhere = tmp_path / "elsewhere" / "checkpoint.pth"
    moved = run_recorder(args, full_flags(classes=["a", "b"]), enabled=False, checkpoint=state(3),
                        resume_path=str(elsewhere))
    with pytest.raises(ResourceError) as raised:
        with moved.explain_faults():
            raise ResourceError("disk full: could not write x (No space left on device); free space on that disk")
    assert str(raised.value).endswith("free space on that disk; no checkpoint was written yet")


# --- Flags ------------------------------------------------------------------------------------

def entry_parsers():
    import benchmark
    import export
    import predict
    from multi_train_utils.options import get_args_parser

    return {"train_single": get_args_parser(False), "train_multi_gpu": get_args_parser(True),
            "predict": predict.get_args_parser(), "export": export.get_args_parser(),
            "benchmark": benchmark.get_args_parser()}


def test_every_float_flag_refuses_nan_and_inf_before_anything_starts(capsys):
    from multi_train_utils.options import finite_float, get_args_parser, parse_args

    def reads_floats(action):  # finite_float itself, or a range check of finite_float (options.in_range)
        return action.type is finite_float or getattr(action.type, "__name__", None) == "finite_float"

    float_flags = {name: sorted(a.option_strings[0] for a in parser._actions if reads_floats(a))
                   for name, parser in entry_parsers().items()}
    assert not [a for p in entry_parsers().values() for a in p._actions if a.type is float], float_flags
    assert float_flags["train_single"] == ["--checkpoint-every", "--clip-grad", "--cutmix-alpha", "--hflip",
                                           "--label-smoothing", "--lr", "--lr-gamma", "--lrf", "--mixup-alpha",
                                           "--model-ema-decay", "--momentum", "--random-erase", "--target-accuracy",
                                           "--val-rate", "--weight-decay"]
    assert float_flags["train_multi_gpu"] == float_flags["train_single"]
    parser = get_args_parser(distributed=True)
    for flag in float_flags["train_single"]:
        for value in ("nan", "inf", "-inf", "1e999"):
            with pytest.raises((SystemExit, UserError)) as exited:  # UserError: a range check saw the value
                parse_args(parser, [f"{flag}={value}"])
            assert exited.type is SystemExit and exited.value.code == 2, (flag, value, exited.value)
            assert capsys.readouterr().err == f"error: argument {flag}: {value!r} is not a finite number (see --help)\n"
    with pytest.raises(UserError, match=r"^--momentum 1.0: must be below 1"):
        parse_args(parser, ["--momentum", "1"])
    assert parse_args(parser, ["--lr", "1e-3", "--clip-grad", "2"]).lr == 0.001


# --- Image sizes and batches a model cannot take ---------------------------------------------

def spec(name="resnet18", img_size=32, num_classes=5):
    from model import create_model
    from multi_train_utils.model_setup import ModelSpec

    return ModelSpec(create_model, name, num_classes, img_size)


def build(name="resnet18", img_size=32, batch_size=2, eval_only=False, sync_bn=False):
    """build_model as the entry scripts call it, without weights."""
    from multi_train_utils.model_setup import build_model

    return build_model(spec(name, img_size), eval_only=eval_only, batch_size=batch_size, sync_bn=sync_bn)


def test_an_image_size_the_model_cannot_take_is_refused_naming_the_size(tmp_path):
    from model import create_model
    from multi_train_utils.model_setup import check_input_size
    from multi_train_utils.options import make_task
    from multi_train_utils.run_files import load_trained_model

    with pytest.raises(UserError, match=r"^--img-size 96: vit_b_16 takes only 224 px images; use --img-size 224$"):
        build("vit_b_16", img_size=96)
    with pytest.raises(UserError, match=r"^--img-size 32: alexnet cannot take 32 px images \(.*too small\); use "
                                        r"--img-size 224 \(the size of its pretrained weights\)$"):
        build("alexnet", eval_only=True)
    with pytest.raises(UserError, match=r"^--img-size 32: inception_v3 cannot take .* use --img-size 299 "):
        check_input_size(spec("inception_v3", 32))
    check_input_size(spec("vit_b_16", 224))
    check_input_size(spec("resnet18", 32))
    # predict.py and export.py: the size given (or in args.json) is checked before the weights are read
    (tmp_path / "args.json").write_text(json.dumps({"model": "vit_b_16", "img_size": 96}))
    (tmp_path / "class_indices.json").write_text(json.dumps({"0": "a", "1": "b"}))
    (tmp_path / "model-best.pth").write_bytes(b"not read")
    with pytest.raises(UserError, match=r"^--img-size 96: vit_b_16 takes only 224 px images"):
        load_trained_model(full_flags(weights=str(tmp_path / "model-best.pth"), model=None, img_size=None,
                                      class_indices=None), create_model, make_task)


def test_a_batch_norm_batch_of_one_value_is_refused_exactly_where_torch_would_fail(monkeypatch):
    from model import create_model
    from multi_train_utils import model_setup
    from multi_train_utils.model_setup import check_input_size

    def trains(img_size):  # what torch itself says, on real tensors
        try:
            create_model("resnet18", 2).train()(torch.rand(1, 3, img_size, img_size))
            return True
        except ValueError:
            return False

    assert not trains(32) and trains(64)
    with pytest.raises(UserError, match=r"^--batch-size 1 at --img-size 32: in training, resnet18's normalisation "
                                        r"layers would see a single value per channel .*use --batch-size 2 or more, "
                                        r"or a larger --img-size$"):
        build(batch_size=1)
    check_input_size(spec("resnet18", 64), 1, training=True)
    check_input_size(spec("resnet18", 32), 1, training=False)  # evaluation: running statistics
    check_input_size(spec("resnet18", 32), 1, training=True, freeze_layers=True)  # frozen BatchNorm: eval mode
    # SyncBatchNorm over 2 processes sees 2 values
    monkeypatch.setattr(model_setup, "get_world_size", lambda: 2)
    monkeypatch.setattr(model_setup, "use_sync_bn", lambda requested, *args, **kwargs: requested)
    build(batch_size=1, sync_bn=True)
    with pytest.raises(UserError, match=r"^--batch-size 1 at --img-size 32"):
        build(batch_size=1, sync_bn=False)  # 2 processes without SyncBatchNorm: each BatchNorm sees 1


def test_a_batch_of_one_at_32_px_stops_before_anything_is_written(tiny_data, tmp_path):
    out = tmp_path / "out"
    result = run([PYTHON, script("train_single.py"), *train_args(tiny_data, out, "--batch-size", "1",
                                                                  "--workers", "0")])
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: --batch-size 1 at --img-size 32: in training, "
                                                              f"{MODEL}'s normalisation layers would see")
    assert not out.exists() and not (tmp_path / "out-tb").exists()


# --- Run files whose fields are of the wrong kind -------------------------------------------

def test_args_json_with_a_field_of_the_wrong_kind_is_named(tmp_path):
    from multi_train_utils.options import get_args_parser, parse_args
    from multi_train_utils.run_files import read_run_args, read_run_settings

    weights = tmp_path / "model-best.pth"
    weights.write_bytes(b"x")
    (tmp_path / "class_indices.json").write_text(json.dumps({"0": "a", "1": "b"}))
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps({"model": "resnet18", "img_size": "big"}))
    assert str(error_of(read_run_settings, str(weights))) == (
        f"{args_file}: its \"img_size\" is 'big' (str), not a whole number; give --model and --img-size")
    args_file.write_text(json.dumps({"model": "resnet18", "img_size": [224]}))
    error = error_of(parse_args, get_args_parser(False), ["--eval-only", "--weights", str(weights)])
    assert str(error).startswith(f"{args_file}: its \"img_size\" is [224] (list), not a whole number; fix "), error
    for values, field in (({"model": 5}, "model"), ({"img_size": True}, "img_size"), ({"seed": 1.5}, "seed"),
                          ({"val_rate": "0.2"}, "val_rate"), ({"data_path": ["a"]}, "data_path")):
        args_file.write_text(json.dumps(values))
        error = error_of(read_run_args, str(tmp_path))
        assert isinstance(error, UserError) and str(error).startswith(f'{args_file}: its "{field}" is '), error
    args_file.write_text(json.dumps(["resnet18", 224]))
    error = error_of(read_run_args, str(tmp_path))
    assert str(error).startswith(f"{args_file}: holds a list, not the flags of a run"), error
    args_file.write_text(json.dumps({"model": "resnet18", "img_size": 224, "val_rate": 0.2, "data_path": None}))
    assert read_run_args(str(tmp_path))["img_size"] == 224


def test_class_indices_json_must_name_every_class_with_a_string(tmp_path):
    from multi_train_utils.run_files import read_class_indices

    path = tmp_path / "class_indices.json"
    cases = [({"0": "daisy", "1": 5}, f"{path}: its \"1\" is 5 (int), not a string; class names are strings"),
             ({"0": "daisy", "1": ["roses"]}, f"{path}: its \"1\" is ['roses'] (list), not a string"),
             (["daisy", "roses"], f"{path}: holds ['daisy', 'roses'], not a class index file"),
             ({}, f"{path}: holds {{}}, not a class index file"),
             ({"0": "daisy", "2": "roses"}, f"{path}: has no class \"1\": its keys must run from \"0\" to \"1\"")]
    for mapping, message in cases:
        path.write_text(json.dumps(mapping))
        error = error_of(read_class_indices, str(path))
        assert isinstance(error, UserError) and str(error).startswith(message), (mapping, error)
    path.write_text(json.dumps({"1": "roses", "0": "daisy"}))
    assert read_class_indices(str(path)) == ["daisy", "roses"]


def test_a_checkpoint_with_a_field_of_the_wrong_kind_is_named_and_resume_auto_falls_back(tmp_path, capsys):
    path = tmp_path / "checkpoint.pth"
    for field, value, kind in (("epoch", "abc", "a whole number"), ("classes", [1, 2], "a list of strings"),
                               ("model", {"w": [1.0]}, "a dict of parameter names to tensors"),
                               ("optimizer", [], "a dict"), ("args", "resnet18", "a dict"),
                               ("metrics", "epoch,loss", "a list of rows"), ("rng", [], "a dict")):
        torch.save(dict(state(1), **{field: value}), path)
        error = error_of(ckpt.load_checkpoint, str(path))
        assert isinstance(error, UserError) and str(error).startswith(
            f"--resume {path}: its \"{field}\" is {value!r} ({type(value).__name__}), not {kind}; "), (field, error)
    run_dir = tmp_path / "run"
    ckpt.save_checkpoint(str(run_dir), state(4))
    ckpt.save_checkpoint(str(run_dir), dict(state(5), epoch="abc"))  # wrong: resume auto takes the one before
    found, checkpoint = ckpt.find_resume_checkpoint("auto", str(run_dir))
    assert found.endswith(ckpt.PREVIOUS_CHECKPOINT) and checkpoint["epoch"] == 4
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    error = error_of(ckpt.restore_training_state, ckpt.TrainState(None, optimizer),
                     dict(state(1), optimizer=optimizer.state_dict(), rng={"torch": "seed"}))
    assert str(error).startswith("--resume: the checkpoint's random generator states cannot be restored"), error


@pytest.mark.parametrize("error, line", [
    (RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file data/3: "
                  "No space left on device"),
     "disk full: could not write a file (No space left on device); free space on that disk"),
    (OSError(122, "Disk quota exceeded", "/runs/x/checkpoint.pth"),
     "disk full: could not write /runs/x/checkpoint.pth (Disk quota exceeded); free space on that disk"),
    (RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.10 GiB total capacity)"),
     "out of memory: could not allocate a block of 20.00 GiB; use a smaller --batch-size or --img-size"),
    (MemoryError(), "out of memory: could not allocate a block; use a smaller --batch-size or --img-size"),
])
def test_a_full_disk_or_exhausted_memory_is_named_whatever_raised_it(error, line):
    from multi_train_utils.errors import resource_error

    found = resource_error(error)
    assert found is not None and str(found).startswith(line), found
    assert resource_error(ValueError("a bug")) is None and resource_error(OSError(2, "No such file")) is None


def test_each_run_logs_to_a_tensorboard_folder_of_its_own(tmp_path):
    """A new sub-folder of --log-dir per run: the output folder's name, the start time and the
    process, so that runs into folders of the same name, or one after another, never mix."""
    import re

    from conftest import run_recorder

    args = full_flags(output_dir=str(tmp_path / "a" / "exp"), log_dir=str(tmp_path / "tb"), patience=0,
                              best_metric="accuracy")
    log_dir = run_recorder(args, full_flags(classes=["a", "b"]), enabled=False).log_dir
    assert re.fullmatch(re.escape(str(tmp_path / "tb" / "exp")) + rf"-\d{{8}}-\d{{6}}-{os.getpid()}", log_dir), log_dir
