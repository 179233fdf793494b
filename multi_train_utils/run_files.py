"""A run's files: what it reads and checks before it starts, and the reader and writer of each.

Before anything is built: the data, --weights, --resume and --output-dir, checked on every
rank (``read_inputs``). In --output-dir: args.json, class_indices.json and metrics.csv; the
guard against overwriting an earlier run; the trained model of a run (its weights with those
files, or a torch.export program) for predict.py and export.py.
"""
import csv
import glob
import hashlib
import io
import json
import numbers
import os
import re
from typing import Any, List, NamedTuple, Optional, Sequence

import torch

from multi_train_utils.checkpoint import (CHECKPOINT, PREVIOUS_CHECKPOINT, check_resume_compatible,
                                          find_resume_checkpoint, resumes_in)
from multi_train_utils.datasets import (DEMO_MARKER, Datasets, MyDataSet, download_failure_marker,
                                        download_flower_photos, images_info, make_demo_dataset, wait_for_folder)
from multi_train_utils.distributed_utils import (check_on_every_rank, check_same_on_every_rank, current_job, get_rank,
                                                 get_world_size)
from multi_train_utils.errors import UserError, one_line, printable
from multi_train_utils.files import (FLAG, MAPPING_OR_NULL, NUMBER, RunLock, TEXT, TEXT_OR_NULL, WHOLE_NUMBER,
                                     WHOLE_NUMBER_OR_NULL, check_fields, lock_output_dir, read_json, write_bytes_atomic,
                                     write_csv_atomic, write_json_atomic)
from multi_train_utils.images import IMAGENET_MEAN, IMAGENET_STD, resize_size
from multi_train_utils.model_setup import (ModelSpec, check_input_size, load_exact_weights, load_state_dict_file,
                                           read_weights)


# --- A torch.export program (.pt2) as export.py writes and predict.py reads it ----------------
# The model's graph and weights, with the run's class names and preprocessing inside (RUN_FILE),
# so that it loads with torch alone.

SUFFIX = ".pt2"  # torch.export.load goes by it
RUN_FILE = "run.json"  # inside a .pt2 (and an ONNX file's metadata): the run's settings, RUN_KEYS and the rest
RUN_KEYS = ("model", "img_size", "val_resize_size", "mean", "std", "classes")  # a .pt2 must have them
# What an earlier export.py did not write, as its programs were: RGB, one class an image. The
# task says how the outputs read ("multi_label" before "task" was written); "thresholds": per
# class, where the task predicts by thresholds (None: its default).
EARLIER_PROGRAMS = {"channels": 3, "task": None, "multi_label": False, "thresholds": None}
# torch.export's dynamic_shapes of the one input: any batch size, the rest as the example's
ANY_BATCH = ({0: torch.export.Dim("batch", min=1)},)


def is_program(path):
    """Whether ``path`` names a torch.export program (by its .pt2 ending, as torch.export.load does)."""
    return str(path).endswith(SUFFIX)


def export_program(model, example, path, run):
    """torch.export ``model`` for image batches of any size like ``example`` and save it to
    ``path`` with ``run`` (a dict of RUN_KEYS) inside."""
    try:
        program = torch.export.export(model, (example,), dynamic_shapes=ANY_BATCH)
    except Exception as e:  # torch raises many types for what it cannot capture (data-dependent control flow, ...)
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]  # torch's first line says what; the rest, where
        raise UserError(f"torch.export cannot capture {run['model']} ({printable(why)}); see "
                        "https://pytorch.org/docs/stable/export.html for what it needs") from None
    buffer = io.BytesIO()
    torch.export.save(program, buffer, extra_files={RUN_FILE: run_json(run)})
    write_bytes_atomic(buffer.getvalue(), path)


def run_json(run):
    """The text of RUN_FILE: the keys of RUN_KEYS and EARLIER_PROGRAMS of ``run``."""
    run = {**EARLIER_PROGRAMS, **run}
    return json.dumps({key: run[key] for key in (*RUN_KEYS, *EARLIER_PROGRAMS)})


