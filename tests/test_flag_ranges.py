"""Every flag's documented range (docs/flags.md and each flag's --help), on both scripts, the
DDP-only flags included: the value just outside the range is one line naming the flag and the
value ("--epochs 0: must be at least 1"), the value exactly at the edge is taken. In-process,
with the parsers of train_single.py and train_multi_gpu.py; test_bad_input.py checks that such
a line reaches the user with exit code 2."""
import pytest

from conftest import SCRIPTS, parse_flags
from multi_train_utils.errors import UserError
from multi_train_utils.options import get_args_parser

# flag: (values just outside its range, values at its edges or inside), as the docs give them
COMMON_RANGES = {
    "--epochs": (["0", "-1"], ["1"]),
    "--batch-size": (["0"], ["1"]),
    "--lr": (["0", "-0.1"], ["1e-9"]),
    "--img-size": (["0"], ["1"]),
    "--workers": (["-1"], ["0"]),
    "--hflip": (["-0.01", "1.01"], ["0", "1"]),
    "--random-erase": (["-0.01", "1.01"], ["0", "1"]),
    "--mixup-alpha": (["-0.01"], ["0"]),
    "--cutmix-alpha": (["-0.01"], ["0"]),
    "--label-smoothing": (["-0.01", "1"], ["0", "0.999"]),
    "--momentum": (["-0.01", "1"], ["0", "0.999"]),
    "--weight-decay": (["-0.01"], ["0"]),
    "--lrf": (["-0.01"], ["0"]),
    "--lr-step-size": (["0"], ["1"]),
    "--lr-gamma": (["0"], ["1e-9"]),
    "--warmup-epochs": (["-1"], ["0"]),
    "--model-ema-decay": (["0", "1"], ["1e-9", "0.999999"]),
    "--keep-last": (["-1"], ["0"]),
    "--patience": (["-1"], ["0"]),
    "--checkpoint-every": (["-0.5"], ["0", "0.5"]),
    "--target-accuracy": (["0", "1.01", "-0.2"], ["1", "0.75"]),
    "--accum-steps": (["0"], ["1"]),
    "--clip-grad": (["0", "-1"], ["1e-9"]),
    "--print-freq": (["0"], ["1"]),
    "--threads": (["0"], ["1"]),
}
DDP_RANGES = {
    "--dist-timeout": (["0"], ["1"]),
    "--spawn": (["-1"], ["0", "1"]),
}
# counts (the others are real numbers, printed as such: "--lr 0.0: must be positive")
WHOLE_NUMBERS = {"--epochs", "--batch-size", "--img-size", "--workers", "--lr-step-size", "--warmup-epochs",
                 "--keep-last", "--patience", "--accum-steps", "--print-freq", "--threads", "--dist-timeout", "--spawn"}


def parse(distributed, *flags):
    return parse_flags(distributed, "--data-path", "d", *flags)


def accepted(distributed, *flags):
    """The flags parsed; refusing them fails the test on an assertion that says why."""
    try:
        return parse(distributed, *flags)
    except UserError as e:
        raise AssertionError(f"{' '.join(flags)} refused: {e}") from None


def dest(flag):
    return flag[2:].replace("-", "_")


def cases(ranges):
    return [(flag, value, ok) for flag, (bad, good) in ranges.items()
            for value, ok in [(v, False) for v in bad] + [(v, True) for v in good]]


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("flag, value, ok", cases(COMMON_RANGES) + [(f, v, ok) for f, v, ok in cases(DDP_RANGES)])
def test_each_flag_refuses_the_value_just_outside_its_range_and_takes_its_edge(script, flag, value, ok):
    distributed = SCRIPTS[script]
    if flag in DDP_RANGES and not distributed:
        with pytest.raises(SystemExit) as e:  # train_single.py has no DDP flags at all
            parse(distributed, flag, value)
        assert e.value.code == 2
        return
    if ok:
        args = accepted(distributed, flag, value)
        assert getattr(args, dest(flag)) == (int(value) if flag in WHOLE_NUMBERS else float(value))
        return
    with pytest.raises(UserError) as e:
        parse(distributed, flag, value)
    message = str(e.value)
    shown = int(value) if flag in WHOLE_NUMBERS else float(value)
    assert message.startswith(f"{flag} {shown}: must "), message
    assert "\n" not in message


