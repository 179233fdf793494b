"""What a new user met, made right: --hflip, the best weights kept once, the disk a run holds,
the header of a resumed run, old checkpoints, and settings complete at the start.

All in this process: RunRecorder and the summaries on a tiny model, no training run."""
import os

import pytest
import torch

from conftest import full_flags, parse_flags
from multi_train_utils.options import config_of  # noqa: E402


def flips(transform):
    """The probabilities of the horizontal flips in a v2.Compose."""
    from torchvision.transforms import v2

    return [t.p for t in transform.transforms if isinstance(t, v2.RandomHorizontalFlip)]


def test_hflip_sets_the_chance_of_a_flip_and_zero_leaves_it_out():
    from multi_train_utils.datasets import image_file_datasets
    from multi_train_utils.images import build_transforms
    from my_dataset import augment_settings

    assert flips(build_transforms(32)[0]) == [0.5]  # the default
    assert flips(build_transforms(32, hflip=0.3)[0]) == [0.3]
    assert flips(build_transforms(32, hflip=0)[0]) == []
    split = full_flags(train_images_path=["a.png"], train_images_label=[0], val_images_path=["b.png"],
                       val_images_label=[1], classes=["a", "b"], skipped=[], skip_reasons={}, notes=[])
    for flag, expected in ((None, [0.5]), ("0", []), ("1", [1.0]), ("0.25", [0.25])):
        args = parse_flags(False, *(["--hflip", flag] if flag else []))
        assert flips(image_file_datasets(split, 32, augment_settings(args)).train.transform) == expected, flag
        assert flips(image_file_datasets(split, 32, augment_settings(args)).val.transform) == []


def recorder_at(tmp_path, *flags):
    from multi_train_utils.checkpoint import TrainState
    from multi_train_utils.model_setup import ModelEma
    from conftest import run_recorder

    out = tmp_path / "run"
    args = parse_flags(False, "--model", "resnet18", "--epochs", "4", "--no-plots", "--output-dir", str(out),
                       "--log-dir", str(tmp_path / "tb"), *flags)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ema = ModelEma(model, 0.5) if "--model-ema" in flags else None
    state = TrainState(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), ema=ema)
    return out, run_recorder(args, full_flags(classes=["cat", "dog"]), state, enabled=True, world_size=1)


def test_the_best_epochs_weights_are_kept_once_and_the_emas_in_a_file_of_their_own(tmp_path, capsys):
    from multi_train_utils.single_label import EvalResult
    from multi_train_utils.train_eval_utils import TrainStats

    out, recorder = recorder_at(tmp_path, "--model-ema", "--keep-last", "2")
    model, ema = recorder.state.model, recorder.state.ema
    good, mid = EvalResult(torch.tensor([[3, 0], [0, 3]])), EvalResult(torch.tensor([[3, 0], [1, 2]]))
    bad = EvalResult(torch.tensor([[1, 2], [2, 1]]))
    stats = TrainStats(1.0, 8, 1.0, 0.1, 8.0)
    with torch.no_grad():
        model.weight.fill_(1.0)
    recorder.end_epoch(0, stats, mid, bad)  # the model best: model-best.pth is model-0.pth
    assert os.path.samefile(out / "model-best.pth", out / "model-0.pth")
    assert os.stat(out / "model-0.pth").st_nlink == 2
    with torch.no_grad():
        model.weight.fill_(2.0)
        ema.module.weight.fill_(7.0)
    recorder.end_epoch(1, stats, bad, good)  # the EMA beats the best: a file of its own
    assert not os.path.samefile(out / "model-best.pth", out / "model-1.pth")
    best = torch.load(out / "model-best.pth", weights_only=True)
    assert torch.equal(best["weight"], torch.full((2, 2), 7.0))
    assert torch.equal(torch.load(out / "model-1.pth", weights_only=True)["weight"], torch.full((2, 2), 2.0))
    recorder.end_epoch(2, stats, good, bad)  # the model ties the best: not better, model-best stays the EMA's
    assert torch.equal(torch.load(out / "model-best.pth", weights_only=True)["weight"], torch.full((2, 2), 7.0))
    assert sorted(os.listdir(out)).count("model-0.pth") == 0  # --keep-last 2: epochs 1 and 2 kept
    recorder.close()
    capsys.readouterr()