def load_program(path, device=None):
    """(the callable model, its run dict) of a .pt2 that export.py wrote, on ``device`` (CPU
    if None); a file that is not one is a UserError naming it."""
    extra = {RUN_FILE: ""}
    try:
        program = torch.export.load(path, extra_files=extra)
    except FileNotFoundError:
        raise UserError(f"--weights {printable(path)}: no such file (export one: python export.py --weights "
                        "model-best.pth)") from None
    except Exception as e:  # torch raises many types for a file that is not a program
        raise UserError(f"--weights {printable(path)}: not a torch.export program ({one_line(e)}); export one "
                        "with export.py") from None
    try:
        run = json.loads(extra[RUN_FILE])
        missing = [key for key in RUN_KEYS if key not in run]
    except (ValueError, TypeError):
        run, missing = {}, list(RUN_KEYS)
    if missing:
        raise UserError(f"--weights {printable(path)}: has no {RUN_FILE} with {', '.join(missing)} (a program "
                        "export.py did not write); export it again with export.py")
    if device is not None and device.type != "cpu":
        program = torch.export.passes.move_to_device_pass(program, device)
    return program.module(), {**EARLIER_PROGRAMS, **run}


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


def check_output_dir(output_dir, overwrite, resume_path=None, demo=False):
    """Refuse to start over an earlier run's checkpoints, unless --overwrite is given or this
    run resumes from the checkpoint in that very folder. ``demo``: this run is --demo, which
    says so where the earlier run was one too (its data is made once, its run is not)."""
    resuming_here = resumes_in(resume_path, output_dir)
    earlier = [f for f in earlier_run_files(output_dir) if f.endswith(".pth")]
    if earlier and not overwrite and not resuming_here:
        names = ", ".join(os.path.basename(f) for f in earlier[:3]) + (", ..." if len(earlier) > 3 else "")
        if demo and (read_run_args(output_dir) or {}).get("demo"):
            raise UserError(f"--output-dir {output_dir}: holds the run of an earlier --demo ({names}); the demo's data "
                            "is made once, and its run is kept: add --overwrite to train the demo again in its place, "
                            "or choose another --output-dir to keep both")
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


# --- Everything a training script reads and checks before it builds anything ------------------
# The data (made or downloaded first if asked, split, checked against the flags), --weights,
# --resume and --output-dir.

class RunInputs(NamedTuple):
    data: Datasets  # the training and validation datasets and the class names
    weights_state: Optional[dict]  # --weights, unless resuming
    resume_path: Optional[str]
    checkpoint: Optional[dict]  # the full checkpoint to resume from, or None for a fresh start
    output_lock: Optional[RunLock]  # this run's hold on --output-dir (the writing rank's), until it exits


def read_inputs(config, build_datasets, device, several_labels=False):
    """Lock --output-dir (rank 0: the one process that writes there), then build the
    datasets (``build_datasets()``: my_dataset.py's, handed the flags by the script;
    ``several_labels``: the task's labels are rows of 0/1 per class), read --weights and
    --resume and check --output-dir, as ``config`` (options.Config) asks:
    a UserError on bad input (which leaves nothing behind: the lock file
    goes again at exit if nothing was written).

    Every rank of a job checks the same input; if any finds a problem, all stop (the others
    with a line that points to its error), and they must agree on the checkpoint to resume.
    The checks come in three steps, each ended by the same all-reduce on every rank: a rank
    that refuses in one step never meets the others in another step's collective (the data's
    listing broadcasts from rank 0, see ``datasets.listed_once``).
    """
    job = current_job()
    local_rank, world_size, main = job.local_rank if job else 0, get_world_size(), get_rank() == 0
    # 1. the output folder, the checkpoint, the data made or downloaded: no collective inside
    lock, resume_path, checkpoint = check_on_every_rank(lambda: _prepare(config, local_rank, world_size, main), device)
    # 2. the datasets (a listing that rank 0 makes and broadcasts, and the checks of what they hold)
    data = check_on_every_rank(lambda: load_data(config, build_datasets, local_rank, world_size, prepared=True,
                                                 several_labels=several_labels), device)
    # 3. the checkpoint against the data, and --weights
    weights = check_on_every_rank(lambda: _check_resume_and_weights(config, data, resume_path, checkpoint, main),
                                  device)
    check_same_checkpoint(checkpoint, device)
    return RunInputs(data, weights, resume_path, checkpoint, lock)


