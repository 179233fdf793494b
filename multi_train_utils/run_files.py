"""A run's files in --output-dir: their names, and the one reader and writer of each.

args.json, class_indices.json and metrics.csv; the guard against overwriting an earlier
run; and the trained model of a run (its weights with those files) for predict and export."""
import csv
import glob
import os
import re
from typing import Any, List, NamedTuple, Optional, Sequence

from multi_train_utils.checkpoint import CHECKPOINT, PREVIOUS_CHECKPOINT, resumes_in
from multi_train_utils.datasets import images_info
from multi_train_utils.errors import UserError
from multi_train_utils.exported import is_program
from multi_train_utils.files import (FLAG, MAPPING_OR_NULL, NUMBER, TEXT, TEXT_OR_NULL, WHOLE_NUMBER, WHOLE_NUMBER_OR_NULL,
                                    check_fields, read_json, write_csv_atomic, write_json_atomic)
from multi_train_utils.images import IMAGENET_MEAN, IMAGENET_STD, resize_size
from multi_train_utils.model_setup import ModelSpec, check_input_size
from multi_train_utils.weights import load_exact_weights, load_state_dict_file

ARGS_FILE = "args.json"
CLASSES_FILE = "class_indices.json"
METRICS_FILE = "metrics.csv"
THRESHOLDS_FILE = "thresholds.json"  # per class, where a task predicts by thresholds: for predict.py and the export
# The tutorial's six columns first (scripts that read them keep working), then the others:
# the EMA's columns are empty without --model-ema, val_top5_accuracy with 5 classes or fewer.
METRICS_HEADER = ["epoch", "train_loss", "val_accuracy", "lr", "images_per_second", "epoch_seconds",
                  "val_loss", "val_balanced_accuracy", "val_macro_f1", "val_top5_accuracy",
                  "ema_val_accuracy", "ema_val_loss", "ema_val_balanced_accuracy", "ema_val_macro_f1", "best_source",
                  "val_map", "val_micro_f1", "val_micro_precision", "val_micro_recall", "ema_val_map", "run_seconds"]
# Every file a training run writes into --output-dir, besides model-<epoch>.pth; --overwrite
# removes these names and no others (a model-final-for-paper.pth of yours stays).
BEST_WEIGHTS = "model-best.pth"
RUN_FILES = (CHECKPOINT, PREVIOUS_CHECKPOINT, CHECKPOINT + ".damaged", BEST_WEIGHTS, METRICS_FILE, ARGS_FILE,
             CLASSES_FILE, "train.log", "confusion_matrix.csv", "class_distribution.png", "batch_preview.png",
             "curves.png", "confusion_matrix.png", "most_confused.png", THRESHOLDS_FILE, "per_class_metrics.csv",
             "per_class_ap.png", "pr_curves.png")
# model-{epoch}.pth exactly as a run writes it: model-3.pth, never a user's model-03.pth.
EPOCH_WEIGHTS = r"model-(0|[1-9][0-9]*)\.pth"
# The flags that --eval-only, predict.py and export.py read back from args.json, and their kinds.
RUN_ARGS_READ_BACK = {"model": TEXT, "img_size": WHOLE_NUMBER, "val_rate": NUMBER, "seed": WHOLE_NUMBER,
                      "data_path": TEXT_OR_NULL, "val_path": TEXT_OR_NULL, "train_list": TEXT_OR_NULL,
                      "val_list": TEXT_OR_NULL, "val_resize_size": WHOLE_NUMBER_OR_NULL, "images": MAPPING_OR_NULL,
                      "multi_label": FLAG, "task": TEXT_OR_NULL, "amp": (lambda v: v in ("auto", "bf16", "fp16", "off"),
                                                   "one of auto, bf16, fp16, off")}
