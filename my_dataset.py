"""The datasets to train on, and their batches: ``build_datasets`` is the function to edit for your data.

What both training scripts need from a dataset (the contract):

- a map-style ``torch.utils.data.Dataset``: ``len(dataset)`` and ``dataset[i]``;
- ``dataset[i]`` is ``(image, label)``: ``image`` a CHW tensor with 3 channels, either uint8
  (0-255) or float in [0, 1], of the same size for every item (the transforms crop to
  --img-size), and ``label`` an int in ``range(len(classes))``. Do not normalise: the loop
  normalises with ImageNet's mean and std on the device;
- optional, ``dataset.targets``: the label of every item, in order (torchvision's
  ``ImageFolder`` has it). The start summary's images per class and class_distribution.png
  use it; without it they show the totals only.

Exact resume: the training loader asks each dataset item as ``(epoch, index)``, and
``SeededSamples`` seeds torch's CPU generator and Python's ``random`` from (--seed, epoch,
index) just for that item. Random transforms that draw from them (all of torchvision's do)
then repeat exactly on a rerun or a resume, whichever loader worker or rank loads the item.
NumPy's global generator is not seeded: a dataset that wants exact resume draws from torch
or ``random`` instead.
"""
import random
import sys
from typing import List, Mapping, NamedTuple, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from multi_train_utils.errors import MidRunError, UnreadableImage
from multi_train_utils.file_list import PathList, compact_labels, listed_once
from multi_train_utils.images import build_transforms, read_image_uint8, resize_size
from multi_train_utils.process import get_rank, get_world_size
from multi_train_utils.signals import reset_in_worker
from utils import read_label_files, read_split_data


class Datasets(NamedTuple):
    """What ``build_datasets`` returns."""

    train: Dataset
    val: Dataset
    classes: List[str]  # the name of each label, in label order
    skipped: Sequence[str] = ()  # files left out because they cannot be opened (a warning each)
    skip_reasons: Mapping[str, str] = {}  # {skipped file: why}; "not a readable image" where none is given
    notes: Sequence[str] = ()  # other warnings about the data, printed at the start (a class without val images)


def build_datasets(args):
    """The training and validation datasets and the class names. Edit this for your own data.

    Built in: the class folders of --data-path (split by --val-rate, or --val-path for the
    validation images), or the CSV label files --train-list / --val-list; as ``MyDataSet``
    with the transforms of ``multi_train_utils.images``. Any datasets that keep the contract
    at the top of this file work in their place, for example torchvision's ImageFolder on
    folders data/train and data/val (each with one sub-folder per class)::

        from torchvision.datasets import ImageFolder
        from torchvision.transforms import v2

        train_tf, val_tf = build_transforms(args.img_size, **augment_settings(args))  # on uint8 tensors
        train = ImageFolder("data/train", transform=v2.Compose([v2.ToImage(), train_tf]))
        val = ImageFolder("data/val", transform=v2.Compose([v2.ToImage(), val_tf]))
        return Datasets(train, val, train.classes)  # val.classes must be the same

    Errors a user can fix (a missing folder, a bad file) should be ``UserError``s: one line.
    """
    check = getattr(args, "check_images", False)  # open every image first (slow on large data)
    if args.train_list:
        split = listed_once(lambda: read_label_files(args.train_list, args.val_list, args.val_rate, args.seed, check))
    else:
        split = listed_once(lambda: read_split_data(args.data_path, args.val_rate, args.seed, args.val_path, check))
    return image_file_datasets(split, args.img_size, augment_settings(args))


def augment_settings(args):
    """build_transforms' keyword arguments from the flags (--auto-augment, --random-erase,
    --val-resize-size); flags a dataset's args lack keep their defaults."""
    return {"auto_augment": getattr(args, "auto_augment", "none"), "random_erase": getattr(args, "random_erase", 0.0),
            "val_resize_size": getattr(args, "val_resize_size", None)}


def image_file_datasets(split, img_size, augment=None):
    """The built-in datasets of a split (lists of image files and labels) at ``img_size``;
    ``augment``: build_transforms' keyword arguments."""
    augment = augment or {}
    train_transform, val_transform = build_transforms(img_size, **augment)
    # Large JPEGs are decoded at reduced size: training keeps twice the crop size (random
    # crops of a quarter of the image or more lose nothing), validation its resize size.
    val_side = augment.get("val_resize_size") or resize_size(img_size)
    train = MyDataSet(split.train_images_path, split.train_images_label, train_transform, keep_side=2 * img_size,
                      if_unreadable="replace")
    val = MyDataSet(split.val_images_path, split.val_images_label, val_transform, keep_side=val_side,
                    if_unreadable="leave out")
    return Datasets(train, val, split.classes, skipped=split.skipped, skip_reasons=split.skip_reasons, notes=split.notes)


# A file the loader cannot read: "stop" the run, "replace" it by the next readable image
# (training), or "leave out" (validation: the label -1, which evaluation does not count).
IF_UNREADABLE = ("stop", "replace", "leave out")
# This many unreadable files in a row stop the run: the data itself is likely gone.
MAX_UNREADABLE_IN_A_ROW = 10
LEFT_OUT = -1  # the label of an image left out of validation


