"""The dataset of image files and the samplers that feed it."""
import torch
from torch.utils.data import Dataset, Sampler

from multi_train_utils.images import read_image_uint8


class MyDataSet(Dataset):
    """Images and labels from lists of paths, as returned by ``utils.read_split_data``.

    Items are (uint8 image tensor, label): the transforms augment uint8 tensors, and the
    training loop converts to float and normalises on the device (fewer bytes to copy).
    ``keep_side`` lets large JPEGs be decoded at reduced size (see ``images.read_image_uint8``).

    An index may be an int, or an ``(epoch, index)`` pair from ``EpochIndexSampler``: then the
    random augmentation of that sample is drawn from a generator seeded by
    (seed, epoch, index). Augmentations then repeat exactly on a rerun or a resume, and do
    not depend on which loader worker, or which rank, loads the sample.
    """

    def __init__(self, images_path, images_class, transform=None, seed=0, keep_side=None):
        self.images_path = images_path
        self.images_class = images_class
        self.transform = transform
        self.seed = seed
        self.keep_side = keep_side

    def __len__(self):
        return len(self.images_path)

    def __getitem__(self, item):
        epoch, index = item if isinstance(item, tuple) else (None, item)
        img = read_image_uint8(self.images_path[index], self.keep_side)
        label = self.images_class[index]
        if self.transform is None:
            return img, label
        if epoch is None:
            return self.transform(img), label
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(sample_seed(self.seed, epoch, index))  # the CPU generator only
            return self.transform(img), label

    @staticmethod
    def collate_fn(batch):
        """Stack images into one tensor and labels into another."""
        images, labels = tuple(zip(*batch))
        return torch.stack(images, dim=0), torch.as_tensor(labels)


def sample_seed(seed, epoch, index):
    """A 63-bit seed that differs for every (seed, epoch, index)."""
    return ((seed * 1_000_003 + epoch) * 1_000_003 + index) % (2**63)


def seed_epoch(seed, epoch, rank=0):
    """Seed the global generators (CPU and GPUs) from (seed, epoch, rank) at the start of an
    epoch: what the model draws (dropout, stochastic depth) then repeats on a rerun or a
    resume, without depending on saved generator states or the number of loader workers."""
    torch.manual_seed(sample_seed(seed + 7919, epoch, rank))


class EpochIndexSampler(Sampler):
    """Yields ``(epoch, index)`` pairs from a sampler that has ``.epoch`` (DistributedSampler).

    The epoch reaches the loader workers with each index, so even persistent workers draw
    each epoch's augmentations afresh (see ``MyDataSet``).
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

    def __init__(self, num_samples, rank=0, world_size=1):
        self.indices = list(range(rank, num_samples, world_size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)