def test_the_tables_cover_every_numeric_flag_of_both_scripts():
    """A new numeric flag gets its range here: every int or float flag of either parser is in the
    tables, or one of those without a documented range."""
    no_range = {"--seed", "--num-classes", "--local-rank", "--val-rate", "--val-resize-size"}
    for distributed in (False, True):
        parser = get_args_parser(distributed)
        numeric = {action.option_strings[0] for action in parser._actions
                   if action.option_strings and action.type is not None and action.type is not str}
        assert numeric <= set(COMMON_RANGES) | set(DDP_RANGES) | no_range, numeric - set(COMMON_RANGES) - \
            set(DDP_RANGES) - no_range


@pytest.mark.parametrize("script", SCRIPTS)
def test_val_resize_size_may_equal_img_size_but_not_go_below(script):
    distributed = SCRIPTS[script]
    assert accepted(distributed, "--img-size", "32", "--val-resize-size", "32").val_resize_size == 32
    with pytest.raises(UserError, match=r"^--val-resize-size 31: must be at least --img-size 32"):
        parse(distributed, "--img-size", "32", "--val-resize-size", "31")


@pytest.mark.parametrize("rate, ok", [(-0.01, False), (0.0, True), (0.999, True), (1.0, False)])
def test_val_rate_is_at_least_0_and_below_1(rate, ok):
    from multi_train_utils.datasets import split_by_class

    images, labels = [f"{i}.jpg" for i in range(2000)], [i % 2 for i in range(2000)]
    if ok:
        train, _, val, _ = split_by_class(images, labels, ["a", "b"], rate, 0)
        assert len(val) == 2 * round(1000 * rate) and len(train) + len(val) == 2000
    else:
        with pytest.raises(UserError, match=rf"^--val-rate {rate}: must be at least 0 and below 1"):
            split_by_class(images, labels, ["a", "b"], rate, 0)


@pytest.mark.parametrize("script", SCRIPTS)
def test_eval_only_takes_the_runs_model_size_split_and_seed_unless_given(tmp_path, script):
    """--eval-only evaluates on the validation split the run trained beside: args.json's model,
    image sizes, --val-rate and --seed, and its data, unless typed on the command line."""
    import json

    data = tmp_path / "data"
    data.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "args.json").write_text(json.dumps({"model": "resnet18", "img_size": 48, "val_resize_size": 60,
                                               "val_rate": 0.3, "seed": 3, "data_path": str(data)}))
    weights = str(run / "model-best.pth")
    args = parse_flags(SCRIPTS[script], "--eval-only", "--weights", weights)
    assert (args.model, args.img_size, args.val_resize_size, args.val_rate, args.seed, args.data_path) == \
        ("resnet18", 48, 60, 0.3, 3, str(data))
    typed = parse_flags(SCRIPTS[script], "--eval-only", "--weights", weights, "--seed", "5", "--img-size", "64",
                        "--val-resize-size", "80")
    assert (typed.seed, typed.img_size, typed.val_resize_size, typed.val_rate) == (5, 64, 80, 0.3)


@pytest.mark.parametrize("flags, line", [
    (["--timeout", "0"], "--timeout 0.0: give a positive number of seconds"),
    (["--size-mb", "0"], "--size-mb 0.0: give a positive size in MiB"),
    (["--size-mb", "-1"], "--size-mb -1.0: give a positive size in MiB"),
    (["--spawn", "-1"], "--spawn -1: give a number of processes (0: off)")])
def test_the_doctors_flags_refuse_what_cannot_work(tmp_path, flags, line):
    import tools.doctor as doctor

    args = doctor.get_args_parser().parse_args([*flags, "--output-dir", str(tmp_path)])
    with pytest.raises(UserError) as e:
        doctor.check_args(args)
    assert str(e.value) == line
    edge = doctor.get_args_parser().parse_args(["--timeout", "0.1", "--size-mb", "0.01", "--spawn", "0",
                                                "--output-dir", str(tmp_path)])
    try:
        doctor.check_args(edge)  # the smallest values that work are taken
    except UserError as e:
        raise AssertionError(f"refused: {e}") from None