class MyDataSet(Dataset):
    """Images and labels from lists of paths, as ``utils.read_split_data`` returns them.

    Items are (uint8 image tensor, label): the transforms augment uint8 tensors, and the
    training loop converts to float and normalises on the device (fewer bytes to copy).
    ``keep_side`` lets large JPEGs be decoded at reduced size (see ``images.read_image_uint8``).
    Paths and labels are held compactly (``file_list.PathList``), so that forked loader
    workers do not copy them. ``if_unreadable`` (one of IF_UNREADABLE) says what an image
    that cannot be read or decoded does; each one met is a warning line naming it, on stderr
    (stdout may hold a progress bar's unfinished line).
    """

    def __init__(self, images_path, images_class, transform=None, keep_side=None, if_unreadable="stop"):
        if if_unreadable not in IF_UNREADABLE:
            raise ValueError(f"if_unreadable={if_unreadable!r}: one of {IF_UNREADABLE}")
        self.images_path = images_path if isinstance(images_path, PathList) else PathList(images_path)
        self.images_class = compact_labels(images_class)
        self.transform = transform
        self.keep_side = keep_side
        self.if_unreadable = if_unreadable

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
                return self._placeholder(), LEFT_OUT
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
        img = read_image_uint8(self.images_path[index], self.keep_side)
        return (self.transform(img) if self.transform is not None else img), int(self.images_class[index])

    def _placeholder(self):
        """A black image of the size the transform gives (what an image left out occupies in its batch)."""
        image = torch.zeros(3, 1, 1, dtype=torch.uint8)
        return self.transform(image) if self.transform is not None else image


class SeededSamples(Dataset):
    """``dataset`` whose items may be asked as ``(epoch, index)``: the item's random
    augmentation is then drawn from torch's CPU generator and Python's ``random``, both
    seeded by (seed, epoch, index) for that item alone (the global states are put back)."""

    def __init__(self, dataset, seed=0):
        self.dataset = dataset
        self.seed = seed

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, item):
        if not isinstance(item, tuple):
            return self.dataset[item]
        epoch, index = item
        python_state = random.getstate()
        try:
            with torch.random.fork_rng(devices=[]):  # the CPU generator only
                seed = sample_seed(self.seed, epoch, index)
                torch.default_generator.manual_seed(seed)
                random.seed(seed)
                return self.dataset[index]
        finally:
            random.setstate(python_state)


def sample_seed(seed, epoch, index):
    """A 63-bit seed that differs for every (seed, epoch, index)."""
    return ((seed * 1_000_003 + epoch) * 1_000_003 + index) % (2**63)


def seed_epoch(seed, epoch, rank=None):
    """Seed the global generators (CPU and GPUs) from (seed, epoch, rank) at the start of an
    epoch (``rank``: this process's by default): what the model draws (dropout, stochastic
    depth) then repeats on a rerun or a resume, without depending on saved generator states
    or the number of loader workers."""
    torch.manual_seed(sample_seed(seed + 7919, epoch, get_rank() if rank is None else rank))


class EpochIndexSampler(Sampler):
    """Yields ``(epoch, index)`` pairs from a sampler that has ``.epoch`` (DistributedSampler).

    The epoch reaches the loader workers with each index, so even persistent workers draw
    each epoch's augmentations afresh (see ``SeededSamples``).
    """

    def __init__(self, sampler):
        self.sampler = sampler

    def __iter__(self):
        epoch = self.sampler.epoch
        return ((epoch, index) for index in self.sampler)

    def __len__(self):
        return len(self.sampler)


class ShardSampler(Sampler):
    """Rank ``rank`` of ``world_size`` gets indices rank, rank + world_size, ...: no padding.

    DistributedSampler pads (repeats images) so that every rank gets as many; evaluation
    uses this instead so that every validation image is counted exactly once.
    """

    def __init__(self, num_samples, rank=None, world_size=None):  # default: this process's
        rank = get_rank() if rank is None else rank
        world_size = get_world_size() if world_size is None else world_size
        self.indices = list(range(rank, num_samples, world_size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


# Workers of the validation loader: a short pass once an epoch, its workers started for each pass.
MAX_VAL_WORKERS = 2


def stack_batch(batch):
    """The loaders' collate_fn: images stacked into one tensor, labels into another."""
    images, labels = tuple(zip(*batch))
    return torch.stack(images, dim=0), torch.as_tensor(labels)


def make_loader(dataset, batch_sampler, workers, device, validation=False):
    """A DataLoader over a batch sampler. Training: ``workers``, kept alive between epochs.
    ``validation``: at most MAX_VAL_WORKERS, started for each pass (a short pass: more
    workers, kept alive, would only hold memory and processes, per rank, all epoch long)."""
    persistent = not validation
    workers = min(workers, MAX_VAL_WORKERS) if validation else workers
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=workers,
        pin_memory=device.type == "cuda",
        persistent_workers=persistent and workers > 0,
        collate_fn=stack_batch,
        worker_init_fn=reset_in_worker,
        # its own generator: creating the loader's iterator must not draw from the global
        # one, which seed_epoch sets for the model
        generator=torch.Generator().manual_seed(0),
    )

