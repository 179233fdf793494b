"""Batches for training and evaluation: the samplers, the loaders, and the seeding of each item.

The seeding makes a rerun or a resume draw the same augmentations, whichever worker or rank
loads an image. The training batches know where a run stands inside an epoch (a resume goes
on from there); --sampler balanced and --class-weights balanced answer imbalanced classes;
MixUp and CutMix mix training batches.
"""
import math
import random
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler
from torchvision.transforms import v2
from tqdm import tqdm

from multi_train_utils.distributed_utils import get_rank, get_world_size
from multi_train_utils.errors import UserError, reset_in_worker


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


# No tqdm monitor thread: it starts and stops with the progress bars, just before a loader forks
# its workers, and on Python 3.11 a fork while another thread starts or exits can leave the
# child waiting forever on the interpreter's lock (seen as a validation worker that never
# delivers). The monitor only lowers a slow bar's refresh interval.
tqdm.monitor_interval = 0

# Workers of the validation loader: a short pass once an epoch, its workers started for each pass.
MAX_VAL_WORKERS = 2
# Seconds a loader waits for a worker's next batch before it gives up: a worker that hangs (a
# dead network file system, a lock inherited through fork) ends the run with one line
# (errors.loader_failure) instead of holding every rank forever. Far above any batch's time.
WORKER_TIMEOUT_SECONDS = 600.0


def stack_batch(batch):
    """The loaders' collate_fn: images stacked into one tensor, labels (class indices, or
    multi-hot rows) into another."""
    images, labels = tuple(zip(*batch))
    return torch.stack(images, dim=0), torch.stack(labels) if torch.is_tensor(labels[0]) else torch.as_tensor(labels)


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
        timeout=WORKER_TIMEOUT_SECONDS if workers > 0 else 0,
        collate_fn=stack_batch,
        worker_init_fn=reset_in_worker,
        # its own generator: creating the loader's iterator must not draw from the global
        # one, which seed_epoch sets for the model
        generator=torch.Generator().manual_seed(0),
    )


# --- Where a run stands inside an epoch, and the training batches from there on ---------------
# An epoch's training images are one global order (the shuffle, or the balanced draw, of
# (--seed, epoch)), padded as DistributedSampler pads for the world size W: rank r takes
# positions r, r + W, r + 2W, ..., so after s steps of B images the ranks together have trained
# exactly the first s x B x W positions. A checkpoint inside the epoch keeps that count
# (``done``) and where the epoch ends (``end``), so a resumed run, at any world size, trains
# positions done .. end - 1, each once: at the same world size in the same batches as an
# uninterrupted run, at another world size split anew (see ``remaining_batches``).

# BatchNorm in training needs more than one value per channel: a resumed epoch's last step,
# at another world size, gives every rank at least this many images (see remaining_batches).
MIN_IMAGES_PER_RANK = 2


@dataclass
class EpochPosition:
    """A point inside epoch ``epoch``: the first ``done`` positions of its global order
    (padded for ``order_world_size`` processes) are trained, of ``end``; ``step`` steps of
    this world size's batches; per rank, the epoch's summed training loss and the random
    generators' states; the run's training time so far."""

    epoch: int
    done: int
    end: int
    order_world_size: int
    step: int
    train_images: int  # the training set's length, which the order depends on
    loss_sums: List[float] = field(default_factory=list)  # per rank, over this epoch's steps so far
    loss_count: int = 0  # the (rank, step) losses summed in loss_sums
    rng: list = field(default_factory=list)  # per rank, checkpoint.rng_state()
    run_seconds: float = 0.0
    epoch_seconds: float = 0.0  # of this epoch, before the save

    def to_dict(self):
        return dict(vars(self))

    @classmethod
    def from_dict(cls, values):
        """The position a checkpoint holds (None: it was saved at an epoch's end)."""
        return cls(**values) if values else None


def padded_order(sampler, world_size):
    """The epoch's global order for ``world_size`` ranks (the sampler's epoch): DistributedSampler's
    shuffle, or BalancedDistributedSampler's draw, padded with its own first indices to a
    multiple of ``world_size``, as both pad; rank r's indices are positions r, r + W, ..."""
    if hasattr(sampler, "global_draw"):  # BalancedDistributedSampler
        order = sampler.global_draw()
    else:  # the same shuffle for one process is the whole order, unpadded
        one = DistributedSampler(sampler.dataset, num_replicas=1, rank=0, shuffle=sampler.shuffle, seed=sampler.seed)
        one.set_epoch(sampler.epoch)
        order = list(one)
    padding = math.ceil(len(order) / world_size) * world_size - len(order)
    return order + (order * math.ceil(padding / len(order)))[:padding]


