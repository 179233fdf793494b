"""The data a run trains on: its files and labels, their split, and the datasets built on them.

``Datasets`` holds the two datasets, the class names and what the images are (channels, mean,
std); ``MyDataSet`` reads image files with their labels. Below them: the compact list of
files (listed once per job), class folders or label files split into train and val, and the
data to start with (the tutorial's flower_photos, --download; generated flowers, --demo).
"""
import csv
import glob
import hashlib
import math
import os
import random
import shutil
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from functools import partial
from typing import Dict, List, Mapping, NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image, ImageDraw, ImageFilter
from torch.utils.data import Dataset
from tqdm import tqdm

from multi_train_utils.distributed_utils import get_rank, get_world_size, is_dist_avail_and_initialized
from multi_train_utils.errors import MidRunError, UnreadableImage, UserError, printable
from multi_train_utils.images import (IMAGENET_MEAN, IMAGENET_STD, IMG_EXTENSIONS, MODES, build_transforms,
                                      find_image_files, list_entries, no_file_at, read_image_uint8, resize_size,
                                      unreadable_reason)


# --- The list of image files and labels: held compactly, and listed once per job --------------
# Loader workers are forked copies of their process. A Python list of a million path strings
# is copied into each worker page by page as the worker reads it (reading an object writes its
# reference count: pytorch/pytorch#13246). Here the paths are one byte array and one array of
# offsets, the labels one integer array (NumPy): what a worker reads has no reference count of
# its own, so its private memory stays flat over an epoch.
#
# ``listed_once`` makes rank 0 the only process that lists the folders: it sends the list to
# the other ranks as three tensors, so a job of 8 GPUs lists its data once, not 8 times at
# once on the same file system.

class PathList(Sequence):
    """A read-only sequence of paths (str) kept as one shared prefix, one uint8 array of the
    rest of every path and an int64 array of offsets into it."""

    def __init__(self, paths=()):
        paths = paths if isinstance(paths, list) else list(paths)
        if not paths:
            self._set(b"", np.zeros(0, dtype=np.uint8), np.zeros(1, dtype=np.int64))
            return
        prefix = os.path.commonprefix([min(paths), max(paths)])
        # the rest of every path in one string, separated by NUL (which no path holds), encoded
        # as the file system names them (surrogateescape: names that are not UTF-8 round-trip)
        joined = np.frombuffer(os.fsencode("\0".join([p[len(prefix):] for p in paths]) + "\0"), dtype=np.uint8)
        ends = np.flatnonzero(joined == 0)
        lengths = np.diff(ends, prepend=-1) - 1
        self._set(os.fsencode(prefix), joined[joined != 0], np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))

    def _set(self, prefix, data, offsets):
        self.prefix, self.data, self.offsets = prefix, data, offsets

    @classmethod
    def from_arrays(cls, prefix, data, offsets):
        """A PathList of arrays made by another one (``arrays()``)."""
        paths = cls.__new__(cls)
        paths._set(prefix, data, offsets)
        return paths

    def arrays(self):
        """(prefix bytes, uint8 data, int64 offsets): what ``from_arrays`` takes."""
        return self.prefix, self.data, self.offsets

    def __len__(self):
        return len(self.offsets) - 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"path {index} of {len(self)}")
        return os.fsdecode(self.prefix + self.data[self.offsets[index]:self.offsets[index + 1]].tobytes())

    def __eq__(self, other):
        return isinstance(other, Sequence) and len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __repr__(self):
        return f"PathList({len(self)} paths)"


def compact_labels(labels):
    """Labels as one int64 array (no Python int per item); multi-hot rows (a 2-D array) as they are."""
    if isinstance(labels, np.ndarray) and labels.ndim == 2:
        return labels
    return np.asarray(labels, dtype=np.int64).reshape(-1)


def multi_hot(labels, num_classes):
    """Lists of class indices as one uint8 array of multi-hot rows (images x classes)."""
    rows = np.zeros((len(labels), num_classes), dtype=np.uint8)
    for row, image_labels in zip(rows, labels):
        row[list(image_labels)] = 1
    return rows


def compact_split(split):
    """``split`` (utils.DataSplit) with its paths as PathLists and its labels as arrays (a
    multi-label split's as multi-hot rows)."""
    if split.several_labels:
        labels = [multi_hot(split.train_images_label, len(split.classes)),
                  multi_hot(split.val_images_label, len(split.classes))]
    else:
        labels = [compact_labels(split.train_images_label), compact_labels(split.val_images_label)]
    return split._replace(train_images_path=PathList(split.train_images_path), train_images_label=labels[0],
                          val_images_path=PathList(split.val_images_path), val_images_label=labels[1])


_ARRAYS = ("train_images_path", "train_images_label", "val_images_path", "val_images_label")