def test_the_end_summary_says_what_the_runs_folder_holds_each_file_once(tmp_path, capsys):
    from multi_train_utils.checkpoint import BestEpoch, TrainState
    from multi_train_utils.recorder import print_end_summary

    out = tmp_path / "run"
    (out / "sub").mkdir(parents=True)
    (out / "model-3.pth").write_bytes(b"x" * 1_500_000)
    os.link(out / "model-3.pth", out / "model-best.pth")  # counted once
    (out / "metrics.csv").write_bytes(b"y" * 200_000)
    (out / "sub" / "a.png").write_bytes(b"z" * 1)
    args = parse_flags(False, "--output-dir", str(out))
    print_end_summary(args, TrainState(None, best=BestEpoch(0.5, 0.5, 3)), seconds=1.0)
    line = [line for line in capsys.readouterr().out.splitlines() if line.startswith("disk:")]
    assert line and line[0].startswith(f"disk: {out} holds 1.7 MB in 3 files "), line  # 1,700,001 bytes


def test_a_resumed_run_prints_the_schedule_as_the_first_did_then_where_it_resumes(tmp_path, capsys):
    from multi_train_utils.checkpoint import TrainState, complete_checkpoint
    from multi_train_utils.datasets import Datasets
    from multi_train_utils.model_setup import Precision
    from conftest import run_recorder
    from multi_train_utils.recorder import print_start_summary
    from multi_train_utils.train_eval_utils import LoopSettings
    from model import create_lr_scheduler

    out = tmp_path / "run"
    args = parse_flags(False, "--model", "resnet18", "--epochs", "3", "--lr", "0.001", "--no-plots", "--output-dir",
                       str(out), "--log-dir", str(tmp_path / "tb"), "--resume", "auto")
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    scheduler = create_lr_scheduler(optimizer, args, 4, start_epoch=2)  # resumed at epoch 2 of 3
    state = TrainState(model, optimizer, scheduler)
    data = Datasets([(torch.zeros(3, 2, 2), 0)] * 4, [(torch.zeros(3, 2, 2), 1)] * 2, ["a", "b"])
    checkpoint = complete_checkpoint({"epoch": 1, "model": model.state_dict(), "world_size": 1})
    recorder = run_recorder(args, data, state, checkpoint=checkpoint, resume_path=str(out / "checkpoint.pth"),
                           enabled=True, world_size=1)
    now = optimizer.param_groups[0]["lr"]
    assert now < 0.001  # the cosine has come down
    print_start_summary(config_of(args), data, state, LoopSettings(Precision("off", "cpu")), device=torch.device("cpu"),
                        workers=1, log_dir=recorder.log_dir, resumed=recorder.resume_lines)
    recorder.close()
    lines = capsys.readouterr().out.splitlines()
    assert "lr: 0.001; cosine to 0.0001 at epoch 2" in lines  # as the first run printed it
    resume = [i for i, line in enumerate(lines) if line.startswith("resuming from")]
    tensorboard = [i for i, line in enumerate(lines) if line.startswith("TensorBoard:")]
    assert resume and tensorboard and resume[0] > tensorboard[0]  # after the header's lines
    assert lines[resume[0]] == f"resuming from {out / 'checkpoint.pth'} (epoch 1 done): epochs 2 to 2, at lr {now:.3g}"
    assert "x 1 accumulation step x 1 process = 16 per optimizer step; 1 loader worker per process;" in \
        "\n".join(lines)


@pytest.mark.parametrize("world_size, trained", [(1, 60), (2, 48)])
def test_the_start_summary_says_the_augmentations_on_the_images_channels_and_normalising_and_what_an_epoch_leaves_out(
        world_size, trained, tmp_path, capsys, monkeypatch):
    """Issue 44's new user: --hflip 0 printed "crop+flip"; nothing said the channels, the mean and
    std, or that each process's last partial batch is left out. 70 training images at batch 12:
    floor(70 / 12) x 12 = 60 at world size 1; each of 2 processes 35, floor(35 / 12) x 12 x 2 = 48
    (with --accum-steps 2: a partial batch is left out, not a partial accumulation group).
    64 images at batch 16 are whole batches at both. "The others" are named as they are on:
    TrivialAugment, erasing and CutMix without MixUp."""
    from multi_train_utils import recorder
    from multi_train_utils.checkpoint import TrainState
    from multi_train_utils.datasets import Datasets
    from multi_train_utils.model_setup import Precision
    from multi_train_utils.recorder import print_start_summary
    from multi_train_utils.train_eval_utils import LoopSettings

    monkeypatch.setattr(recorder, "get_world_size", lambda: world_size)
    model = torch.nn.Linear(2, 2)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.01))
    gray = Datasets([(torch.zeros(1, 2, 2), 0)] * 70, [(torch.zeros(1, 2, 2), 1)] * 2, ["a", "b"], channels=1,
                    mean=(0.5,), std=(0.25,))
    whole = Datasets([(torch.zeros(3, 2, 2), 0)] * 64, [(torch.zeros(3, 2, 2), 1)] * 2, ["a", "b"], mean=None, std=None)
    printed = {}
    for name, data, flags in (("no flip", gray, ["--hflip", "0", "--batch-size", "12", "--accum-steps", "2"]),
                              ("default", whole, ["--batch-size", "16"]),
                              ("others", whole, ["--auto-augment", "ta_wide", "--random-erase", "0.25",
                                                 "--cutmix-alpha", "1"])):
        args = parse_flags(False, "--output-dir", str(tmp_path / "run"), *flags)
        print_start_summary(config_of(args), data, state, LoopSettings(Precision("off", "cpu")),
                            device=torch.device("cpu"))
        printed[name] = capsys.readouterr().out.splitlines()
    recipe = {name: next(line for line in lines if line.startswith("recipe: ")) for name, lines in printed.items()}
    assert "; augment crop; " in recipe["no flip"] and "flip" not in recipe["no flip"]
    assert "; augment crop + flip 0.5; " in recipe["default"]
    assert "; augment crop + flip 0.5 + ta_wide + erase 0.25 + cutmix 1; " in recipe["others"]
    assert "images: 1 channel, normalised by mean (0.5) and std (0.25)" in printed["no flip"]
    assert "images: 3 channels, pixel values in [0, 1], not normalised" in printed["default"]
    batch = {name: next(line for line in lines if line.startswith("batch: ")) for name, lines in printed.items()}
    assert batch["no flip"].endswith(f"; {trained} of 70 training images an epoch (each process's last partial "
                                     "batch is left out, other images each epoch)")
    assert "training images an epoch" not in batch["default"]  # 64 images in whole batches at 1 and 2 processes


