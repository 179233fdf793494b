"""Command-line flags of the scripts.

Those of train_single.py and train_multi_gpu.py, with --demo's defaults and --eval-only's
run settings, and the trained-model flags of predict.py and export.py."""
import argparse
import hashlib
import importlib
import importlib.util
import math
import os
import re
import shutil
import sys
from dataclasses import dataclass, make_dataclass
from typing import Any, Mapping

from multi_train_utils.errors import UserError, printable
from multi_train_utils.multi_label import MultiLabel
from multi_train_utils.run_files import read_run_args
from multi_train_utils.single_label import SingleLabel
from multi_train_utils.task import Task

# What --demo changes, unless given on the command line: a small model and small images so
# that the demo trains in a few minutes on a laptop CPU.
DEMO_DEFAULTS = {"data_path": "data/demo", "model": "resnet18", "img_size": 96, "epochs": 3, "lr": 0.01}

# What --eval-only takes from the run that wrote the weights, unless given.
RUN_SETTINGS = ("model", "img_size", "val_resize_size", "val_rate", "seed", "multi_label", "task", "amp")
# Where the data is: class folders or label files. --eval-only takes the run's, unless any of
# them is given on the command line (then none of the run's, so that the two never mix).
DATA_FLAGS = ("data_path", "val_path", "train_list", "val_list")
# What --resume leaves out of the run's settings: how this session runs (its device, workers,
# threads, launcher), not what the run is. Every other flag of args.json is the run's.
SESSION_FLAGS = ("resume", "overwrite", "eval_only", "eval_output", "requeue", "download", "device", "workers",
                 "threads", "print_freq", "compile", "channels_last", "output_dir")
# The flags of the other script, with the values they have in this one: every setting the
# engine reads is then there in both (a missing one is an error at start, see check_complete).
SINGLE_PROCESS_SETTINGS = {"scale_lr": False, "sync_bn": False, "dist_backend": None, "dist_url": "env://",
                           "dist_timeout": 1800, "local_rank": None, "spawn": 0}
