"""The dataset of image files and the samplers that feed it."""
import io

import torch
from PIL import Image
from torch.utils.data import Dataset, Sampler
from torchvision.transforms.v2.functional import pil_to_tensor

try:  # deprecated since torchvision 0.29 in favour of TorchCodec; PIL decodes if it goes away
    from torchvision.io import ImageReadMode, decode_jpeg
except ImportError:
    decode_jpeg = None

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


JPEG_MAGIC = b"\xff\xd8\xff"


def read_image_uint8(path, keep_side=None):
    """An image file as a uint8 RGB tensor (3, H, W).

    JPEGs are decoded by torchvision.io (libjpeg-turbo, straight into a tensor); other
    formats and modes go through ``load_rgb``. With ``keep_side``, a JPEG whose shorter side
    is at least twice that is decoded at 1/2, 1/4 or 1/8 size (PIL's draft mode, done inside
    the JPEG decoder) with its shorter side still at least ``keep_side``.
    """
    with open(path, "rb") as f:
        data = f.read()
    if data.startswith(JPEG_MAGIC) and decode_jpeg is not None:
        if keep_side:
            reduced = _decode_jpeg_reduced(data, keep_side)
            if reduced is not None:
                return reduced
        try:
            return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        except RuntimeError:
            pass  # a JPEG libjpeg-turbo refuses: PIL decodes it, or names the file in its error
    return pil_to_tensor(load_rgb(path))


def _decode_jpeg_reduced(data, keep_side):
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            if min(width, height) < 2 * keep_side or img.mode not in ("RGB", "L"):
                return None
            scale = keep_side / min(width, height)
            img.draft("RGB", (max(1, round(width * scale)), max(1, round(height * scale))))
            return pil_to_tensor(img.convert("RGB"))
    except (OSError, ValueError, SyntaxError):
        return None  # undecodable: the full-size path reports it


class MyDataSet(Dataset):
    """Images and labels from lists of paths, as returned by ``utils.read_split_data``.

    Items are (uint8 image tensor, label): the transforms augment uint8 tensors, and the
    training loop converts to float and normalises on the device (fewer bytes to copy).
    ``keep_side`` lets large JPEGs be decoded at reduced size (see ``read_image_uint8``).

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
