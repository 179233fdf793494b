"""The dataset of image files and the samplers that feed it."""
import torch
from PIL import Image
from torch.utils.data import Dataset, Sampler

from multi_train_utils.errors import RankError


def load_rgb(path):
    """Open any image file as 8-bit RGB (grayscale, palette, CMYK, 16-bit...).

    Transparent pixels are put on a white background rather than whatever colour they hide.
    """
    try:
        with Image.open(path) as img:
            img.load()
            if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
                rgba = img.convert("RGBA")
                background = Image.new("RGB", rgba.size, (255, 255, 255))
                background.paste(rgba, mask=rgba.getchannel("A"))
                return background
            if img.mode.startswith("I;16"):
                img = img.convert("I")
            if img.mode == "I":  # 16-bit grayscale: keep the top 8 bits
                img = img.point(lambda v: v / 256).convert("L")
            return img.convert("RGB")
    except (OSError, ValueError, SyntaxError) as e:
        raise RankError(f"cannot decode image {path} ({e}); delete or replace the file") from None


class MyDataSet(Dataset):
    """Images and labels from lists of paths, as returned by ``utils.read_split_data``.

    An index may be an int, or an ``(epoch, index)`` pair from ``EpochIndexSampler``: then the
    random augmentation of that sample is drawn from a generator seeded by
    (seed, epoch, index). Augmentations then repeat exactly on a rerun or a resume, and do
    not depend on which loader worker, or which rank, loads the sample.
    """

    def __init__(self, images_path, images_class, transform=None, seed=0):
        self.images_path = images_path
        self.images_class = images_class
        self.transform = transform
        self.seed = seed

    def __len__(self):
        return len(self.images_path)

    def __getitem__(self, item):
        epoch, index = item if isinstance(item, tuple) else (None, item)
        img = load_rgb(self.images_path[index])
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