DDP_SETTINGS = {"data_parallel": False}


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse with a one-line error instead of the usage block; a value out of its flag's
    range (``in_range``) is a UserError that names the flag and the value."""

    def error(self, message):
        out_of_range = re.fullmatch(r"argument (--[\w-]+)(?:/[\w/-]+)?: (.+?: must .+)", message)
        if out_of_range:
            raise UserError(f"{out_of_range.group(1)} {out_of_range.group(2)}")
        self.exit(2, f"error: {message} (see --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to each flag's help unless the help already says its default."""

    def _get_help_string(self, action):
        if "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def finite_float(text):
    """argparse type of every float flag: a number, but not nan or inf (which would train on
    until the loss became nan, after the run's first files were written)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def in_range(convert, ok, must):
    """An argparse type: ``convert`` the text (int, finite_float), then refuse a value for
    which ``ok(value)`` is false with "--flag VALUE: must ``must``" (see OneLineErrorParser)."""
    def parse(text):
        value = convert(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{value}: must {must}")
        return value

    parse.__name__ = convert.__name__  # argparse names it in "invalid int value"
    return parse


POSITIVE_INT = in_range(int, lambda v: v >= 1, "be at least 1")
NOT_NEGATIVE = in_range(finite_float, lambda v: v >= 0, "not be negative")
POSITIVE = in_range(finite_float, lambda v: v > 0, "be positive")
FRACTION = in_range(finite_float, lambda v: 0 <= v <= 1, "be from 0 to 1")
MOMENTUM = in_range(NOT_NEGATIVE, lambda v: v < 1, "be below 1 (at 1 or more the updates grow without end)")


def _demo_defaults_text():
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in DEMO_DEFAULTS.items())


def get_args_parser(distributed):
    """The parser of both scripts: the common flags first, then the expert ones by topic;
    ``distributed`` adds the DDP flags, else the single-process one."""
    parser = OneLineErrorParser(
        usage="%(prog)s [flags]   (the common ones first; docs/flags.md has them all)",
        description="Train an image classifier on a folder of class sub-folders"
        + (" with DistributedDataParallel (launch with torchrun)." if distributed else " on one device."),
        formatter_class=HelpFormatter,
    )
    add_common_flags(parser.add_argument_group("common"), distributed)
    add_data_flags(parser.add_argument_group("data"))
    add_recipe_flags(parser.add_argument_group("recipe: augmentation, loss, optimizer, schedule (each off or "
                                               "plain unless given)"))
    add_run_flags(parser.add_argument_group("run: files, checkpoints, evaluation"))
    add_speed_flags(parser.add_argument_group("speed"))
    if distributed:
        ddp = parser.add_argument_group("distributed")
        ddp.add_argument("--scale-lr", action=argparse.BooleanOptionalAction, default=True,
                         help="multiply --lr by the world size (linear scaling rule)")
        ddp.add_argument("--sync-bn", "--syncBN", action=argparse.BooleanOptionalAction, default=None,
                         help="SyncBatchNorm over all GPUs, for per-GPU batches under ~16 (default: off; GPUs only)")
        ddp.add_argument("--dist-backend", default=None, choices=["nccl", "gloo", "mpi"],
                         help="process group backend (default: nccl on GPUs, gloo on CPUs)")
        ddp.add_argument("--dist-url", default="env://", help="init method; env:// reads MASTER_ADDR/PORT (torchrun)")
        ddp.add_argument("--dist-timeout", type=in_range(int, lambda v: v >= 1, "be at least 1 second"), default=1800,
                         help="seconds a collective waits for a missing rank before the job fails")
        ddp.add_argument("--local-rank", "--local_rank", type=int, default=None,
                         help="set by torch.distributed.launch (default: none; LOCAL_RANK wins)")
        ddp.add_argument("--spawn", type=in_range(int, lambda v: v >= 0, "be 0 (off) or more"), default=0,
                         metavar="N",
                         help="start N local processes with torch.multiprocessing.spawn (default: 0, off)")
    else:
        parser.add_argument_group("multi-GPU").add_argument(
            "--data-parallel", action="store_true", help="nn.DataParallel over all visible GPUs (DDP is faster)")
    parser.other_script_settings = DDP_SETTINGS if distributed else SINGLE_PROCESS_SETTINGS
    return parser


def add_common_flags(group, distributed):
    """What most runs set: the data, the model, how long and how fast it learns, where it goes."""
    group.add_argument("--data-path", default="data/flower_photos",
                       help="folder with one sub-folder of images per class")
    group.add_argument("--demo", action="store_true",
                       help=f"generate a small flower-like dataset and train on it; sets {_demo_defaults_text()}")
    group.add_argument("--model", default="resnet34", help="torchvision model name (resnet34, efficientnet_b0, ...)")
    group.add_argument("--weights", default="",
                       help="initial weights: a .pth state dict, or a torchvision weights name such as DEFAULT "
                            "(downloads) (default: none, random init)")
    group.add_argument("--epochs", type=POSITIVE_INT, default=30,
                       help="how many epochs to train (the first is epoch 0)")
    group.add_argument("--batch-size", type=POSITIVE_INT, default=16, help="images per step per process")
    group.add_argument("--lr", type=POSITIVE, default=0.001,
                       help="initial learning rate" + (" of one process" if distributed else ""))
    group.add_argument("--device", default="auto", help="auto (cuda, else mps, else cpu), cpu, cuda, cuda:N or mps")
    group.add_argument("--output-dir", default="weights", help="where the weights, metrics.csv and args.json go")
    group.add_argument("--resume", default=None, metavar="PATH|auto",
                       help="continue from a checkpoint.pth; auto: <output-dir>/checkpoint.pth if there is one "
                            "(default: none)")
    group.add_argument("--eval-only", action="store_true",
                       help="only evaluate --weights on the validation split and print the metrics")


def add_data_flags(group):
    """Where the images are and how they are split and loaded."""
    group.add_argument("--val-path", default=None,
                       help="an already-split validation folder (default: split --data-path by --val-rate)")
    group.add_argument("--train-list", default=None, metavar="CSV",
                       help="a CSV with the header path,label instead of class folders (default: none)")
    group.add_argument("--val-list", default=None, metavar="CSV",
                       help="with --train-list: the validation CSV (default: split --train-list)")
    group.add_argument("--multi-label", action="store_true",
                       help="an image may carry several classes (or none): --train-list with the header path,labels, "
                            "each row's classes separated by spaces; one sigmoid per class (docs/multi-label.md); "
                            "the same as --task multi-label")
    group.add_argument("--task", default=None, metavar="TASK",
                       help="what the labels are: single-label (default), multi-label, or FILE.py:ClassName, a "
                            "task.Task subclass of yours (docs/layout.md, \"A task of your own\")")
    group.add_argument("--val-rate", type=finite_float, default=0.2, help="share of each class held out for validation")
    group.add_argument("--check-images", action=argparse.BooleanOptionalAction, default=False,
                       help="open every image before training and skip those that fail (slow on large data; "
                            "default: a bad file is handled when met, see docs/data.md)")
    group.add_argument("--num-classes", "--num_classes", type=int, default=None,
                       help="number of classes (default: the data's; another value is an error)")
    group.add_argument("--img-size", type=POSITIVE_INT, default=224, help="training crop and validation size in pixels")
    group.add_argument("--val-resize-size", type=int, default=None, metavar="N",
                       help="validation: shorter side to N, then the center crop (default: round(img-size x 256/224))")
    group.add_argument("--workers", type=in_range(int, lambda v: v >= 0, "be 0 (load in the main process) or more"),
                       default=None, help="loader processes per training process (default: its share of the cores)")
    group.add_argument("--download", action="store_true",
                       help="download the tutorial's flower_photos (228 MB, checked) to --data-path first")
    group.add_argument("--freeze-layers", action=argparse.BooleanOptionalAction, default=False,
                       help="train only the classifier head (fc / classifier / heads)")


def add_recipe_flags(group):
    """Augmentation, loss, imbalance, optimizer, schedule and EMA (see docs/recipe.md)."""
    alpha = in_range(finite_float, lambda v: v >= 0, "not be negative (0: off)")
    smoothing = in_range(finite_float, lambda v: 0 <= v < 1, "be from 0 to 1 (below 1)")
    group.add_argument("--hflip", type=FRACTION, default=0.5, metavar="P",
                       help="flip each training image left-right with probability P (0: never, for text, digits, "
                            "or classes that differ by side)")
    group.add_argument("--auto-augment", default="none",
                       choices=["none", "ta_wide", "randaugment", "autoaugment", "augmix"],
                       help="an automatic augmentation policy after the crop and flip")
    group.add_argument("--random-erase", type=FRACTION, default=0.0, metavar="P",
                       help="erase a random rectangle of each training image with probability P")
    group.add_argument("--mixup-alpha", type=alpha, default=0.0, metavar="A", help="MixUp, Beta(A, A) (0.2 is usual)")
    group.add_argument("--cutmix-alpha", type=alpha, default=0.0, metavar="A", help="CutMix, Beta(A, A) (1.0 is usual)")
    group.add_argument("--label-smoothing", type=smoothing, default=0.0, metavar="S",
                       help="label smoothing of the cross-entropy (0.1 is usual)")
    group.add_argument("--class-weights", default="none", choices=["none", "balanced"],
                       help="balanced: weigh each class's loss by n_images / (n_classes x its images)")
    group.add_argument("--sampler", default="shuffle", choices=["shuffle", "balanced"],
                       help="balanced: draw with replacement so that every class is equally likely")
    group.add_argument("--opt", default="sgd", choices=["sgd", "adamw"],
                       help="SGD with momentum, or AdamW (default: sgd; with --multi-label adamw at --lr 0.001 unless "
                            "--opt or --lr is given)")
    group.add_argument("--momentum", type=MOMENTUM, default=0.9, help="SGD momentum")
    group.add_argument("--weight-decay", type=NOT_NEGATIVE, default=None,
                       help="weight decay (default: 0.005 for SGD, 0.05 for AdamW)")
    group.add_argument("--norm-bias-decay", action=argparse.BooleanOptionalAction, default=True,
                       help="weight decay on normalisation layers and biases too")
    group.add_argument("--lr-scheduler", default="cosine", choices=["cosine", "step"],
                       help="after the warm-up: cosine to --lr x --lrf, or x --lr-gamma every --lr-step-size epochs")
    group.add_argument("--lrf", type=NOT_NEGATIVE, default=0.1, help="cosine: the final rate as a fraction of --lr")
    group.add_argument("--lr-step-size", type=in_range(int, lambda v: v >= 1, "be at least 1 epoch"), default=30,
                       metavar="N", help="step: multiply the rate by --lr-gamma every N epochs")
    group.add_argument("--lr-gamma", type=POSITIVE, default=0.1, help="step: the factor of each step")
    group.add_argument("--warmup-epochs", type=in_range(int, lambda v: v >= 0, "not be negative"), default=0,
                       help="epochs of linear learning-rate warm-up")
    group.add_argument("--model-ema", action="store_true",
                       help="keep and evaluate an exponential moving average of the weights")
    group.add_argument("--model-ema-decay", default=0.9998, metavar="D",
                       type=in_range(finite_float, lambda v: 0 < v < 1, "be above 0 and below 1 (e.g. 0.9998)"),
                       help="EMA decay per optimizer step (warmed up as min(D, (1 + n) / (10 + n)))")
    group.add_argument("--seed", type=int, default=0,
                       help="seed of the split, the weights, the order, the augmentations")


def add_run_flags(group):
    """The run's files, checkpoints, early stopping and evaluation."""
    group.add_argument("--overwrite", action="store_true", help="replace the files of an earlier run in --output-dir")
    group.add_argument("--log-dir", default="runs", help="TensorBoard logs, one sub-folder per run")
    group.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True,
                       help="draw the class distribution, a batch, the curves and the confusion matrix")
    group.add_argument("--keep-last", type=in_range(int, lambda v: v >= 0, "be 0 (keep all) or more"), default=1,
                       metavar="K", help="keep the last K model-{epoch}.pth; 0 keeps all; "
                                         "default: 1, the last epoch's")
    group.add_argument("--best-metric", default=None,
                       help="validation metric that picks model-best.pth (loss: the lowest): accuracy, "
                            "balanced_accuracy, macro_f1 or loss; with --multi-label map, micro_f1, macro_f1, accuracy "
                            "(exact match) or loss; a task of yours: its own (default: the task's first: accuracy; "
                            "map with --multi-label)")
    group.add_argument("--tune-thresholds", action="store_true",
                       help="--multi-label: per class, the threshold of the best F1 on validation at the best epoch, "
                            "kept in thresholds.json for predict.py and the export (default: 0.5 each)")
    group.add_argument("--patience", type=in_range(int, lambda v: v >= 0, "be 0 (never stop early) or more"), default=0,
                       metavar="N", help="stop after N epochs without a better --best-metric (0: never)")
    group.add_argument("--checkpoint-every", type=NOT_NEGATIVE, default=10.0, metavar="MINUTES",
                       help="also save checkpoint.pth inside an epoch after MINUTES since the last save (0: only at "
                            "epoch ends); a hard kill then loses at most that much (docs/guarantees.md)")
    group.add_argument("--requeue", action="store_true",
                       help="SLURM: after a preemption notice's save, requeue the job (scontrol requeue); needs "
                            "--resume auto (docs/multi-gpu.md)")
    group.add_argument("--target-accuracy", type=in_range(finite_float, lambda v: 0 < v <= 1, "be above 0, at most 1"),
                       default=None, metavar="A",
                       help="the end summary says when val accuracy (--multi-label: mAP), of the model or its EMA, "
                            "first reached A (default: none)")
    group.add_argument("--eval-output", default=None, metavar="DIR",
                       help="with --eval-only: write the confusion matrix and the metrics as CSV into DIR")