def listed_once(read_split):
    """``read_split()`` (which lists the data: ``read_split_data`` or ``read_label_files``) run
    by rank 0 alone, its DataSplit sent to every other rank; compact on every rank.

    A UserError on rank 0 reaches the others as a UserError that points to it. Nodes that do
    not share a file system get rank 0's list too: the data must be at the same path on each.
    """
    if not is_dist_avail_and_initialized() or get_world_size() == 1:
        return compact_split(read_split())
    error, split = None, None
    if get_rank() == 0:
        try:
            split = compact_split(read_split())
        except UserError as e:
            error = str(e)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    arrays = None if split is None else _arrays(split)
    # first the small part (error or class names, skipped files, array sizes), then the arrays
    header = [error, None if split is None else (split._replace(**dict.fromkeys(_ARRAYS)),
                                                 [(a.shape, a.dtype) for a in arrays])]
    dist.broadcast_object_list(header, src=0, device=device)
    error, rest = header
    if error is not None:
        raise UserError(error if get_rank() == 0 else "rank 0 could not list the data; see its error")
    small, sizes = rest
    arrays = arrays or [np.empty(shape, dtype=dtype) for shape, dtype in sizes]
    for array in arrays:
        tensor = torch.from_numpy(array)
        moved = tensor.to(device) if device is not None else tensor
        dist.broadcast(moved, src=0)
        if moved is not tensor:
            tensor.copy_(moved.cpu())
    return split if split is not None else _assemble(small, arrays)


def _arrays(split):
    """The seven arrays of a compact split, in a fixed order."""
    train_prefix, train_data, train_offsets = split.train_images_path.arrays()
    val_prefix, val_data, val_offsets = split.val_images_path.arrays()
    prefixes = np.frombuffer(len(train_prefix).to_bytes(8, "little") + train_prefix + val_prefix, dtype=np.uint8)
    return [prefixes.copy(), train_data, train_offsets, split.train_images_label, val_data, val_offsets,
            split.val_images_label]


def _assemble(small, arrays):
    prefixes, train_data, train_offsets, train_labels, val_data, val_offsets, val_labels = arrays
    cut = int.from_bytes(prefixes[:8].tobytes(), "little")
    train_prefix, val_prefix = prefixes[8:8 + cut].tobytes(), prefixes[8 + cut:].tobytes()
    return small._replace(train_images_path=PathList.from_arrays(train_prefix, train_data, train_offsets),
                          train_images_label=train_labels,
                          val_images_path=PathList.from_arrays(val_prefix, val_data, val_offsets),
                          val_images_label=val_labels)


class Datasets(NamedTuple):
    """What ``build_datasets`` returns."""

    train: Dataset
    val: Dataset
    classes: List[str]  # the name of each label, in label order
    skipped: Sequence[str] = ()  # files left out because they cannot be opened (a warning each)
    skip_reasons: Mapping[str, str] = {}  # {skipped file: why}; "not a readable image" where none is given
    notes: Sequence[str] = ()  # other warnings about the data, printed at the start (a class without val images)
    channels: int = 3  # of every image: 1 gray, 3 RGB, 4 RGB + near infrared, ...
    mean: Optional[Sequence[float]] = IMAGENET_MEAN  # per channel, of pixel values in [0, 1]; None: no normalising
    std: Optional[Sequence[float]] = IMAGENET_STD


def images_info(data):
    """(channels, mean, std) of ``data``: a Datasets' own, or for another value with train, val
    and classes (build_datasets may return its own), RGB with ImageNet's mean and std."""
    return (getattr(data, "channels", 3), getattr(data, "mean", IMAGENET_MEAN), getattr(data, "std", IMAGENET_STD))