def epoch_end(sampler_length, batch_size, world_size):
    """Positions an epoch trains: full batches of ``batch_size`` on every rank (the last
    incomplete batch of each rank is dropped)."""
    return sampler_length // batch_size * batch_size * world_size


def step_bounds(done, end, batch_size, world_size):
    """Where each step of positions ``done`` .. ``end`` - 1 starts, and ``end``: every step
    takes the next batch_size x world_size positions. A shorter last step must give each rank
    at least MIN_IMAGES_PER_RANK images, else it joins the step before; with no step before,
    there is no step (its positions are left out)."""
    per_step = batch_size * world_size
    starts = list(range(done, end, per_step))
    if starts and end - starts[-1] < per_step and (end - starts[-1]) // world_size < MIN_IMAGES_PER_RANK:
        starts.pop()
    return starts + [end] if starts else []


def remaining_batches(order, done, end, batch_size, world_size, rank):
    """Rank ``rank``'s batches for positions ``done`` .. ``end`` - 1 of ``order`` (``step_bounds``):
    in each step, every world_size-th position from ``rank``."""
    bounds = step_bounds(done, end, batch_size, world_size)
    return [order[start + rank:stop:world_size] for start, stop in zip(bounds, bounds[1:])]


class EpochBatchSampler(Sampler):
    """Rank ``rank``'s training batches (lists of ``(epoch, index)``: the epoch reaches the
    loader workers with each index, see ``loaders.SeededSamples``), ``batch_size`` at a time,
    each rank's last incomplete batch dropped; after ``resume_at``, the rest of that epoch.

    ``sampler``: DistributedSampler or BalancedDistributedSampler (``.epoch``, ``set_epoch``).
    """

    def __init__(self, sampler, batch_size, world_size=None, rank=None):
        self.sampler, self.batch_size = sampler, batch_size
        self.world_size = get_world_size() if world_size is None else world_size
        self.rank = get_rank() if rank is None else rank
        self.position: Optional[EpochPosition] = None

    @property
    def full_steps(self):
        """Steps in a whole epoch at this world size."""
        return len(self.sampler) // self.batch_size

    def dataset_length(self):
        """The training set's length (the sampler's, unpadded)."""
        sampler = self.sampler
        return sampler.size if hasattr(sampler, "global_draw") else len(sampler.dataset)

    def resume_at(self, position):
        """From now on, epoch ``position.epoch`` is only what remains of it."""
        self.position = position

    def resumed(self):
        """The position the current epoch resumes from, or None (a whole epoch)."""
        position = self.position
        return position if position is not None and position.epoch == self.sampler.epoch else None

    def _batches(self):
        position = self.resumed()
        if position is None:
            indices = list(self.sampler)
            return [indices[i:i + self.batch_size] for i in range(0, self.full_steps * self.batch_size,
                                                                   self.batch_size)]
        order = padded_order(self.sampler, position.order_world_size)
        return remaining_batches(order, position.done, position.end, self.batch_size, world_size=self.world_size,
                                 rank=self.rank)

    def first_step(self):
        """The number of this epoch's first step: 0, or after a resume the steps of this world
        size and batch size that the trained positions make (the checkpoint's own count where
        its steps were of this size; the schedule goes on from it)."""
        position = self.resumed()
        if position is None:
            return 0
        if position.order_world_size == self.world_size and \
                position.done == position.step * self.batch_size * self.world_size:
            return position.step
        return max(0, self.full_steps - len(self))

    def positions_done(self, steps):
        """Positions of the epoch's order trained after ``steps`` steps of this run (counted
        from its first step)."""
        position = self.resumed()
        start, end = (position.done, position.end) if position else (0, None)
        done = start + steps * self.batch_size * self.world_size
        return done if end is None else min(done, end)

    def position_after(self, steps, first_step, **figures):
        """The EpochPosition after ``steps`` steps of this epoch, this run having begun at
        ``first_step``; ``figures``: the loss count and the clocks."""
        return EpochPosition(epoch=self.sampler.epoch, done=self.positions_done(steps - first_step),
                             end=self.epoch_end(), order_world_size=self.order_world_size(), step=steps,
                             train_images=self.dataset_length(), **figures)

    def order_world_size(self):
        """The world size whose padding this epoch's order has."""
        position = self.resumed()
        return position.order_world_size if position else self.world_size

    def epoch_end(self):
        position = self.resumed()
        return position.end if position else epoch_end(len(self.sampler), self.batch_size, self.world_size)

    def __iter__(self):
        epoch = self.sampler.epoch
        return ([(epoch, index) for index in batch] for batch in self._batches())

    def __len__(self):
        position = self.resumed()
        if position is None:
            return self.full_steps
        return max(0, len(step_bounds(position.done, position.end, self.batch_size, self.world_size)) - 1)