def add_speed_flags(group):
    """Precision, memory format, compiling, accumulation, threads (see docs/performance.md)."""
    group.add_argument("--amp", default="auto", choices=["auto", "bf16", "fp16", "off"],
                       help="mixed precision: auto is bf16 where it runs natively, fp16 on older GPUs, else off")
    group.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                       help="NHWC memory format (default: on for convolutional nets on CPU and CUDA)")
    group.add_argument("--compile", action="store_true", help="torch.compile the model (the first steps compile)")
    group.add_argument("--accum-steps", type=POSITIVE_INT, default=1, metavar="N",
                       help="gradient accumulation: one optimizer step every N batches")
    group.add_argument("--clip-grad", metavar="NORM", default=None,
                       type=in_range(finite_float, lambda v: v > 0, "be positive (leave it out for no clipping)"),
                       help="clip the gradient norm to NORM (default: no clipping)")
    group.add_argument("--grad-checkpoint", action="store_true",
                       help="activation checkpointing: less memory, about a third more compute")
    group.add_argument("--print-freq", type=POSITIVE_INT, default=20, metavar="N",
                       help="read the loss for the progress bar every N steps (each read waits for the device)")
    group.add_argument("--threads", type=POSITIVE_INT, default=None, metavar="N",
                       help="torch's CPU threads per process (default: its share of the cores)")


