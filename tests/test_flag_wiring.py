"""Each flag's value reaches what it sets, on the parsers of both scripts: a non-default value,
read back from the object the scripts build from the flags (the optimizer, the schedule, the
EMA, the mixer, the transforms, the loop's settings, the memory format). A flag whose value
were dropped, swapped with another's or replaced by its default fails here. In-process."""
import math

import pytest
import torch
from torch import nn
from torchvision.transforms import v2

from conftest import SCRIPTS, parse_flags
from model import create_lr_scheduler, create_optimizer
from multi_train_utils.model_setup import make_model_ema
from multi_train_utils.images import build_transforms
from multi_train_utils.errors import UserError
from multi_train_utils.loaders import make_batch_mixer
from multi_train_utils.options import config_of, get_args_parser, parse_args
from multi_train_utils.model_setup import optimize_model
from multi_train_utils.train_eval_utils import LoopSettings
from my_dataset import augment_settings


@pytest.fixture(params=SCRIPTS.values(), ids=SCRIPTS.keys())
def parse(request):
    distributed = request.param
    return lambda *flags: parse_flags(distributed, "--data-path", "d", *flags)


def small_net():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))


def test_momentum_and_weight_decay_reach_sgd(parse):
    optimizer = create_optimizer(small_net(), parse("--momentum", "0.5", "--weight-decay", "0.0123", "--lr", "0.07"))
    assert isinstance(optimizer, torch.optim.SGD)
    assert {(g["momentum"], g["weight_decay"], g["lr"]) for g in optimizer.param_groups} == {(0.5, 0.0123, 0.07)}


@pytest.mark.parametrize("warmup", [0, 1])
def test_the_cosine_ends_at_lr_times_lrf_with_or_without_warm_up(parse, warmup):
    args = parse("--epochs", "3", "--lrf", "0.3", "--lr", "0.5", "--warmup-epochs", str(warmup))
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=args.lr)
    scheduler = create_lr_scheduler(optimizer, args, batches_per_epoch=5)
    rates = []
    for _ in range(15):  # 3 epochs of 5 steps
        optimizer.step()
        scheduler.step()
        rates.append(optimizer.param_groups[0]["lr"])
    assert rates[-1] == pytest.approx(0.5 * 0.3)  # the end of the last epoch
    middle = 5 * warmup + (15 - 5 * warmup) // 2  # half way through the cosine: lr (1 + lrf) / 2
    if (15 - 5 * warmup) % 2 == 0:
        assert rates[middle - 1] == pytest.approx(0.5 * (1 + 0.3) / 2)
    assert min(rates) == pytest.approx(0.15)


def test_the_step_schedule_takes_step_size_and_gamma(parse):
    args = parse("--epochs", "4", "--lr-scheduler", "step", "--lr-step-size", "2", "--lr-gamma", "0.25", "--lr", "1")
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=args.lr)
    scheduler = create_lr_scheduler(optimizer, args, batches_per_epoch=3)
    rates = [optimizer.param_groups[0]["lr"]]
    for _ in range(11):
        optimizer.step()
        scheduler.step()
        rates.append(optimizer.param_groups[0]["lr"])
    assert rates == pytest.approx([1] * 6 + [0.25] * 6)


def test_the_ema_takes_its_decay_once_the_warm_up_is_past(parse):
    ema = make_model_ema(small_net(), parse("--model-ema", "--model-ema-decay", "0.97"))
    assert ema.decay == 0.97
    ema.updates = 1000  # (1 + n) / (10 + n) = 0.991 > 0.97
    assert ema.current_decay() == 0.97
    assert make_model_ema(small_net(), parse("--model-ema-decay", "0.97")) is None  # without --model-ema


@pytest.mark.parametrize("mixup, cutmix, kinds", [("0.3", "0", {v2.MixUp: 0.3}), ("0", "0.7", {v2.CutMix: 0.7}),
                                                  ("0.3", "0.7", {v2.MixUp: 0.3, v2.CutMix: 0.7})])
def test_mixup_and_cutmix_take_their_own_alphas(parse, mixup, cutmix, kinds):
    mixer = make_batch_mixer(parse("--mixup-alpha", mixup, "--cutmix-alpha", cutmix, "--seed", "5"), 4, rank=1)
    chosen = mixer.mix.transforms if isinstance(mixer.mix, v2.RandomChoice) else [mixer.mix]
    assert {type(t): t.alpha for t in chosen} == kinds
    assert all(t.num_classes == 4 for t in chosen) and (mixer.seed, mixer.rank) == (5, 1)


def test_random_erase_and_auto_augment_take_their_values(parse):
    train, _ = build_transforms(32, **augment_settings(parse("--random-erase", "0.3", "--auto-augment", "ta_wide")))
    steps = train.transforms
    erasing = [t for t in steps if isinstance(t, v2.RandomErasing)]
    assert len(erasing) == 1 and erasing[0].p == 0.3 and steps[-1] is erasing[0]
    assert sum(isinstance(t, v2.TrivialAugmentWide) for t in steps) == 1
    train, _ = build_transforms(32, **augment_settings(parse()))
    assert not any(isinstance(t, (v2.RandomErasing, v2.TrivialAugmentWide)) for t in train.transforms)


def test_the_loop_takes_accumulation_clipping_and_print_frequency(parse):
    args = parse("--accum-steps", "3", "--clip-grad", "0.5", "--print-freq", "7")
    settings = LoopSettings.from_config(config_of(args), "bf16", True)
    assert (settings.accum_steps, settings.clip_grad, settings.print_freq) == (3, 0.5, 7)
    assert (settings.precision, settings.channels_last) == ("bf16", True)