def check_same_checkpoint(checkpoint, device):
    """Every rank resumes from the same checkpoint (or none): the same epoch, and the same
    images done inside the next one (a save inside epoch e + 1 has the epoch e of the save at
    e's end); else every rank stops."""
    check_same_on_every_rank(-1 if checkpoint is None else int(checkpoint["epoch"]), device,
                             "the checkpoint to resume from")
    position = (checkpoint or {}).get("position") or {}
    check_same_on_every_rank(int(position.get("done", -1)), device,
                             "the images done inside the epoch of the checkpoint to resume from (-1: none)")


def _prepare(config, local_rank=0, world_size=1, main=True):
    """Step 1 of read_inputs on one rank: (lock, resume path, checkpoint). ``main``: rank 0,
    which locks and warns; local rank 0 makes --demo's data or downloads (``prepare_data``)."""
    run = config.run
    lock = lock_output_dir(run.output_dir) if main and not run.eval_only else None  # released at exit
    resume_path, checkpoint = find_resume_checkpoint(run.resume, run.output_dir, main)
    if not run.eval_only:  # before --download or --demo fetch or write anything
        check_output_dir(run.output_dir, run.overwrite, resume_path, demo=config.data.demo)
    prepare_data(config.data, local_rank, world_size)
    return lock, resume_path, checkpoint


def _check_resume_and_weights(config, data, resume_path, checkpoint, main=True):
    """Step 3 of read_inputs: the checkpoint fits the data and the flags; --weights read (not when resuming)."""
    recipe = config.recipe
    if checkpoint is not None:
        # the task by its name, also of a checkpoint from before "task" was saved
        saved = {**checkpoint, "args": {**checkpoint["args"], "task": task_of_run(checkpoint["args"])}}
        check_resume_compatible(saved, resume_path, config.flags, data.classes, recipe.epochs)
        if main:
            warn_if_files_changed(checkpoint, resume_path, data)
    return read_weights(recipe.weights, recipe.model, progress=main) if recipe.weights and not checkpoint else None


FILE_LIST_VERSION = 2  # how file_list_fingerprint hashes (1: sorted lines of each file, before the compact list)


def file_list_fingerprint(data):
    """{"train": count, "val": count, "sha1": ..., "version": FILE_LIST_VERSION}: which files,
    with which labels and in which order, the run trains and validates on, for the checkpoint.
    Paths are taken relative to the folder that holds them all, so moving the data elsewhere
    changes nothing. None for datasets other than the built-in MyDataSet (no list of files).
    Hashes the compact arrays as they are: a fraction of a second for a million files."""
    if not (isinstance(getattr(data, "train", None), MyDataSet) and isinstance(getattr(data, "val", None), MyDataSet)):
        return None
    splits = [(split, dataset) for split, dataset in (("train", data.train), ("val", data.val)) if len(dataset)]
    if not splits:
        return None
    prefixes = [_absolute_prefix(dataset.images_path) for _, dataset in splits]
    top = os.path.dirname(os.path.commonprefix(prefixes))
    digest = hashlib.sha1()
    for (split, dataset), prefix in zip(splits, prefixes):
        paths = dataset.images_path
        digest.update(f"{split}\t{len(paths)}\t{os.path.relpath(prefix, top)}\n".encode("utf-8", "surrogateescape"))
        for array in (paths.data, paths.offsets, dataset.images_class):
            digest.update(array.tobytes())
    return {"train": len(data.train), "val": len(data.val), "sha1": digest.hexdigest(), "version": FILE_LIST_VERSION}