def image_file_datasets(split, img_size, augment=None, channels=3, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """The built-in datasets of a split (lists of image files and labels) at ``img_size``;
    ``augment``: build_transforms' keyword arguments. Files are read with ``channels``
    channels (1: gray, 3: RGB, 4: RGBA), to be normalised with ``mean`` and ``std``."""
    if channels not in MODES:
        raise UserError(f"image_file_datasets(channels={channels}): image files are read as 1 (gray), 3 (RGB) or 4 "
                        f"(RGBA) channels; for {channels}, give build_datasets a dataset of your own")
    augment = augment or {}
    train_transform, val_transform = build_transforms(img_size, **augment, fill=mean)
    # Large JPEGs are decoded at reduced size: training keeps twice the crop size (random
    # crops of a quarter of the image or more lose nothing), validation its resize size.
    val_side = augment.get("val_resize_size") or resize_size(img_size)
    train = MyDataSet(split.train_images_path, split.train_images_label, train_transform, keep_side=2 * img_size,
                      if_unreadable="replace", channels=channels)
    val = MyDataSet(split.val_images_path, split.val_images_label, val_transform, keep_side=val_side,
                    if_unreadable="leave out", channels=channels)
    return Datasets(train, val, split.classes, skipped=split.skipped, skip_reasons=split.skip_reasons,
                    notes=split.notes, channels=channels, mean=mean, std=std)


# A file the loader cannot read: "stop" the run, "replace" it by the next readable image
# (training), or "leave out" (validation: the label -1, which evaluation does not count).
IF_UNREADABLE = ("stop", "replace", "leave out")
# This many unreadable files in a row stop the run: the data itself is likely gone.
MAX_UNREADABLE_IN_A_ROW = 10
LEFT_OUT = -1  # the label of an image left out of validation (multi-label: every entry of its row)


class MyDataSet(Dataset):
    """Images and labels from lists of paths, as ``utils.read_split_data`` returns them (the
    tutorial's dataset; my_dataset.py hands it out). Labels: class indices, or multi-hot rows
    (a 2-D array, --multi-label), given as float32 tensors.

    Items are (uint8 image tensor, label): the transforms augment uint8 tensors, and the
    training loop converts to float and normalises on the device (fewer bytes to copy).
    ``keep_side`` lets large JPEGs be decoded at reduced size (see ``images.read_image_uint8``).
    Paths and labels are held compactly (``PathList``), so that forked loader
    workers do not copy them. ``if_unreadable`` (one of IF_UNREADABLE) says what an image
    that cannot be read or decoded does; each one met is a warning line naming it, on stderr
    (stdout may hold a progress bar's unfinished line).
    """

    def __init__(self, images_path, images_class, transform=None, keep_side=None, if_unreadable="stop", channels=3):
        if if_unreadable not in IF_UNREADABLE:
            raise ValueError(f"if_unreadable={if_unreadable!r}: one of {IF_UNREADABLE}")
        self.images_path = images_path if isinstance(images_path, PathList) else PathList(images_path)
        self.images_class = compact_labels(images_class)
        self.transform = transform
        self.keep_side = keep_side
        self.if_unreadable = if_unreadable
        self.channels = channels

    @property
    def targets(self):
        """The label of every image (as torchvision's ImageFolder calls them), as one array."""
        return self.images_class

    def __len__(self):
        return len(self.images_path)

    def __getitem__(self, index):
        if self.if_unreadable == "stop":
            return self._load(index)
        if self.if_unreadable == "leave out":
            try:
                return self._load(index)
            except UnreadableImage as e:
                print(f"warning: {e}; left out of this validation", file=sys.stderr, flush=True)
                return self._placeholder(), self._label(index, left_out=True)
        return self._load_or_the_next(index)

    def _load_or_the_next(self, index):
        """Item ``index`` or, if its file cannot be read, the next readable one (a warning each),
        up to MAX_UNREADABLE_IN_A_ROW files."""
        first, tries = None, min(MAX_UNREADABLE_IN_A_ROW, len(self))
        for step in range(tries):
            try:
                return self._load((index + step) % len(self))
            except UnreadableImage as e:
                first = first or e
                print(f"warning: {e}; the next image of the training set takes its place", file=sys.stderr,
                      flush=True)
        raise MidRunError(f"{tries} images in a row cannot be read, from {first}: is the data still there (a folder "
                          "moved, a network file system gone)?")

    def _load(self, index):
        img = read_image_uint8(self.images_path[index], self.keep_side, self.channels)
        return (self.transform(img) if self.transform is not None else img), self._label(index)

    def _label(self, index, left_out=False):
        """The label of item ``index``: its class, or for multi-label data its multi-hot row as
        float32; LEFT_OUT (every entry of the row) for an image left out."""
        if self.images_class.ndim == 2:
            row = torch.from_numpy(self.images_class[index].astype("float32"))
            return row.fill_(LEFT_OUT) if left_out else row
        return LEFT_OUT if left_out else int(self.images_class[index])

    def _placeholder(self):
        """A black image of the size the transform gives (what an image left out occupies in its batch)."""
        image = torch.zeros(self.channels, 1, 1, dtype=torch.uint8)
        return self.transform(image) if self.transform is not None else image


# --- Which files, with which labels: class folders or CSV label files, and their train/val split ---
# The first steps of a file's way (utils.py's ``read_split_data`` and ``read_label_files`` are
# these); then ``datasets`` makes datasets of them, and ``images`` decodes and transforms.

MAX_NOTES = 5  # beyond this many classes without validation images, one line names a few

# The tutorial's data: 5 class folders, 3670 JPEGs (--download fetches and checks it).
FLOWER_PHOTOS_URL = "https://storage.googleapis.com/download.tensorflow.org/example_images/flower_photos.tgz"


class DataSplit(NamedTuple):
    """What ``split_class_folders`` found: the two splits, the class names and skipped files."""

    train_images_path: List[str]
    train_images_label: List[int]
    val_images_path: List[str]
    val_images_label: List[int]
    classes: List[str]
    skipped: List[str]  # files and folders left out: not readable as images, or symlink loops
    skip_reasons: Dict[str, str] = {}  # {skipped path: why}, e.g. "not a readable image: too many pixels ..."
    notes: List[str] = []  # other warnings: a class that gets no validation image
    several_labels: bool = False  # labels are lists of class indices (an image of several classes, or none)


def find_classes(root, flag="--data-path"):
    """Sorted class names: the visible sub-folders of ``root``."""
    return _class_folders(root, flag)[0]


def _class_folders(root, flag):
    """(sorted class names, {path: why} of the entries of ``root`` that cannot be followed)."""
    if not os.path.exists(root):
        raise UserError(
            f"{flag} {root}: no such folder. Put one sub-folder of images per class there, "
            f"e.g. flower_photos from {FLOWER_PHOTOS_URL} extracted to data/, or try --demo"
        )
    if not os.path.isdir(root):
        raise UserError(f"{flag} {root}: not a folder; give a folder with one sub-folder of images per class")
    try:
        entries = list_entries(root)
    except OSError as e:
        raise UserError(f"{flag} {root}: cannot be read ({e.strerror})") from None
    classes = [os.path.basename(path) for path in entries.folders]
    if not classes:
        raise UserError(f"{flag} {root}: no class folders inside; put the images of each class in a sub-folder")
    return classes, entries.problems


def list_images(folder):
    """Image files in ``folder`` and its sub-folders (see ``images.find_image_files``), sorted."""
    return sorted(find_image_files(folder).paths)


def readable_images(paths, reasons):
    """The files of ``paths`` that PIL opens as images (each is opened: slow on large data);
    why each other one is left out goes into ``reasons``."""
    readable = []
    for path in paths:
        reason = unreadable_reason(path)
        if reason is None:
            readable.append(path)
        else:
            reasons[path] = reason
    return readable


def _scan_class_folders(root, classes, flag, check_images=False):
    """Images (by extension; with ``check_images`` only those PIL opens) and labels of every
    class folder, sub-folders included; the skipped files with the reason of each. Fails on a
    class with no images."""
    images, labels, reasons = [], [], {}
    for label, name in enumerate(classes):
        folder = os.path.join(root, name)
        if not os.path.isdir(folder):
            raise UserError(f"{flag} {root}: class folder {name!r} is missing (the training data has it)")
        found = find_image_files(folder)
        reasons.update(found.problems)
        readable = sorted(found.paths)
        if check_images:
            readable = readable_images(readable, reasons)
        if not readable:
            raise UserError(
                f"{flag} {root}: class folder {name!r} has no images "
                f"({', '.join(IMG_EXTENSIONS)}); add images or remove the folder"
            )
        images += readable
        labels += [label] * len(readable)
    return images, labels, reasons


def split_class_folders(root, val_rate=0.2, seed=0, val_root=None, check_images=False):
    """Find the images of each class folder of ``root`` and split them into train and val.

    The split is stratified (``round(n * val_rate)`` images of each class go to val) and
    deterministic: files are sorted and shuffled with ``random.Random(seed)``, so it depends
    neither on ``os.listdir`` order nor on global random state. With ``val_root`` (same class
    folders) nothing is split: all of ``root`` trains and all of ``val_root`` validates.
    Images in sub-folders of a class folder belong to the class, as in torchvision's
    ImageFolder (symlinks followed, each real file once). No image is opened: files are found
    by their extension, as ImageFolder finds them, and a file that turns out unreadable is
    handled when the loader meets it (``datasets.MyDataSet``). With ``check_images`` every
    file is opened first and those PIL cannot open are skipped. Skipped files, and entries
    that cannot be followed (a symlink loop), are listed in ``skipped``, with the reason of
    each in ``skip_reasons``.
    """
    classes, skipped = _class_folders(root, "--data-path")
    if val_root is not None:
        val_classes, val_skipped = _class_folders(val_root, "--val-path")
        if val_classes != classes:
            raise UserError(
                f"--val-path {val_root}: class folders {val_classes} differ from --data-path's {classes}; "
                "use the same class folder names"
            )
        train_images, train_labels, reasons = _scan_class_folders(root, classes, "--data-path", check_images)
        val_images, val_labels, val_reasons = _scan_class_folders(val_root, classes, "--val-path", check_images)
        skipped.update({**reasons, **val_skipped, **val_reasons})
    else:
        images, labels, reasons = _scan_class_folders(root, classes, "--data-path", check_images)
        skipped.update(reasons)
        train_images, train_labels, val_images, val_labels = split_by_class(images, labels, classes, val_rate, seed)
    if len(classes) < 2:
        raise UserError(f"--data-path {root}: found 1 class folder ({classes[0]}); a classifier needs at least 2")
    if not val_images:
        raise UserError(
            f"--val-rate {val_rate}: the validation split of {len(train_images)} images is empty; "
            "raise --val-rate or give --val-path"
        )
    return _nonempty_split((train_images, train_labels), (val_images, val_labels), classes, skipped, val_rate)


def _nonempty_split(train, val, classes, skipped, val_rate, val_list=None):
    """The DataSplit of ``train`` and ``val`` (each: image paths, labels), unless --val-rate
    left no training images; a note for each class that gets no validation image.
    ``skipped``: {path: why}."""
    (train_images, train_labels), (val_images, val_labels) = train, val
    if not train_images:
        raise UserError(f"--val-rate {val_rate}: no images left for training; lower --val-rate")
    as_lists = lambda labels: [y if isinstance(y, list) else [y] for y in labels]  # noqa: E731 (multi-label: lists)
    train_counts = Counter(c for y in as_lists(train_labels) for c in y)
    notes, measured = [], "AP" if val_labels and isinstance(val_labels[0], list) else "accuracy"
    missing = sorted(set(range(len(classes))) - {c for y in as_lists(val_labels) for c in y})
    if len(missing) > MAX_NOTES:  # a thousand classes: one line, not one a class
        named = ", ".join(repr(classes[c]) for c in missing[:3])
        notes = [f"{len(missing)} classes get no validation image ({named}, ...): their {measured} is never measured; "
                 + ("list some of their images in --val-list" if val_list else "add images or raise --val-rate")]
        missing = []
    for label in missing:
        count = train_counts[label]
        why, fix = ((f"--val-list {val_list} lists none of its {count}", "list some of them there") if val_list else
                    (f"{count} image(s), round({count} x --val-rate {val_rate}) = 0", "add images or raise --val-rate"))
        notes.append(f"class {classes[label]!r} gets no validation image ({why}): its {measured} is never measured; "
                     f"{fix}")
    return DataSplit(train_images_path=train_images, train_images_label=train_labels, val_images_path=val_images,
                     val_images_label=val_labels, classes=classes, skipped=list(skipped), skip_reasons=dict(skipped),
                     notes=notes)


def split_by_class(images, labels, classes, val_rate, seed):
    """(train images, train labels, val images, val labels): ``round(n * val_rate)`` images of
    each class to val, chosen by ``random.Random(seed)`` among the sorted paths."""
    if not 0.0 <= val_rate < 1.0:
        raise UserError(f"--val-rate {val_rate}: must be at least 0 and below 1 (e.g. 0.2)")
    rng = random.Random(seed)
    train_images, train_labels, val_images, val_labels = [], [], [], []
    by_class = [[] for _ in classes]
    for path, label in zip(images, labels):
        by_class[label].append(path)
    for label, members in enumerate(by_class):
        rng.shuffle(members)
        n_val = int(round(len(members) * val_rate))
        if n_val and n_val == len(members):
            raise UserError(
                f"--val-rate {val_rate}: class {classes[label]!r} has only {len(members)} image(s), all of "
                "them would go to validation; lower --val-rate or add images"
            )
        val_set = set(members[:n_val])
        for path in sorted(members):
            if path in val_set:
                val_images.append(path)
                val_labels.append(label)
            else:
                train_images.append(path)
                train_labels.append(label)
    return train_images, train_labels, val_images, val_labels


def _label_names(cell, header, several_labels, where):
    """The class names of one row's label cell: the cell itself under the header path,label;
    under path,labels (or with --multi-label) its space-separated names, each once. Without
    --multi-label a row must name exactly one class."""
    if header == "label" and not several_labels:
        return (cell.strip(),) if cell.strip() else ()
    names = tuple(cell.split())
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise UserError(f"{where}: the label {twice[0]!r} is there twice; list each of an image's classes once")
    if len(names) > 1 and not several_labels:
        raise UserError(f"{where}: {len(names)} labels ({cell.strip()!r}): an image of several classes needs "
                        "--multi-label")
    return names


def check_utf8_text(path, flag, what):
    """A text file saved as UTF-16 or UTF-32 (a spreadsheet's "Unicode text": NUL bytes in
    every line) is refused in one line, before its bytes are read as UTF-8."""
    try:
        with open(path, "rb") as f:
            start = f.read(4096)
    except OSError:
        return  # the reader that follows says what is wrong
    if b"\x00" in start:
        kind = "UTF-16" if start[:2] in (b"\xff\xfe", b"\xfe\xff") else "UTF-16 or UTF-32"
        raise UserError(f"{flag} {printable(path)}: saved as {kind} text (NUL bytes); save it as UTF-8, {what}")


def _read_label_file(path, flag, several_labels=False):
    """[(image path, class names, line number)] of a CSV with a header ``path,label`` or
    ``path,labels`` (see ``_label_names``); image paths relative to the CSV's folder. A missing
    CSV, a wrong header or row, and a listed file that does not exist are errors naming the line."""
    header_text = "path,labels" if several_labels else "path,label"
    if not os.path.isfile(path):
        raise UserError(f"{flag} {path}: no such file; give a CSV file with the header {header_text}")
    check_utf8_text(path, flag, f"a CSV file with the header {header_text}")
    folder = os.path.dirname(os.path.abspath(path))
    rows, seen = [], {}
    try:
        # surrogateescape: a listed name that is not UTF-8 is read as the file system holds it
        with open(path, newline="", encoding="utf-8-sig", errors="surrogateescape") as f:
            reader = csv.reader(f)
            header = [h.strip() for h in next(reader, [])]
            if header not in (["path", "label"], ["path", "labels"]):
                raise UserError(f"{flag} {path}: the first line must be the header {header_text} "
                                f"(found {','.join(header) or 'an empty file'})")
            for row in reader:
                if not any(field.strip() for field in row):
                    continue  # a blank line
                where = f"{flag} {path}, line {reader.line_num}"
                names = _label_names(row[1], header[1], several_labels, where) if len(row) == 2 else None
                if names == () and row[0].strip() and header[1] == "labels" and not several_labels:
                    raise UserError(f"{where}: no label ({','.join(row)!r}): an image of no class needs --multi-label "
                                    "(the header says labels)")
                if names is None or not row[0].strip() or not (names or several_labels):
                    raise UserError(f"{where}: expected {header_text}; found {','.join(row)!r}")
                image = os.path.normpath(os.path.join(folder, row[0].strip()))
                if image in seen:
                    raise UserError(f"{where}: {image} is listed already on line {seen[image]}; list each image once")
                seen[image] = reader.line_num
                if no_file_at(image):
                    raise UserError(f"{where}: {image}: no such file; fix the path (relative to the CSV's folder) or "
                                    "remove the line")
                rows.append((image, names, reader.line_num))
    except (UnicodeDecodeError, csv.Error) as e:
        raise UserError(f"{flag} {path}: not a readable CSV file ({e})") from None
    if not rows:
        raise UserError(f"{flag} {path}: lists no images; add lines {header_text}")
    return rows


def _readable_rows(rows, classes, path, flag, check_images=False):
    """Images and labels (a list of class indices per image) of the rows (with
    ``check_images``, of those whose file opens as an image), and {skipped file: why}."""
    images, labels, skipped, label_of = [], [], {}, {name: label for label, name in enumerate(classes)}
    for image, names, line in rows:
        for name in names:
            if name not in label_of:
                raise UserError(f"{flag} {path}, line {line}: class {name!r} is not one of the training classes "
                                f"{classes}; fix the label or add the class to --train-list")
        if check_images and image not in readable_images([image], skipped):
            continue
        images.append(image)
        labels.append([label_of[name] for name in names])
    return images, labels, skipped


def split_at_random(images, labels, val_rate, seed):
    """(train images, train labels, val images, val labels): ``round(n * val_rate)`` of the
    images to val, chosen by ``random.Random(seed)``; each split in the listed order. For
    multi-label lists, where classes cannot each be split by themselves."""
    if not 0.0 <= val_rate < 1.0:
        raise UserError(f"--val-rate {val_rate}: must be at least 0 and below 1 (e.g. 0.2)")
    chosen = set(random.Random(seed).sample(range(len(images)), int(round(len(images) * val_rate))))
    parts = ([i for i in range(len(images)) if i not in chosen], sorted(chosen))
    return tuple(values for part in parts for values in ([images[i] for i in part], [labels[i] for i in part]))


def split_label_files(train_list, val_list=None, val_rate=0.2, seed=0, check_images=False, several_labels=False):
    """Images and labels listed in CSV files (header ``path,label``, the label a class name,
    paths relative to the CSV), as ``split_class_folders`` returns them for folders.

    The classes are the sorted labels of ``train_list``. Without ``val_list`` the training
    list is split as folders are (stratified, seeded). No image is opened, unless
    ``check_images``: then listed files that PIL cannot open are skipped (and listed in
    ``skipped``). A class of ``train_list`` left without images, a
    class in ``val_list`` that ``train_list`` lacks, and a missing file are errors.

    ``several_labels``: the header ``path,labels``, each row's classes separated by spaces (none:
    an image of no class); the classes are the sorted union of the training rows' classes, the
    labels lists of class indices, and without ``val_list`` the split is ``split_at_random``.
    """
    rows = _read_label_file(train_list, "--train-list", several_labels)
    classes = sorted({name for _, names, _ in rows for name in names})
    if len(classes) < 2:
        raise UserError(f"--train-list {train_list}: found {len(classes)} class{'es' * (len(classes) != 1)} "
                        f"({', '.join(classes) or 'no labels'}); a classifier needs at least 2")
    images, labels, skipped = _readable_rows(rows, classes, train_list, "--train-list", check_images)
    present = {label for image_labels in labels for label in image_labels}
    for label, name in enumerate(classes):
        if label not in present:
            raise UserError(f"--train-list {train_list}: class {name!r} has no readable images; "
                            "add images or remove its lines")
    if not several_labels:
        labels = [image_labels[0] for image_labels in labels]
    if val_list is None:
        split = split_at_random if several_labels else partial(split_by_class, classes=classes)
        train_images, train_labels, val_images, val_labels = split(images, labels, val_rate=val_rate, seed=seed)
    else:
        train_images, train_labels = images, labels
        val_rows = _read_label_file(val_list, "--val-list", several_labels)
        in_train = {image: line for image, _, line in rows}
        for image, _, line in val_rows:
            if image in in_train:
                raise UserError(f"--val-list {val_list}, line {line}: {image} is in --train-list too (line "
                                f"{in_train[image]}); validate on images the model does not train on")
        val_images, val_labels, val_skipped = _readable_rows(val_rows, classes, val_list, "--val-list", check_images)
        val_labels = val_labels if several_labels else [image_labels[0] for image_labels in val_labels]
        skipped.update(val_skipped)
    if not val_images:
        raise UserError(f"--val-rate {val_rate}: the validation split of {len(train_images)} images is empty; "
                        "raise --val-rate or give --val-list" if val_list is None else
                        f"--val-list {val_list}: none of its images can be read")
    return _nonempty_split((train_images, train_labels), (val_images, val_labels), classes, skipped,
                           val_rate=val_rate, val_list=val_list)._replace(several_labels=several_labels)


# --- Data to start with: the tutorial's flower_photos (--download) and generated demo flowers (--demo) ---
# The download is checked by size, SHA-256 and image counts; the demo data needs no network.

# As TensorFlow Datasets records them.
FLOWER_PHOTOS_BYTES = 228_813_984
FLOWER_PHOTOS_SHA256 = "4c54ace7911aaffe13a365c34f650e71dd5bf1be0a58b464e5a7183e3e595d9c"
FLOWER_PHOTOS_COUNTS = {"daisy": 633, "dandelion": 898, "roses": 641, "sunflowers": 699, "tulips": 799}


# --- Downloading flower_photos ----------------------------------------------------------------------

def download_flower_photos(root, url=FLOWER_PHOTOS_URL, size=FLOWER_PHOTOS_BYTES, sha256=FLOWER_PHOTOS_SHA256,
                           counts=FLOWER_PHOTOS_COUNTS):
    """Download flower_photos.tgz, check its size and SHA-256, and extract it to ``root``.

    Does nothing if ``root`` exists. The archive goes to a temporary file and is extracted
    into a temporary folder beside ``root``, renamed only when complete: a broken or
    half-finished download never looks like a dataset. Returns ``root``.
    """
    if os.path.isdir(root):
        return root
    parent = os.path.dirname(os.path.abspath(root))
    os.makedirs(parent, exist_ok=True)
    for stale in glob.glob(os.path.join(glob.escape(parent), ".flower_photos-*.tgz.part")):
        os.remove(stale)  # left by a download that was killed
    for stale in glob.glob(os.path.join(glob.escape(parent), ".extract-*")):
        shutil.rmtree(stale, ignore_errors=True)
    fd, archive = tempfile.mkstemp(prefix=".flower_photos-", suffix=".tgz.part", dir=parent)
    try:
        with os.fdopen(fd, "wb") as f:
            _fetch(url, f, size, root)
        check_archive(archive, size, sha256)
        extract_dataset(archive, root, counts)
    finally:
        os.remove(archive)
    return root


def download_failure_marker(root):
    """The file local rank 0 leaves when its download failed, so that the ranks waiting for
    ``root`` stop with its message instead of waiting (one name per job: its port)."""
    parent, name = os.path.split(os.path.abspath(root))
    return os.path.join(parent, f".{name}.download-failed-{os.environ.get('MASTER_PORT', '0')}")


def _fetch(url, file, size, root):
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            with tqdm(total=size, unit="B", unit_scale=True, unit_divisor=1024, desc="flower_photos.tgz") as bar:
                while True:
                    chunk = response.read(1 << 20)
                    if not chunk:
                        break
                    file.write(chunk)
                    bar.update(len(chunk))
    except urllib.error.HTTPError as e:
        raise UserError(f"--download: {url} answered HTTP {e.code} ({e.reason}); try again later") from None
    except (urllib.error.URLError, OSError) as e:
        parent = os.path.dirname(root) or "."
        raise UserError(
            f"--download: cannot fetch {url} ({getattr(e, 'reason', e)}). Offline? Download it by hand, then: "
            f"mkdir -p {parent} && tar xzf flower_photos.tgz -C {parent} (gives {parent}/flower_photos)") from None


def check_archive(path, size, sha256):
    """Raise UserError unless the file at ``path`` has ``size`` bytes and this SHA-256."""
    found = os.path.getsize(path)
    if found != size:
        raise UserError(f"--download: got {found:,} bytes, expected {size:,}; the download was cut short "
                        "or the file changed; try again")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != sha256:
        raise UserError(f"--download: SHA-256 {digest.hexdigest()} differs from the expected {sha256}; "
                        "the file is damaged or not the flower data; try again")


def extract_dataset(archive, root, counts=None):
    """Extract a .tgz holding one top folder of class folders to ``root``, atomically."""
    parent = os.path.dirname(os.path.abspath(root))
    tmp = tempfile.mkdtemp(prefix=".extract-", dir=parent)
    try:
        try:
            with tarfile.open(archive, "r:gz") as tar:
                tar.extractall(tmp, filter="data")  # no absolute paths, links out or device files
        except (tarfile.TarError, EOFError, OSError) as e:
            raise UserError(f"--download: the archive cannot be extracted ({e}); try again") from None
        tops = [d for d in os.listdir(tmp) if os.path.isdir(os.path.join(tmp, d))]
        if len(tops) != 1:
            raise UserError(f"--download: the archive holds {len(tops)} top folders, expected one")
        top = os.path.join(tmp, tops[0])
        for name, expected in (counts or {}).items():
            found = len(list_images(os.path.join(top, name))) if os.path.isdir(os.path.join(top, name)) else 0
            if found != expected:
                raise UserError(f"--download: {name} has {found} images, expected {expected}; try again")
        try:
            os.rename(top, root)
        except OSError:
            if not os.path.isdir(root):  # another node sharing the folder finishing first is fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- The offline demo dataset -------------------------------------------------------------

DEMO_MARKER = "GENERATED_BY_DEMO.txt"  # a file, so not a class folder

DEMO_CLASSES = {
    # name: (petal colour, centre colour, number of petals)
    "daisy": ((245, 245, 240), (230, 190, 40), 12),
    "dandelion": ((250, 215, 30), (235, 180, 20), 24),
    "roses": ((200, 25, 45), (140, 10, 30), 6),
    "sunflowers": ((255, 185, 15), (80, 45, 20), 16),
    "tulips": ((235, 90, 170), (250, 220, 120), 4),
}


def _draw_flower(rng, petal, centre, petals, size):
    """One flower-like picture: coloured petals around a centre on a green, noisy background."""

    def jitter(colour, amount=25):
        return tuple(max(0, min(255, c + rng.randint(-amount, amount))) for c in colour)

    w, h = size
    img = Image.new("RGB", size, jitter((60, 120, 50), 30))
    draw = ImageDraw.Draw(img)
    for _ in range(12):  # leaves and stems in the background
        x, y = rng.randrange(w), rng.randrange(h)
        r = rng.randint(min(w, h) // 12, min(w, h) // 5)
        draw.ellipse((x - r, y - r // 3, x + r, y + r // 3), fill=jitter((40, 100, 35), 30))
    cx, cy = w / 2 + rng.uniform(-0.15, 0.15) * w, h / 2 + rng.uniform(-0.15, 0.15) * h
    radius = min(w, h) * rng.uniform(0.28, 0.42)
    start = rng.uniform(0, 360)
    for k in range(petals):
        angle = math.radians(start + 360 * k / petals)
        px, py = cx + math.cos(angle) * radius * 0.6, cy + math.sin(angle) * radius * 0.6
        pr = radius * (0.45 if petals <= 6 else 0.3)
        draw.ellipse((px - pr, py - pr, px + pr, py + pr), fill=jitter(petal))
    cr = radius * 0.3
    draw.ellipse((cx - cr, cy - cr, cx + cr, cy + cr), fill=jitter(centre))
    return img.filter(ImageFilter.GaussianBlur(rng.uniform(0, 1.2)))


def make_demo_dataset(root, images_per_class=60, seed=0, min_size=120, max_size=320):
    """Write a small learnable flower-like dataset (5 class folders of JPEGs) to ``root``.

    Written into a temporary folder beside ``root`` and renamed, so a half-written dataset
    never looks like a finished one. Does nothing if ``root`` already exists.
    """
    if os.path.exists(root):
        return root
    parent = os.path.dirname(os.path.abspath(root))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".demo-", dir=parent)
    try:
        rng = random.Random(seed)
        for name, (petal, centre, petals) in DEMO_CLASSES.items():
            os.makedirs(os.path.join(tmp, name))
            for i in range(images_per_class):
                size = (rng.randint(min_size, max_size), rng.randint(min_size, max_size))
                img = _draw_flower(rng, petal, centre, petals, size)
                img.save(os.path.join(tmp, name, f"{name}_{i:04d}.jpg"), quality=90)
        with open(os.path.join(tmp, DEMO_MARKER), "w") as f:
            f.write("Generated flower-like images written by --demo; not real photos.\n")
        os.rename(tmp, root)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isdir(root):  # another process finishing first is fine
            raise
    return root


def wait_for_folder(path, timeout_s=600, failure_marker=None):
    """Wait until another process has created ``path`` (used by ranks that don't write data);
    stop with its message if that process left ``failure_marker`` instead."""
    deadline = time.monotonic() + timeout_s
    while not os.path.isdir(path):
        if failure_marker and os.path.exists(failure_marker):
            with open(failure_marker) as f:
                raise UserError(f.read().strip())
        if time.monotonic() > deadline:
            raise UserError(f"{path}: not created by local rank 0 within {timeout_s} s")
        time.sleep(0.2)