def given_on_command_line(parser, argv):
    """Names (dests) of the flags the user actually typed."""
    saved = {action.dest: action.default for action in parser._actions}
    try:
        for action in parser._actions:
            action.default = argparse.SUPPRESS
        return set(vars(parser.parse_args(argv)))
    finally:
        for action in parser._actions:
            action.default = saved[action.dest]


def parse_args(parser, argv=None):
    """Parse flags and fill in --demo's defaults, --eval-only's run settings and the other
    script's flags (with their values in this one)."""
    args = parser.parse_args(argv)
    given = given_on_command_line(parser, argv)
    for key, value in parser.other_script_settings.items():
        setattr(args, key, value)
    taken = take_resumed_run_settings(args, given) if args.resume and not args.eval_only else set()
    if args.demo:
        for key, value in DEMO_DEFAULTS.items():
            if key not in given | taken:
                setattr(args, key, value)
    if args.eval_only:
        if not args.weights:
            raise UserError("--eval-only needs --weights PATH (e.g. weights/model-best.pth)")
        take_run_settings(args, given)
    task = make_task(choose_task_name(args))  # after the run's settings: --eval-only takes its task
    if not set(task.recipe_defaults) & (given | taken):  # --multi-label: AdamW, unless --opt or --lr is given
        for key, value in task.recipe_defaults.items():
            setattr(args, key, value)
    if args.weight_decay is None:  # each optimizer's usual value
        args.weight_decay = 0.05 if args.opt == "adamw" else 0.005
    if args.best_metric is None:
        args.best_metric = task.metrics[0]
    check_numbers(args)
    check_task_flags(args, task)
    check_requeue(args)
    check_data_flags(args, given)
    check_complete(args)
    return args


