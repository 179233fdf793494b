"""Everything a training script reads and checks before it builds anything.

The data (made or downloaded first if asked, split, checked against the flags), --weights,
--resume and --output-dir.
"""
import glob
import hashlib
import numbers
import os
from typing import NamedTuple, Optional

import torch

from multi_train_utils.weights import read_weights
from multi_train_utils.checkpoint import check_resume_compatible, find_resume_checkpoint
from multi_train_utils.distributed_utils import check_on_every_rank, check_same_on_every_rank, current_job
from multi_train_utils.errors import UserError
from multi_train_utils.example_data import (DEMO_MARKER, download_failure_marker, download_flower_photos,
                                            make_demo_dataset, wait_for_folder)
from multi_train_utils.process import get_rank, get_world_size
from multi_train_utils.run_files import check_output_dir, read_run_classes
from multi_train_utils.run_lock import RunLock, lock_output_dir
from multi_train_utils.datasets import Datasets, MyDataSet, images_info


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
    listing broadcasts from rank 0, see ``file_list.listed_once``).
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
        check_output_dir(run.output_dir, run.overwrite, resume_path)
    prepare_data(config.data, local_rank, world_size)
    return lock, resume_path, checkpoint


def _check_resume_and_weights(config, data, resume_path, checkpoint, main=True):
    """Step 3 of read_inputs: the checkpoint fits the data and the flags; --weights read (not when resuming)."""
    recipe = config.recipe
    if checkpoint is not None:
        check_resume_compatible(checkpoint, resume_path, config.flags, data.classes, recipe.epochs)
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