def _absolute_prefix(paths):
    """The prefix every path of the PathList ``paths`` starts with, made absolute."""
    prefix = os.fsdecode(paths.prefix)
    return os.path.abspath(prefix) + (os.sep if prefix.endswith(os.sep) or not prefix else "")


def warn_if_files_changed(checkpoint, path, data):
    """A warning when the data's files differ from those of the run the checkpoint continues
    (a checkpoint written before the fingerprint existed: nothing to compare)."""
    before, now = checkpoint["file_list"], file_list_fingerprint(data)
    if isinstance(before, dict) and now is not None and before.get("version") != now["version"]:
        now, before = {k: now[k] for k in ("train", "val")}, {k: before.get(k) for k in ("train", "val")}  # counts only
    if isinstance(before, dict) and now is not None and before != now:
        print(f"warning: --resume {path}: the data's files are not those the checkpoint was trained on "
              f"({before.get('train')} train + {before.get('val')} val images then, {now['train']} + {now['val']} "
              "now: files were added, removed, renamed or moved); training goes on with the files as they are now, "
              "so the run will not repeat the original exactly", flush=True)


def resume_hint(run):
    """What to tell a user whose run was interrupted (``run``: the flags' run section)."""
    if run.eval_only:
        return "the evaluation did not finish and wrote nothing; run the same command again"
    return (f"to continue from the last checkpoint (in {run.output_dir}/checkpoint.pth), "
            "run the same command with --resume auto")


def load_data(config, build_datasets, local_rank=0, world_size=1, prepared=False, several_labels=False):
    """Generate or download the data if asked (unless ``prepared``: done already, see
    ``prepare_data``), build the datasets (``build_datasets()``) and check them against the
    flags of ``config`` (and, for --eval-only, against the classes of the run that wrote
    --weights).

    Every rank runs this (it only reads), so every rank fails the same way on bad input.
    """
    # --eval-only: the data must have the classes in class_indices.json beside the weights
    flags, recipe, eval_only = config.data, config.recipe, config.run.eval_only
    expected_classes = read_run_classes(os.path.dirname(os.path.abspath(recipe.weights))) if eval_only else None
    if not prepared:
        prepare_data(flags, local_rank, world_size)
    try:
        data = build_datasets()
    except OSError as e:  # a folder or file that build_datasets (yours, maybe) did not find
        raise UserError(f"my_dataset.build_datasets: {e}; check --data-path (or where your datasets read)") from None
    check_datasets(data, several_labels)  # the task's labels: a class an image, or rows of 0/1
    found, where = len(data.classes), flags.train_list or flags.data_path
    if flags.num_classes is not None and flags.num_classes != found:
        raise UserError(
            f"--num-classes {flags.num_classes}: {where} has {found} {'classes' if flags.train_list else 'class folders'} "
            f"({', '.join(data.classes)}); drop the flag or fix the data"
        )
    if expected_classes is not None and expected_classes != list(data.classes):
        raise UserError(
            f"{'--train-list' if flags.train_list else '--data-path'} {where}: classes {list(data.classes)} differ from "
            f"the weights' class_indices.json {expected_classes}; evaluate on data with the same classes"
        )
    share = len(data.train) // world_size
    if not eval_only and share == 0:
        raise UserError(
            f"{world_size} processes but only {len(data.train)} training images; "
            "start fewer processes or add images"
        )
    if not eval_only and recipe.batch_size > share:
        raise UserError(
            f"--batch-size {recipe.batch_size}: each of the {world_size} process(es) gets only {share} of the "
            f"{len(data.train)} training images; use --batch-size {max(1, share)} or less"
        )
    return data