# --- One config ------------------------------------------------------------------------------

# The section of each flag of the "common" help group; every other flag is in the section of
# its group (data, recipe, run, speed; distributed and multi-GPU: distributed).
COMMON_SECTIONS = {"data_path": "data", "demo": "data", "model": "recipe", "weights": "recipe", "epochs": "recipe",
                   "batch_size": "recipe", "lr": "recipe", "device": "speed", "output_dir": "run", "resume": "run",
                   "eval_only": "run"}
SECTIONS = ("data", "recipe", "run", "speed", "distributed")


@dataclass(frozen=True)
class Config:
    """The checked flags, in frozen sections of the --help's topics: ``data`` (where the images
    are, how they are split and read), ``recipe`` (model, epochs, augmentation, loss, optimizer,
    schedule), ``run`` (files, checkpoints, evaluation: what decides the best epoch too),
    ``speed`` and ``distributed``. Engine functions take the section they use, as
    ``config.run.output_dir``; ``flags``: every setting as args.json keeps it."""

    data: Any
    recipe: Any
    run: Any
    speed: Any
    distributed: Any
    flags: Mapping


def section_of_each_flag():
    """{flag's dest: its section}, from both scripts' parsers."""
    sections = dict(COMMON_SECTIONS)
    for distributed in (False, True):
        for group in get_args_parser(distributed)._action_groups:
            section = group.title.split(":")[0]
            section = "distributed" if section in ("distributed", "multi-GPU") else section
            if section in SECTIONS:
                sections.update({action.dest: section for action in group._group_actions})
    return sections


