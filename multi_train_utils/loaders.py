"""Batches for training and evaluation: the samplers, the loaders, and the seeding of each item.

The seeding makes a rerun or a resume draw the same augmentations, whichever worker or rank
loads an image."""
import random

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from tqdm import tqdm

from multi_train_utils.process import get_rank, get_world_size
from multi_train_utils.signals import reset_in_worker


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