# What the run's images are (Datasets' channels, mean and std), in args.json under "images";
# a run written before they were kept had RGB images normalised with ImageNet's.
RGB_IMAGENET = {"channels": 3, "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)}


# --- An earlier run in --output-dir ---------------------------------------------------------------

def earlier_run_files(output_dir):
    """Files in ``output_dir`` that an earlier training run wrote, by their exact names."""
    found = [path for _, path in sorted(model_epoch_files(output_dir).items())]
    return found + [os.path.join(output_dir, f) for f in RUN_FILES if os.path.isfile(os.path.join(output_dir, f))]


def check_output_dir(output_dir, overwrite, resume_path=None):
    """Refuse to start over an earlier run's checkpoints, unless --overwrite is given or this
    run resumes from the checkpoint in that very folder."""
    resuming_here = resumes_in(resume_path, output_dir)
    earlier = [f for f in earlier_run_files(output_dir) if f.endswith(".pth")]
    if earlier and not overwrite and not resuming_here:
        names = ", ".join(os.path.basename(f) for f in earlier[:3]) + (", ..." if len(earlier) > 3 else "")
        raise UserError(
            f"--output-dir {output_dir}: holds checkpoints of an earlier run ({names}); "
            "pass --resume auto to continue it, --overwrite to replace it, or choose another --output-dir"
        )


def clear_earlier_run(run, checkpoint):
    """Make --output-dir ready for this run (``run``: the flags' run section): remove the
    temporary files of writes that a killed process never finished, and, when this run starts
    afresh (--overwrite, or --resume auto with nothing to resume), the files of an earlier run
    there. Other files are left alone."""
    os.makedirs(run.output_dir, exist_ok=True)
    for path in glob.glob(os.path.join(glob.escape(run.output_dir), ".*.tmp")):
        if is_run_file(os.path.basename(path)[1:].removesuffix(".tmp").rsplit(".", 1)[0]):  # .NAME.XXXXXXXX.tmp
            os.remove(path)
    if checkpoint is None and (run.overwrite or run.resume == "auto"):
        for path in earlier_run_files(run.output_dir):
            os.remove(path)


def is_run_file(name):
    """Whether a training run writes a file of this name into --output-dir."""
    return name in RUN_FILES or re.fullmatch(EPOCH_WEIGHTS, name) is not None


def model_epoch_files(output_dir):
    """``{epoch: path}`` of the per-epoch weights in ``output_dir``."""
    files = {}
    for path in glob.glob(os.path.join(glob.escape(output_dir), "model-*.pth")):
        match = re.fullmatch(EPOCH_WEIGHTS, os.path.basename(path))
        if match:
            files[int(match.group(1))] = path
    return files


# --- args.json and class_indices.json -------------------------------------------------------------

def images_of(data):
    """What the images of ``data`` (a Datasets) are, as args.json keeps it."""
    channels, mean, std = images_info(data)
    as_list = lambda values: None if values is None else [float(v) for v in values]  # noqa: E731
    return {"channels": int(channels), "mean": as_list(mean), "std": as_list(std)}


def write_run_settings(output_dir, flags, classes, images=None):
    """args.json (``flags``: every setting of the run, as options.Config.flags holds them, and under
    "images" what its images are: default RGB_IMAGENET) and class_indices.json ({"0": "daisy",
    ...}), atomically."""
    images = images or RGB_IMAGENET
    write_json_atomic({**flags, "images": images}, os.path.join(output_dir, ARGS_FILE))
    write_json_atomic({str(i): name for i, name in enumerate(classes)}, os.path.join(output_dir, CLASSES_FILE))


def read_run_args(run_dir, hint="fix or delete it"):
    """The flags in ``run_dir``'s args.json, or None if there is none; a UserError naming the
    file and the flag if one that is read back is of the wrong kind."""
    path = os.path.join(run_dir, ARGS_FILE)
    if not os.path.isfile(path):
        return None
    values = read_json(path, hint)
    if not isinstance(values, dict):
        raise UserError(f'{path}: holds a {type(values).__name__}, not the flags of a run ({{"model": ...}}); {hint}')
    check_fields(values, RUN_ARGS_READ_BACK, path, hint)
    return values


def read_class_indices(path):
    """Class names, in index order, from a ``class_indices.json`` file; a UserError if it is not one."""
    example = '{"0": "daisy", "1": "roses", ...}'
    mapping = read_json(path, hint=f"give a class index file like {example}")
    if not isinstance(mapping, dict) or not mapping:
        raise UserError(f"{path}: holds {mapping!r:.40}, not a class index file like {example}")
    missing = [str(i) for i in range(len(mapping)) if str(i) not in mapping]
    if missing:
        raise UserError(f'{path}: has no class "{missing[0]}": its keys must run from "0" to "{len(mapping) - 1}" '
                        f"(like {example})")
    check_fields(mapping, {str(i): TEXT for i in range(len(mapping))}, path, f"class names are strings ({example})")
    return [mapping[str(i)] for i in range(len(mapping))]


def read_run_classes(run_dir):
    """The class names in ``run_dir``'s class_indices.json, or None if there is none."""
    path = os.path.join(run_dir, CLASSES_FILE)
    return read_class_indices(path) if os.path.isfile(path) else None


def task_of_run(run_args):
    """The task name of a run's args.json (before "task" was written: from "multi_label")."""
    run_args = run_args or {}
    return run_args.get("task") or ("multi-label" if run_args.get("multi_label") else "single-label")


# --- metrics.csv ----------------------------------------------------------------------------------

def metrics_header(task):
    """metrics.csv's columns for ``task``: METRICS_HEADER, then the columns it adds."""
    return METRICS_HEADER + [column for column in task.columns if column not in METRICS_HEADER]


def write_metrics(output_dir, rows, header=METRICS_HEADER):
    """metrics.csv: the ``header`` (a task's columns after METRICS_HEADER), then one row (a
    list of values) per epoch, atomically; rows of a checkpoint written before the later
    columns existed get empty cells there."""
    padded = [list(row) + [""] * (len(header) - len(row)) for row in rows]
    write_csv_atomic([header, *padded], os.path.join(output_dir, METRICS_FILE))


def read_metrics(run_dir):
    """metrics.csv of a run as a list of dicts."""
    path = os.path.join(run_dir, METRICS_FILE)
    try:
        with open(path) as f:
            return list(csv.DictReader(f))
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror}); is {run_dir} a run's --output-dir?") from None