def args_to_dict(args):
    """The flags as JSON-friendly values (for args.json); data paths made absolute so that
    --eval-only finds them from any folder."""
    values = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list, type(None)))}
    for key in ("data_path", "val_path", "train_list", "val_list"):
        if values.get(key):
            values[key] = os.path.abspath(values[key])
    return values



_SECTION_CLASSES = {}


def config_of(args):
    """The flags ``args`` (as parse_args returns them) as a Config of frozen sections."""
    if not _SECTION_CLASSES:
        where = section_of_each_flag()
        for section in SECTIONS:
            names = sorted(dest for dest, its in where.items() if its == section)
            _SECTION_CLASSES[section] = make_dataclass(section.title() + "Settings", names, frozen=True)
    values = vars(args)
    sections = {section: made(**{name: values[name] for name in made.__dataclass_fields__})
                for section, made in _SECTION_CLASSES.items()}
    return Config(**sections, flags=args_to_dict(args))


def setting_names():
    """Every setting of the training scripts: the flags of both."""
    return {key for distributed in (False, True) for key in vars(get_args_parser(distributed).parse_args([]))} | \
        set(SINGLE_PROCESS_SETTINGS) | set(DDP_SETTINGS)


def check_complete(args):
    """A script whose flags lack a setting that the other has stops here, at the start, naming
    it; the engine reads every setting as ``args.name`` and never supplies a default."""
    missing = sorted(setting_names() - set(vars(args)))
    if missing:
        raise RuntimeError(f"the flags lack the settings {missing}: add them to options.get_args_parser "
                           "(or to the other script's settings there)")


def take_run_settings(args, given):
    """For --eval-only: model, image size, data and split, and the precision (--amp), of the
    run that wrote --weights (its args.json), unless given on the command line."""
    run_dir = os.path.dirname(os.path.abspath(args.weights))
    run_args = read_run_args(run_dir)
    if run_args is None:
        return
    settings = RUN_SETTINGS + (DATA_FLAGS if not given & set(DATA_FLAGS) else ())
    taken = {key for key in settings if key not in given and key in run_args}
    for key in taken:
        setattr(args, key, run_args[key])
    check_taken_data(args, taken, run_dir)


def take_resumed_run_settings(args, given):
    """For --resume: every setting of the run in --output-dir (auto) or beside the checkpoint
    (its args.json) that is not given on the command line, but this session's (SESSION_FLAGS,
    the launcher's); none of its data flags where a given one names other data than the run's
    (the two never mix). Returns the names taken. A given flag that changes the run is refused later, naming it
    (checkpoint.check_resume_compatible)."""
    run_dir = args.output_dir if args.resume == "auto" else os.path.dirname(os.path.abspath(args.resume))
    run_args = read_run_args(run_dir)
    if run_args is None:
        return set()
    other_data = any(not same_path(getattr(args, key), run_args.get(key)) for key in given & set(DATA_FLAGS))
    left_out = set(SESSION_FLAGS) | set(SINGLE_PROCESS_SETTINGS) | set(DDP_SETTINGS) | \
        (set(DATA_FLAGS) if other_data else set())
    taken = {key for key in run_args if hasattr(args, key) and key not in given and key not in left_out}
    for key in taken:
        setattr(args, key, run_args[key])
    check_taken_data(args, taken, run_dir)
    return taken


def same_path(a, b):
    """Whether two paths (or None) name the same place, typed relative or absolute."""
    return a == b or (a is not None and b is not None and os.path.abspath(a) == os.path.abspath(b))