def prepare_data(flags, local_rank=0, world_size=1):
    """--demo's data made, or --download's fetched, by local rank 0; the others wait for it
    (``flags``: the data section)."""
    if flags.demo:
        if os.path.exists(flags.data_path) and not os.path.exists(os.path.join(flags.data_path, DEMO_MARKER)):
            raise UserError(f"--demo --data-path {flags.data_path}: that folder exists and is not demo data; "
                            "drop --data-path (demo data goes to data/demo) or run without --demo")
        if local_rank == 0:
            make_demo_dataset(flags.data_path)
        else:
            wait_for_folder(flags.data_path)
    if flags.download:
        marker = download_failure_marker(flags.data_path)
        if local_rank == 0:
            for stale in glob.glob(glob.escape(marker.rsplit("-", 1)[0]) + "-*"):
                os.remove(stale)
            try:
                download_flower_photos(flags.data_path)
            except UserError as e:
                if world_size > 1:  # tell the other local ranks, which wait for the folder
                    with open(marker, "w") as f:
                        f.write(str(e))
                raise
        else:
            wait_for_folder(flags.data_path, timeout_s=3600, failure_marker=marker)


def check_datasets(data, several_labels=False):
    """What my_dataset.py's contract asks, checked before training: two datasets and 2 or more
    class names; a mean and std of one value per channel; labels that fit the classes
    (``targets``, and the first item's label); and, for a dataset other than MyDataSet, a
    first item (image, label) with image a uint8 CHW tensor of ``data.channels`` channels or
    a float one (in [0, 1] unless the mean is None), label an integer, or with
    ``several_labels`` (--multi-label) a tensor of one 0/1 value per class."""
    if not all(hasattr(data, name) for name in ("train", "val", "classes")):
        raise UserError(f"my_dataset.build_datasets returned a {type(data).__name__}; return "
                        "Datasets(train, val, classes)")
    if len(data.classes) < 2:
        raise UserError(f"my_dataset.build_datasets: {len(data.classes)} class name(s) {list(data.classes)}; "
                        "a classifier needs at least 2")
    channels, mean, _ = images_info(data)
    _check_normalisation(data)
    for name, dataset in (("training", data.train), ("validation", data.val)):
        where = f"my_dataset.build_datasets: the {name} dataset"
        if len(dataset) == 0:
            raise UserError(f"{where} is empty")
        own_classes = getattr(dataset, "classes", None)
        if own_classes is not None and list(own_classes) != list(data.classes):
            raise UserError(f"{where} has the classes {list(own_classes)}, not {list(data.classes)}: its labels "
                            "would mean other classes; give both datasets the same class folders")
        if isinstance(dataset, MyDataSet):  # built in: its files and labels come from the split
            _check_label_kind(dataset.images_class.ndim == 2, several_labels, where)
            continue
        targets = getattr(dataset, "targets", None)
        if targets is not None:
            _check_label_kind(getattr(targets, "ndim", 1) == 2, several_labels, where)
            _check_labels(targets, len(data.classes), where, several_labels)
        item = dataset[0]
        image, label = item if isinstance(item, (tuple, list)) and len(item) == 2 else (item, None)
        if torch.is_tensor(label) and label.ndim == 1 and not several_labels:
            _check_label_kind(True, several_labels, where + "'s first item")
        if several_labels:
            _check_multi_hot_label(label, len(data.classes), where)
        is_label = isinstance(label, numbers.Integral) or (torch.is_tensor(label) and label.numel() == 1
                                                           and not label.is_floating_point()) or several_labels
        if torch.is_tensor(image) and image.ndim == 3 and image.shape[0] != channels and is_label:
            raise UserError(f"{where}'s first image has {image.shape[0]} channel{'s' * (image.shape[0] != 1)}, "
                            f"the data says {channels} (Datasets.channels); give Datasets(..., "
                            f"channels={image.shape[0]}) with a mean and std of as many values, or images of "
                            f"{channels}")
        if not (torch.is_tensor(image) and image.ndim == 3
                and (image.dtype == torch.uint8 or image.is_floating_point()) and is_label):
            found = (f"{type(image).__name__} {tuple(image.shape)} {image.dtype}" if torch.is_tensor(image)
                     else type(image).__name__)
            raise UserError(f"{where}'s items must be (image, label), image a uint8 or float CHW tensor with "
                            f"{channels} channel{'s' * (channels != 1)} (e.g. v2.ToImage() in its transform), label "
                            f"an int; its first image is a {found}, its label a {type(label).__name__}")
        if image.is_floating_point() and mean is not None and float(image.max()) > 1:
            raise UserError(f"{where}'s first image is float with values up to {float(image.max()):g}: give uint8 "
                            "images, or float ones in [0, 1] (v2.ToDtype(torch.float32, scale=True))")
        if not several_labels:
            _check_labels([int(label)], len(data.classes), where + "'s first item")