def test_printed_lines_reach_a_file_in_the_order_printed_when_stdout_and_stderr_share_it(tmp_path, monkeypatch):
    """Issue 44's new user: written to a file (``> log 2>&1``), stdout is held back in blocks
    while stderr is not, so lines came out of order. Under run_cli, stdout goes out line by
    line: a stdout line, a stderr line and a progress bar's line reach the file in that order."""
    import io
    import sys

    from multi_train_utils.errors import run_cli

    path = tmp_path / "log.txt"
    with open(path, "wb", buffering=0) as raw:
        stdout = io.TextIOWrapper(io.BufferedWriter(raw, buffer_size=1 << 16), encoding="utf-8")  # as Python's for a file
        # stderr as Python makes it (3.9+: line-buffered, into a file too)
        stderr = io.TextIOWrapper(raw, encoding="utf-8", line_buffering=True, write_through=True)
        monkeypatch.setattr(sys, "stdout", stdout)
        monkeypatch.setattr(sys, "stderr", stderr)

        def main(argv):
            print("split: 36 train, 7 val images")
            print("warning: skipping a.png", file=sys.stderr)
            print("top1 accuracy: 1.000000 (7/7)")
            stdout.write("held back")  # not a whole line: it may wait
            assert path.read_text() == ("split: 36 train, 7 val images\nwarning: skipping a.png\n"
                                        "top1 accuracy: 1.000000 (7/7)\n")

        run_cli(main)
        stdout.flush()
    assert path.read_text().endswith("held back")