def check_taken_data(args, taken, run_dir):
    """The data flags ``taken`` from ``run_dir``'s args.json still name files that are there."""
    used = ("train_list", "val_list") if args.train_list else ("data_path", "val_path")  # --data-path is unused then
    for key in used:
        path = getattr(args, key)
        if key in taken and path and not os.path.exists(path):
            raise UserError(f"--{key.replace('_', '-')} {path} (from {os.path.join(run_dir, 'args.json')}) is not "
                            f"there any more; give --{key.replace('_', '-')}")


def check_numbers(args):
    """What a flag's type cannot check alone: the flags that go together, and --img-size
    (which --eval-only may take from args.json)."""
    if args.img_size < 1:
        raise UserError(f"--img-size {args.img_size}: must be at least 1")
    if args.eval_output and not args.eval_only:
        raise UserError("--eval-output is for --eval-only; a training run writes its confusion matrix to --output-dir")
    if args.eval_output and os.path.exists(args.eval_output) and not os.path.isdir(args.eval_output):
        raise UserError(f"--eval-output {args.eval_output}: is a file; give a folder")
    if args.download and args.demo:
        raise UserError("--download and --demo do not go together: --demo generates its own data")
    if args.resume and args.eval_only:
        raise UserError("--resume and --eval-only do not go together; evaluate a checkpoint with --weights")
    if args.data_parallel and args.compile:
        raise UserError("--compile with --data-parallel: DataParallel's replicas would all run the GPU 0 copy; "
                        "use torchrun train_multi_gpu.py --compile (DDP) instead")
    if args.val_resize_size is not None and args.val_resize_size < args.img_size:
        raise UserError(f"--val-resize-size {args.val_resize_size}: must be at least --img-size {args.img_size} "
                        "(the center crop is taken from the resized image)")


def check_requeue(args):
    """--requeue needs a SLURM job (SLURM_JOB_ID), scontrol, and --resume auto (what the
    requeued job continues with)."""
    if not args.requeue:
        return
    if not os.environ.get("SLURM_JOB_ID"):
        raise UserError("--requeue: SLURM_JOB_ID is not set, so this is not a SLURM job; run it from sbatch "
                        "(docs/multi-gpu.md has a script) or drop --requeue")
    if shutil.which("scontrol") is None:
        raise UserError("--requeue: scontrol is not on PATH, so the job cannot be requeued; add SLURM's bin folder "
                        "to PATH or drop --requeue")
    if args.resume != "auto":
        raise UserError("--requeue needs --resume auto: the requeued job runs the same command and must continue "
                        "where this one stopped")


def choose_task_name(args):
    """args.task from --task and --multi-label (the same as --task multi-label): the task's name."""
    if args.multi_label and args.task not in (None, "multi-label"):
        raise UserError(f"--multi-label with --task {printable(args.task)}: give one of them")
    args.task = "multi-label" if args.multi_label else (args.task or "single-label")
    args.multi_label = args.task == "multi-label"  # args.json's older readers go by it
    return args.task


def check_task_flags(args, task):
    """The flags a task cannot go with: a --best-metric it has not, --tune-thresholds where it
    has no thresholds, and, where labels are rows (several classes an image), --sampler
    balanced and the class folders of --demo and --download."""
    flag = "--multi-label" if args.multi_label else f"--task {printable(args.task)}"
    if args.best_metric not in task.metrics:
        if args.best_metric in MultiLabel.metrics and not task.several_labels:
            raise UserError(f"--best-metric {args.best_metric}: for --multi-label runs; add --multi-label or use "
                            f"{', '.join(task.metrics[:-1])} or {task.metrics[-1]}")
        raise UserError(f"--best-metric {printable(args.best_metric)}: not defined with "
                        f"{flag if args.task != 'single-label' else 'single-label runs'}; use "
                        f"{', '.join(task.metrics[:-1])} or {task.metrics[-1]}")
    if args.tune_thresholds and not task.tunes_thresholds:
        raise UserError("--tune-thresholds is for --multi-label runs (one threshold per class); add --multi-label "
                        "or drop it")
    if task.several_labels:
        if args.sampler == "balanced":
            raise UserError(f"--sampler balanced with {flag}: an image of several classes has no one class to "
                            "balance by; use --class-weights balanced (a positive weight per class)")
        if args.demo or args.download:
            raise UserError(f"{flag} with --{'demo' if args.demo else 'download'}: those make class folders, "
                            "one class an image; give --train-list with the header path,labels")