# --- Imbalanced classes: a class-balanced sampler that works under DDP, and class weights for the loss ---
# ``BalancedDistributedSampler`` takes the place of ``DistributedSampler`` (inside
# ``EpochBatchSampler``): each epoch it makes one global draw with replacement, of
# the training set's length, in which every class is equally likely, seeded by (seed, epoch)
# alone, so that every rank draws the same and a resume repeats it; each rank then takes its
# own positions of that draw. Labels come from the dataset's ``targets`` (the split's labels for
# the built-in ``MyDataSet``), never from decoding images.

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
    ``EpochBatchSampler`` batches it unchanged.
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


# --- MixUp and CutMix of training batches, seeded so that a rerun or a resume mixes alike -----
# torchvision's ``v2.MixUp`` and ``v2.CutMix`` draw from torch's global CPU generator and refuse
# uint8 images, so they run here on the normalised float batch on the device, inside
# ``torch.random.fork_rng`` with the CPU generator seeded from (seed, epoch, step, rank): the
# global generators are left as they were, and each batch's mixing depends on nothing else.
# The targets become soft (one row of class probabilities per image, summing to 1), which
# ``nn.CrossEntropyLoss`` takes as they are. Multi-hot targets (a row of 0/1 per class) are mixed alike:
# lam y + (1 - lam) y' of the two images mixed (each entry from 0 to 1, for the BCE).

# Added to --seed so that the mixing is not the same stream as the model's or the augmentations'.
_MIX_SALT = 15_485_863


class BatchMixer:
    """``(images, labels) -> (mixed images, soft targets)`` with MixUp (``mixup_alpha`` > 0),
    CutMix (``cutmix_alpha`` > 0), or one of the two chosen at random for each batch (both)."""

    def __init__(self, num_classes, mixup_alpha=0.0, cutmix_alpha=0.0, seed=0, rank=0):
        if mixup_alpha <= 0 and cutmix_alpha <= 0:
            raise ValueError("BatchMixer needs mixup_alpha or cutmix_alpha above 0")
        self.alphas = (mixup_alpha, cutmix_alpha)
        self.mix = self._mixer(num_classes)
        self.seed, self.rank = seed, rank
        self._row_mixers = {}  # for multi-hot targets: by batch size

    def _mixer(self, num_classes):
        """torchvision's MixUp, CutMix, or a random choice of the two, for ``num_classes``."""
        mixup_alpha, cutmix_alpha = self.alphas
        choices = [v2.MixUp(alpha=mixup_alpha, num_classes=num_classes)] if mixup_alpha > 0 else []
        choices += [v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes)] if cutmix_alpha > 0 else []
        return choices[0] if len(choices) == 1 else v2.RandomChoice(choices)

    def _mix_rows(self, images, targets):
        """Multi-hot ``targets`` mixed as the images are: torchvision mixes labels 0..B-1 of a
        batch of B into a B x B matrix of how much of each image every mixed image holds (what
        it draws is the same as for class labels); that matrix times the targets."""
        size = len(images)
        mix = self._row_mixers.setdefault(size, self._mixer(size))
        images, weights = mix(images, torch.arange(size, device=images.device))
        return images, weights.to(targets.dtype) @ targets

    def __call__(self, images, labels, epoch, step):
        """The batch of ``step`` (counted from 0 in ``epoch``) mixed; the memory format of
        ``images`` is kept."""
        channels_last = images.dim() == 4 and images.is_contiguous(memory_format=torch.channels_last) \
            and not images.is_contiguous()
        with torch.random.fork_rng(devices=[]):  # the draws are on the CPU generator only
            # the CPU generator alone: torch.manual_seed would reseed every GPU's generator too
            torch.default_generator.manual_seed(sample_seed(sample_seed(self.seed + _MIX_SALT, epoch, step), self.rank, 0))
            images, targets = self._mix_rows(images, labels) if labels.ndim == 2 else self.mix(images, labels)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images, targets


def make_batch_mixer(recipe, num_classes, rank=None):
    """The BatchMixer of ``recipe``'s --mixup-alpha / --cutmix-alpha (seeded by --seed and the
    rank: this process's by default), or None when both are 0."""
    rank = get_rank() if rank is None else rank
    if recipe.mixup_alpha <= 0 and recipe.cutmix_alpha <= 0:
        return None
    return BatchMixer(num_classes, recipe.mixup_alpha, recipe.cutmix_alpha, recipe.seed, rank)