@pytest.mark.parametrize("flag, expected", [((), True), (("--no-channels-last",), False), (("--channels-last",), True)])
def test_no_channels_last_turns_it_off_for_a_convolutional_net(parse, flag, expected):
    model, channels_last = optimize_model(small_net(), parse(*flag), torch.device("cpu"))
    assert channels_last is expected
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last) is expected


def test_demo_sets_its_rate_unless_lr_is_given(parse):
    assert parse("--demo").lr == 0.01
    assert parse("--demo", "--lr", "0.002").lr == 0.002
    assert parse().lr == 0.001
    assert math.isclose(parse("--lr", "0.002").lr, 0.002)


# --- predict.py -----------------------------------------------------------------------------------------
def test_predict_batch_size_changes_nothing_but_the_batches_and_overwrite_replaces_the_csv(single_run, tiny_data,
                                                                                            tmp_path, capsys):
    """The 7 validation images in batches of 2 (the last one short) and in one batch: the same
    rows, each image's own; --overwrite replaces the CSV it wrote before."""
    import csv

    import predict

    weights = f"{single_run['out']}/model-best.pth"
    out = tmp_path / "predictions.csv"
    common = ["--weights", weights, "--image", tiny_data["val"], "--output", str(out), "--workers", "0"]
    predict.main(common + ["--batch-size", "2"])
    with open(out, newline="") as f:
        small = list(csv.reader(f))
    out.write_text("mine")
    with pytest.raises(Exception) as refused:
        predict.main(common + ["--batch-size", "32"])
    assert "--overwrite" in str(refused.value) and out.read_text() == "mine"
    predict.main(common + ["--batch-size", "32", "--overwrite"])
    with open(out, newline="") as f:
        large = list(csv.reader(f))
    assert len(small) == 8 and [row[:3] for row in small] == [row[:3] for row in large]
    for a, b in zip(small[1:], large[1:]):
        assert [float(x) for x in a[3:]] == pytest.approx([float(x) for x in b[3:]], abs=2e-6)
    capsys.readouterr()


def test_the_process_group_gets_the_backend_of_the_device_and_the_dist_flags(monkeypatch):
    """NCCL for a CUDA device, gloo otherwise (a CPU run on a machine with GPUs included);
    --dist-backend, --dist-url and --dist-timeout reach init_process_group. Mocked group."""
    from datetime import timedelta

    from multi_train_utils import distributed_utils
    from multi_train_utils.distributed_utils import DistEnv, init_distributed_mode

    calls = []
    monkeypatch.setattr(distributed_utils, "_JOB", None)  # restored after the test: the job this sets
    monkeypatch.setattr(distributed_utils.dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(distributed_utils.dist, "is_backend_available", lambda backend: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    parser = get_args_parser(True)
    env = DistEnv(rank=1, world_size=2, local_rank=1, local_world_size=2, launcher="torchrun")
    store = object()

    def backend_of(*args):
        try:
            return init_distributed_mode(*args)
        except UserError as e:
            return f"refused: {e}"

    assert backend_of(parse_args(parser, ["--data-path", "d"]), env, torch.device("cpu"), store) == "gloo"
    assert init_distributed_mode(parse_args(parser, ["--data-path", "d", "--dist-timeout", "77"]), env,
                                 torch.device("cuda", 1), store) == "nccl"
    args = parse_args(parser, ["--data-path", "d", "--dist-backend", "gloo", "--dist-url", "tcp://10.0.0.1:23456"])
    assert init_distributed_mode(args, env, torch.device("cuda", 1), None) == "gloo"
    assert [(c["backend"], c["device_id"], c["rank"], c["world_size"]) for c in calls] == [
        ("gloo", None, 1, 2), ("nccl", torch.device("cuda", 1), 1, 2), ("gloo", None, 1, 2)]
    assert (calls[0]["store"], calls[0]["init_method"]) == (store, None)
    assert (calls[2]["store"], calls[2]["init_method"]) == (None, "tcp://10.0.0.1:23456")
    assert calls[1]["timeout"] == timedelta(seconds=77)
    assert init_distributed_mode(args, DistEnv(), torch.device("cpu"), None) is None and len(calls) == 3


# --- export.py ------------------------------------------------------------------------------------------
def test_export_records_the_flags_it_was_given_over_the_runs_files(single_run, tmp_path, capsys):
    """--class-indices, --img-size and --val-resize-size given to export.py are what the .pt2's
    run.json holds (the run's own files say otherwise); the model is the run's."""
    import json

    import export
    from conftest import MODEL
    from multi_train_utils.run_files import load_program

    names = ["A", "B", "C", "D", "E"]
    (tmp_path / "mine.json").write_text(json.dumps({str(i): n for i, n in enumerate(names)}))
    out = tmp_path / "m.pt2"
    export.main(["--weights", f"{single_run['out']}/model-best.pth", "--class-indices", str(tmp_path / "mine.json"),
                 "--img-size", "40", "--val-resize-size", "44", "--output", str(out)])
    model, run = load_program(str(out))
    assert (run["classes"], run["img_size"], run["val_resize_size"], run["model"]) == (names, 40, 44, MODEL)
    assert model(torch.zeros(2, 3, 40, 40)).shape == (2, 5)
    capsys.readouterr()