def check_data_flags(args, given=()):
    """Class folders (--data-path, --val-path) or label files (--train-list, --val-list): not both."""
    if args.train_list and "data_path" in given:
        raise UserError("--data-path with --train-list: the label file says where the images are; drop --data-path")
    if args.val_list and not args.train_list:
        raise UserError("--val-list needs --train-list (the training images and their classes)")
    if args.train_list and args.val_path:
        raise UserError("--val-path is for class folders; with --train-list give the validation images as --val-list")
    if args.train_list and (args.demo or args.download):
        raise UserError(f"--train-list with --{'demo' if args.demo else 'download'}: those make class folders; "
                        "drop one of them")


def add_trained_model_flags(parser, takes_pt2=False):
    """--weights, --model, --img-size, --class-indices: the flags of predict.py and export.py
    (``takes_pt2``: --weights may also be a .pt2 that export.py wrote)."""
    weights = "model-best.pth, model-{epoch}.pth or checkpoint.pth of a run"
    parser.add_argument("--weights", required=True,
                        help=weights + (", or a .pt2 from export.py (which carries the run's settings)" if takes_pt2 else ""))
    parser.add_argument("--model", default=None, help="model name (default: from args.json beside the weights)")
    parser.add_argument("--img-size", type=int, default=None,
                        help="image size (default: from args.json beside the weights)")
    parser.add_argument("--val-resize-size", type=int, default=None, metavar="N",
                        help="shorter side resized to N before the center crop (default: from args.json beside the "
                             "weights, else round(img-size x 256/224))")
    parser.add_argument("--class-indices", default=None,
                        help="class_indices.json (default: the one beside the weights)")


def task_of(args):
    """The task the flags ask for (--task, --multi-label; --tune-thresholds): a task.Task."""
    return make_task(args.task or ("multi-label" if getattr(args, "multi_label", False) else "single-label"),
                     tune_thresholds=getattr(args, "tune_thresholds", False))


def make_task(name, thresholds=None, tune_thresholds=False):
    """The task ``name``: "single-label", "multi-label", or "FILE.py:Class" / "module:Class"
    (a Task subclass of yours); a UserError naming --task where it cannot be had."""
    built_in = {"single-label": SingleLabel, "multi-label": MultiLabel}
    if name in built_in:
        return built_in[name](thresholds, tune_thresholds)
    where, _, attribute = str(name).rpartition(":")
    if not where or not attribute:
        raise UserError(f"--task {printable(name)}: give single-label, multi-label, or FILE.py:ClassName of a Task "
                        "subclass of yours (docs/layout.md)")
    try:
        module = _import(where, name)
        task_class = getattr(module, attribute)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - a user's file may raise anything while it is imported
        raise UserError(f"--task {printable(name)}: cannot be loaded ({type(e).__name__}: {printable(str(e))}); "
                        "give FILE.py:ClassName of a Task subclass") from None
    if not (isinstance(task_class, type) and issubclass(task_class, Task)):
        raise UserError(f"--task {printable(name)}: {attribute} is not a subclass of multi_train_utils.task.Task")
    task = task_class(thresholds, tune_thresholds)
    task.name = name
    return task


def _import(where, name):
    """A module by its file's path (FILE.py) or its dotted name (``name``: the --task value)."""
    if not where.endswith(".py"):
        return importlib.import_module(where)
    if not os.path.isfile(where):
        raise UserError(f"--task {printable(name)}: no such file {printable(where)}; give FILE.py:ClassName")
    # by its whole path: two task files of one name (a/task.py, b/task.py) are two modules
    path = os.path.abspath(where)
    digest = hashlib.sha256(os.fsencode(path)).hexdigest()[:16]
    name = f"user_task_{os.path.splitext(os.path.basename(path))[0]}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, where)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: pickling and dataclasses look it up there
    spec.loader.exec_module(module)
    return module