@pytest.mark.parametrize("resume", ["auto", "path"])
def test_a_resume_takes_the_runs_settings_unless_given_again_and_this_sessions_own(resume, tmp_path):
    """Issue 44's new user: `--data-path ... --resume auto` on a run started with --model
    resnet18 was refused. A resume (auto, or the checkpoint's path) takes every setting of the
    run's args.json that is not typed again; what is typed wins (--epochs 8); what belongs to
    this session is not taken (--workers, --threads, --print-freq, --device, --compile,
    --channels-last; under torchrun the launcher's). The data: the run's, with the README's
    short form (the same --data-path, typed relative) too; a typed --data-path, or --val-path
    alone, of other data leaves all of the run's out; a typed path that is not there is not
    the run's to name."""
    from multi_train_utils.run_files import write_run_settings

    data, other = tmp_path / "flowers", tmp_path / "other"
    for folder in (data, other):
        folder.mkdir()
    out = tmp_path / "run"
    first = parse_flags(False, "--data-path", str(data), "--val-path", str(other), "--model", "resnet18",
                        "--img-size", "64", "--mixup-alpha", "0.4", "--epochs", "5", "--seed", "7", "--lr", "0.03",
                        "--workers", "3", "--threads", "1", "--print-freq", "2", "--device", "cpu", "--output-dir",
                        str(out), "--log-dir", str(tmp_path / "tb"), "--checkpoint-every", "10", "--compile",
                        "--no-channels-last")
    write_run_settings(str(out), config_of(first).flags, ["a", "b"])
    where = ["--resume", "auto", "--output-dir", str(out)] if resume == "auto" else [
        "--resume", str(out / "checkpoint.pth")]
    for distributed in (False, True):
        args = parse_flags(distributed, *where, "--epochs", "8")
        taken = (args.data_path, args.val_path, args.model, args.img_size, args.mixup_alpha, args.seed, args.lr,
                 args.log_dir, args.checkpoint_every)
        assert taken == (str(data), str(other), "resnet18", 64, 0.4, 7, 0.03, str(tmp_path / "tb"), 10.0)
        assert args.epochs == 8  # typed again: this one
        fresh = parse_flags(distributed)
        for session in ("workers", "threads", "print_freq", "device", "compile", "channels_last", "scale_lr", "sync_bn",
                        "dist_timeout"):
            assert getattr(args, session) == getattr(fresh, session), session
    short = parse_flags(False, *where, "--data-path", os.path.relpath(data))  # the README's short form
    assert (short.data_path, short.val_path, short.model) == (os.path.relpath(data), str(other), "resnet18")
    typed = parse_flags(False, *where, "--data-path", str(other))  # other data: none of the run's
    assert (typed.data_path, typed.val_path, typed.model) == (str(other), None, "resnet18")
    from multi_train_utils.errors import UserError
    try:  # typed, not the run's: never named as from args.json
        gone = parse_flags(False, *where, "--data-path", str(data), "--val-path", str(tmp_path / "gone")).val_path
    except UserError as refused:
        gone = f"refused: {refused}"
    assert gone == str(tmp_path / "gone")
    third = tmp_path / "third"
    third.mkdir()
    val_only = parse_flags(False, *where, "--val-path", str(third))  # other validation data alone: not mixed either
    assert (val_only.data_path, val_only.val_path, val_only.model) == (parse_flags(False).data_path, str(third),
                                                                       "resnet18")
    demo = tmp_path / "demo-run"  # a --demo run of 5 epochs: its own --demo defaults do not undo what is taken
    write_run_settings(str(demo), config_of(parse_flags(False, "--demo", "--epochs", "5", "--data-path", str(data),
                                                         "--output-dir", str(demo))).flags, ["a", "b"])
    resumed_demo = parse_flags(False, "--resume", "auto", "--output-dir", str(demo))
    assert (resumed_demo.demo, resumed_demo.epochs, resumed_demo.data_path, resumed_demo.img_size) == (True, 5,
                                                                                                      str(data), 96)
    other.rmdir()  # the run's validation folder is gone: one line naming where the path came from
    with pytest.raises(UserError, match=rf"--val-path {other} \(from {out / 'args.json'}\) is not there any more; "
                                        "give --val-path"):
        parse_flags(False, *where)


def test_an_earlier_versions_checkpoint_loads_and_what_is_no_longer_read_is_left_out(tmp_path):
    from multi_train_utils.checkpoint import BestEpoch, load_checkpoint

    old = {"model": {"w": torch.zeros(1)}, "optimizer": {"state": {}, "param_groups": []}, "epoch": 4,
           "classes": ["a", "b"], "args": {"model": "resnet18"}, "best_accuracy": 0.75, "best_epoch": 2,
           "lr_scheduler": {"last_epoch": 19}}
    torch.save(old, tmp_path / "checkpoint.pth")
    read = load_checkpoint(str(tmp_path / "checkpoint.pth"))
    assert "lr_scheduler" not in read
    assert (read["best_value"], read["best_source"], read["world_size"], read["metrics"]) == (0.75, "model", None, [])
    best = BestEpoch.from_checkpoint(read)
    assert (best.value, best.accuracy, best.epoch, best.source, best.confusion) == (0.75, 0.75, 2, "model", None)


def test_a_setting_that_a_script_lacks_stops_it_at_the_start(monkeypatch):
    from multi_train_utils import options

    assert options.parse_args(options.get_args_parser(False), []).sync_bn is False  # the single script's value
    assert options.parse_args(options.get_args_parser(True), []).data_parallel is False
    lacking = {k: v for k, v in options.SINGLE_PROCESS_SETTINGS.items() if k != "sync_bn"}
    monkeypatch.setattr(options, "SINGLE_PROCESS_SETTINGS", lacking)
    with pytest.raises(RuntimeError, match=r"the flags lack the settings \['sync_bn'\]"):
        options.parse_args(options.get_args_parser(False), [])


def test_an_epoch_that_trains_every_image_or_more_says_nothing_of_images_left_out():
    """outputs.md: the batch line says how many training images an epoch trains only "where
    each process's last partial batch is left out": 5 images, batch 3, 2 processes train 6 a
    epoch (the sampler repeats one to give each process 3), so nothing is said; 7 at batch 3
    on 1 process train 6 of 7."""
    from multi_train_utils.recorder import images_left_out

    assert images_left_out(5, 3, 2) == "" and images_left_out(6, 3, 2) == "" and images_left_out(6, 3, 1) == ""
    assert images_left_out(7, 3, 1).startswith("; 6 of 7 training images an epoch")
