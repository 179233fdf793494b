"""Where a run stands inside an epoch, and the training batches from there on.

An epoch's training images are one global order (the shuffle, or the balanced draw, of
(--seed, epoch)), padded as DistributedSampler pads for the world size W: rank r takes
positions r, r + W, r + 2W, ..., so after s steps of B images the ranks together have trained
exactly the first s x B x W positions. A checkpoint inside the epoch keeps that count
(``done``) and where the epoch ends (``end``), so a resumed run, at any world size, trains
positions done .. end - 1, each once: at the same world size in the same batches as an
uninterrupted run, at another world size split anew (see ``remaining_batches``).
"""
import math
from dataclasses import dataclass, field
from typing import List, Optional

from torch.utils.data import DistributedSampler, Sampler

from multi_train_utils.process import get_rank, get_world_size

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
    if hasattr(sampler, "global_draw"):  # balance.BalancedDistributedSampler
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