def _check_label_kind(multi_hot, several_labels, where):
    """Multi-hot labels with ``several_labels`` (--multi-label), class indices without."""
    if multi_hot and not several_labels:
        raise UserError(f"{where} has multi-hot labels (several classes an image): add --multi-label")
    if several_labels and not multi_hot:
        raise UserError(f"--multi-label: {where} has one class an image (class folders are single-label); give "
                        "--train-list with the header path,labels, or datasets whose labels are multi-hot")


def _check_multi_hot_label(label, num_classes, where):
    """A multi-hot item's label: a tensor of one value from 0 to 1 per class."""
    if not (torch.is_tensor(label) and label.shape == (num_classes,)):
        found = f"a tensor of shape {tuple(label.shape)}" if torch.is_tensor(label) else f"a {type(label).__name__}"
        raise UserError(f"--multi-label: {where}'s first label is {found}; give a float tensor of {num_classes} "
                        "values (one 0/1 value per class)")
    if label.numel() and not (0 <= float(label.min()) and float(label.max()) <= 1):
        raise UserError(f"--multi-label: {where}'s first label has values from {float(label.min()):g} to "
                        f"{float(label.max()):g}; give 0 or 1 per class")


def _check_normalisation(data):
    """Datasets.channels a whole number from 1; mean and std both given or both None, one
    value per channel, std positive."""
    channels, mean, std = images_info(data)
    where = "my_dataset.build_datasets: Datasets"
    if not isinstance(channels, int) or isinstance(channels, bool) or channels < 1:
        raise UserError(f"{where}.channels is {channels!r}: give the images' channels, a whole number from 1")
    if (mean is None) != (std is None):
        raise UserError(f"{where}.mean is {mean!r} but std is {std!r}: give both (one value per channel) or "
                        "both None (images used as they come)")
    for name, values in (("mean", mean), ("std", std)):
        if values is not None and len(values) != channels:
            raise UserError(f"{where}.{name} has {len(values)} value{'s' * (len(values) != 1)}, the images have "
                            f"{channels} channel{'s' * (channels != 1)}: give one value per channel")
    if std is not None and min(std) <= 0:
        raise UserError(f"{where}.std is {list(std)}: every value must be positive")


def _check_labels(labels, num_classes, where, several_labels=False):
    """Labels must be integers in range(num_classes); with ``several_labels``, targets an
    images x num_classes array of values from 0 to 1."""
    if several_labels:
        shape = tuple(getattr(labels, "shape", ()))
        if len(shape) != 2 or shape[1] != num_classes:
            raise UserError(f"{where}: its targets have the shape {shape}, not (images, {num_classes}): one row of "
                            "0/1 values per image, one value per class")
        return
    try:
        low, high = min(int(y) for y in labels), max(int(y) for y in labels)
    except (TypeError, ValueError):
        raise UserError(f"{where}: its labels (targets) must be integers 0 to {num_classes - 1}") from None
    if not 0 <= low <= high < num_classes:
        raise UserError(f"{where}: labels run from {low} to {high}, but there are {num_classes} classes "
                        f"(labels 0 to {num_classes - 1})")
