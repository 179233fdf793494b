"""Imbalanced classes: a class-balanced sampler that works under DDP, and class weights for the loss.

``BalancedDistributedSampler`` takes the place of ``DistributedSampler`` (inside
``epoch_position.EpochBatchSampler``): each epoch it makes one global draw with replacement, of
the training set's length, in which every class is equally likely, seeded by (seed, epoch)
alone, so that every rank draws the same and a resume repeats it; each rank then takes its
own positions of that draw. Labels come from the dataset's ``targets`` (the split's labels for
the built-in ``MyDataSet``), never from decoding images.
"""
import math
from typing import NamedTuple, Optional

import numpy as np
import torch
from torch.utils.data import DistributedSampler, Sampler

from multi_train_utils.errors import UserError
from multi_train_utils.process import get_rank, get_world_size
from multi_train_utils.loaders import sample_seed

# Added to --seed so that the balanced draw is not the same stream as the model's or the
# augmentations' seeds of the same (seed, epoch).
_DRAW_SALT = 104_729


def is_multi_hot(targets):
    """Whether ``targets`` (a dataset's, or a batch's labels) are rows of one 0/1 entry per class."""
    return getattr(targets, "ndim", 1) == 2


def positives_per_class(targets):
    """Images of each class (the column sums of the multi-hot ``targets``), as a list of ints."""
    return np.asarray(targets).astype(np.int64).sum(axis=0).tolist()


def labels_per_image(targets):
    """How many classes each image carries (of multi-hot ``targets``), as an int64 array."""
    return np.asarray(targets).astype(np.int64).sum(axis=1)


def training_labels(dataset):
    """The label of every item of ``dataset`` (a ``SeededSamples`` is unwrapped), from its
    ``targets`` (multi-hot: an images x classes array); ``None`` where the dataset has none.
    Never reads an image."""
    while not hasattr(dataset, "targets") and hasattr(dataset, "dataset"):
        dataset = dataset.dataset  # SeededSamples, torch's Subset-like wrappers
    targets = getattr(dataset, "targets", None)
    if targets is None:
        return None
    if is_multi_hot(targets):  # several classes an image: the images x classes array itself
        labels = np.asarray(targets)
    else:
        labels = targets.tolist() if isinstance(targets, np.ndarray) else [int(y) for y in targets]
    if len(labels) != len(dataset):
        raise UserError(f"a dataset of {len(dataset)} items has {len(labels)} targets: "
                        "targets must give the label of every item, in order")
    return labels


def required_labels(dataset, flag):
    """``training_labels(dataset)``, or a UserError naming ``flag`` when the dataset has no targets."""
    labels = training_labels(dataset)
    if labels is None:
        raise UserError(f"{flag}: the training dataset has no .targets (the label of every item, in order); "
                        "give it one (see the contract in my_dataset.py) or leave the flag out")
    return labels


def make_train_sampler(recipe, dataset, num_replicas=None, rank=None):
    """The training sampler of rank ``rank`` of ``num_replicas`` (default: this process's, 0
    of 1 without a process group), as ``recipe`` (the flags' section) asks: DistributedSampler's
    shuffle seeded by (--seed, epoch), or with --sampler balanced a BalancedDistributedSampler
    (a class-balanced draw with replacement, seeded alike)."""
    num_replicas = get_world_size() if num_replicas is None else num_replicas
    rank = get_rank() if rank is None else rank
    if recipe.sampler == "balanced":
        return BalancedDistributedSampler(required_labels(dataset, "--sampler balanced"), num_replicas=num_replicas,
                                          rank=rank, seed=recipe.seed)
    return DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, seed=recipe.seed)


def imbalance_warning(recipe, counts, classes, remedy="--sampler balanced or --class-weights balanced"):
    """The start summary's warning line for training ``counts`` per class, or None (balanced
    enough, or ``recipe``'s --sampler / --class-weights balanced already given); ``remedy``: the flags that
    help (where an image has several classes, the class weights alone)."""
    if recipe.sampler != "shuffle" or recipe.class_weights != "none":
        return None
    imbalance = find_imbalance_in_counts(counts, classes)
    return None if imbalance is None else imbalance.warning(remedy)


def loss_class_weights(task, flag, dataset, num_classes):
    """--class-weights ``flag``: for balanced, ``task``'s weights of the training labels
    (one class an image: ``class_weights``; several: each class's positive weight); None for none."""
    if flag != "balanced":
        return None
    return task.class_weights(required_labels(dataset, "--class-weights balanced"), num_classes)


def label_counts(labels, num_classes):
    """Images per class, as a list of ``num_classes`` ints; a label outside the classes is an error."""
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    outside = labels[(labels < 0) | (labels >= num_classes)]
    if len(outside):
        raise ValueError(f"label {outside[0]} is not one of the {num_classes} classes (0 to {num_classes - 1})")
    return np.bincount(labels, minlength=num_classes).tolist()