# --- The trained model of a run (predict.py, export.py) -------------------------------------------

def read_run_settings(weights, model=None, img_size=None, class_indices=None):
    """(model name, image size, class names) of the run that wrote ``weights``: the given
    values first, else its args.json and class_indices.json beside the weights."""
    if not os.path.isfile(weights):
        raise UserError(f"--weights {weights}: no such file (e.g. weights/model-best.pth of a finished run)")
    run_dir = os.path.dirname(os.path.abspath(weights))
    run_args = {}
    if not (model and img_size):
        run_args = read_run_args(run_dir, hint="give --model and --img-size") or {}
    model = model or run_args.get("model")
    img_size = img_size or run_args.get("img_size")
    if not model or not img_size:
        raise UserError(f"no args.json beside {weights}: give --model and --img-size as in training")
    classes_file = class_indices or os.path.join(run_dir, CLASSES_FILE)
    if not os.path.isfile(classes_file):
        raise UserError(f"{classes_file}: not found; give --class-indices (the run's class_indices.json)")
    return model, int(img_size), read_class_indices(classes_file)


def trained_model_files(args):
    """(what, path) of each file predict.py and export.py read besides the images: --weights,
    the run's args.json and class_indices.json beside it (not for a .pt2), and --class-indices
    if given."""
    run_dir = os.path.dirname(os.path.abspath(args.weights))
    files = [("the --weights file", args.weights)]
    if not is_program(args.weights):  # a .pt2 carries its run's settings inside
        files += [(f"the run's {name}", os.path.join(run_dir, name)) for name in (ARGS_FILE, CLASSES_FILE,
                                                                                  THRESHOLDS_FILE)]
    if args.class_indices:
        files.append(("the --class-indices file", args.class_indices))
    return files


def read_val_resize_size(args, img_size):
    """Validation resize of the run that wrote --weights: --val-resize-size if given, else its
    args.json's, else the default for ``img_size`` (round(img_size x 256/224))."""
    if args.val_resize_size:
        return args.val_resize_size
    run_args = read_run_args(os.path.dirname(os.path.abspath(args.weights)), hint="give --val-resize-size") or {}
    return run_args.get("val_resize_size") or resize_size(img_size)


def read_run_images(weights):
    """What the images of the run that wrote ``weights`` are ({"channels", "mean", "std"}):
    its args.json's "images", else RGB with ImageNet's mean and std."""
    run_dir = os.path.dirname(os.path.abspath(weights))
    images = (read_run_args(run_dir) or {}).get("images") or RGB_IMAGENET
    check_fields(images, {"channels": WHOLE_NUMBER}, os.path.join(run_dir, ARGS_FILE), "fix or delete it")
    return {**RGB_IMAGENET, **images}


class TrainedModel(NamedTuple):
    """A run's trained model, in eval mode, and what it takes and tells (``task``: how its
    outputs read, as the run left it)."""

    model: Any
    name: str  # --model
    img_size: int
    classes: List[str]
    channels: int = 3
    mean: Optional[Sequence[float]] = IMAGENET_MEAN  # None: images used as they come
    std: Optional[Sequence[float]] = IMAGENET_STD
    task: Any = None  # a task.Task: what the outputs mean (default single-label)


def load_trained_model(args, create_model, make_task):
    """The trained model of --weights, made by the user's ``create_model`` (model.py) and
    loaded strictly, with its image size, class names (from the run's args.json and
    class_indices.json unless given), what its images are, and its task (``make_task`` of
    the run's, as the run left it)."""
    name, img_size, classes = read_run_settings(args.weights, args.model, args.img_size, args.class_indices)
    images = read_run_images(args.weights)
    spec = ModelSpec(create_model, name, len(classes), img_size, images["channels"])
    check_input_size(spec)
    model = spec.build()
    load_exact_weights(model, load_state_dict_file(args.weights), f"--weights {args.weights}")
    run_dir = os.path.dirname(os.path.abspath(args.weights))
    task = make_task(task_of_run(read_run_args(run_dir))).read_run_files(run_dir, classes)
    return TrainedModel(model.eval(), name, img_size, classes, channels=images["channels"], mean=images["mean"],
                        std=images["std"], task=task)
