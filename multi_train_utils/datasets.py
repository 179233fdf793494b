"""The datasets a run trains on: what build_datasets returns, and the built-in dataset of image files.

``Datasets`` holds the two datasets, the class names and what the images are (channels, mean,
std); ``MyDataSet`` reads image files with their labels."""
import sys
from typing import List, Mapping, NamedTuple, Optional, Sequence

import torch
from torch.utils.data import Dataset

from multi_train_utils.errors import MidRunError, UnreadableImage, UserError
from multi_train_utils.file_list import PathList, compact_labels
from multi_train_utils.images import IMAGENET_MEAN, IMAGENET_STD, MODES, build_transforms, read_image_uint8, resize_size


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
    Paths and labels are held compactly (``file_list.PathList``), so that forked loader
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