def class_weights(labels, num_classes):
    """Loss weights for ``--class-weights balanced``: n_samples / (n_classes * count_c), as
    scikit-learn's "balanced" (a class of average size gets 1, a rarer one more), as a float32
    tensor for ``nn.CrossEntropyLoss(weight=...)``.

    A class without training images gets weight 0, not an error and not infinity: no target
    of it can occur, so its weight only matters to label smoothing's spread over all classes,
    where an infinite weight would turn the loss into NaN.
    """
    counts = label_counts(labels, num_classes)
    n = len(labels)
    return torch.tensor([n / (num_classes * c) if c else 0.0 for c in counts], dtype=torch.float32)


class Imbalance(NamedTuple):
    """The largest and the smallest class of an imbalanced training set."""

    largest: str
    largest_count: int
    smallest: str
    smallest_count: int

    def warning(self, flags="--sampler balanced or --class-weights balanced"):
        """The start summary's line: what is imbalanced, and the ``flags`` that help."""
        return (f"the classes are imbalanced: {self.largest} has {self.largest_count} training images, "
                f"{self.smallest} {self.smallest_count}; consider {flags}")


def find_imbalance(labels, classes, ratio=3.0) -> Optional[Imbalance]:
    """The largest and smallest class (names and counts) where the largest has more than
    ``ratio`` times the images of the smallest, else ``None``. Ties go to the first class in
    label order; a class without images is the smallest (any other class is then "more")."""
    return find_imbalance_in_counts(label_counts(labels, len(classes)), classes, ratio)


def find_imbalance_in_counts(counts, classes, ratio=3.0) -> Optional[Imbalance]:
    """``find_imbalance`` of images per class (``counts``, in class order)."""
    big = max(range(len(counts)), key=lambda c: (counts[c], -c))
    small = min(range(len(counts)), key=lambda c: (counts[c], c))
    if counts[big] > ratio * counts[small]:
        return Imbalance(classes[big], counts[big], classes[small], counts[small])
    return None


class BalancedDistributedSampler(Sampler):
    """Class-balanced sampling for one rank of ``num_replicas``, with replacement.

    Each epoch: one draw of ``len(labels)`` indices in which every class (that has images) is
    equally likely and, within a class, every image; the same on every rank, because it is
    seeded by (seed, epoch) alone. As ``DistributedSampler`` (drop_last=False) does, the draw
    is padded with its own first indices to a multiple of ``num_replicas``, and rank r takes
    positions r, r + num_replicas, ...: ranks get disjoint positions of one draw, together
    all of it. ``set_epoch`` and ``.epoch`` as DistributedSampler's, so
    ``epoch_position.EpochBatchSampler`` batches it unchanged.
    """

    def __init__(self, labels, num_replicas=1, rank=0, seed=0):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in 0 to {num_replicas - 1}")
        labels = torch.as_tensor([int(y) for y in labels], dtype=torch.long)
        if labels.numel() == 0:
            raise ValueError("no labels: nothing to sample")
        self.num_replicas, self.rank, self.seed, self.epoch = num_replicas, rank, seed, 0
        self.size = labels.numel()
        self.num_samples = math.ceil(self.size / num_replicas)
        self.total_size = self.num_samples * num_replicas
        # Indices grouped by class (stable: in dataset order), with each present class's
        # start and count: a draw is then a class, uniformly, and an image within it.
        self.by_class = torch.argsort(labels, stable=True)
        self.counts = torch.unique_consecutive(labels[self.by_class], return_counts=True)[1]
        self.starts = torch.cumsum(self.counts, 0) - self.counts

    def set_epoch(self, epoch):
        """The epoch whose draw ``__iter__`` gives next."""
        self.epoch = epoch

    def global_draw(self):
        """This epoch's draw for all ranks (before padding): ``len(labels)`` dataset indices."""
        g = torch.Generator()
        g.manual_seed(sample_seed(self.seed + _DRAW_SALT, self.epoch, 0))
        # Two steps instead of torch.multinomial over 1/count per image: the same
        # distribution, and no limit of 2**24 images.
        cls = torch.randint(len(self.counts), (self.size,), generator=g)
        within = (torch.rand(self.size, generator=g, dtype=torch.float64) * self.counts[cls]).long()
        within = torch.minimum(within, self.counts[cls] - 1)  # rand * count rounds up to count in rare cases
        return self.by_class[self.starts[cls] + within].tolist()

    def __iter__(self):
        indices = self.global_draw()
        padding = self.total_size - len(indices)
        indices += (indices * math.ceil(padding / len(indices)))[:padding]  # as DistributedSampler pads
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self):
        return self.num_samples
