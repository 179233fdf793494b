"""An image file's way: found in a folder tree, decoded, transformed, normalised on the device.

Files are found as torchvision's ImageFolder finds them (sub-folders searched, symbolic links
followed, each real file and folder once, a link back to a folder above skipped as a loop,
hidden files ignored; an entry that cannot be resolved is named, not fatal); decoded to
uint8 tensors, upright as their EXIF orientation says (a phone's portrait photo); augmented
(train) or resized and cropped (val) as uint8; and normalised with ImageNet's mean and std
on the device. Training, evaluation, predict.py, export.py and benchmark.py all use this one."""
import io
import operator
import os
import re
import stat
from typing import Dict, List, NamedTuple, Set

import torch
from PIL import Image, ImageOps
from torchvision.transforms import v2
from torchvision.transforms.v2.functional import pil_to_tensor



try:  # TorchCodec (torchvision.io's successor): libjpeg-turbo straight into a tensor, EXIF orientation applied
    from torchcodec.decoders import decode_jpeg
except (ImportError, OSError, RuntimeError):  # not installed, too old, or built for another torch
    decode_jpeg = None

from multi_train_utils.errors import UnreadableImage

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
JPEG_MAGIC = b"\xff\xd8\xff"
JPEG_DECODER = ("TorchCodec" if decode_jpeg is not None else
                "PIL (TorchCodec decodes faster: pip install torchcodec, the version for your torch)")


# --- Finding ------------------------------------------------------------------------------------

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")


class Entries(NamedTuple):
    """What ``list_entries`` found in one folder."""

    folders: List[str]  # paths of the visible sub-folders (symlinks to folders included), sorted
    files: List[str]  # paths of the visible files, sorted
    links: Set[str]  # those of the files that are symbolic links
    problems: Dict[str, str]  # {path: why it cannot be followed}: symlink loops, broken links


class FoundFiles(NamedTuple):
    """What ``find_image_files`` found."""

    paths: List[str]  # image files by extension, in sorted walk order, each real file once
    problems: Dict[str, str]  # {path: why it was left out} for entries that could not be followed


def is_hidden(name):
    """Names starting with a dot are hidden (.cache, .DS_Store, editors' temporary files)."""
    return name.startswith(".")


def no_file_at(path):
    """True where no file is (a listed image that is missing); one that exists but cannot be
    opened (a symlink loop, no permission) is there: it is skipped later, with the reason."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        return True
    except OSError:
        return False


def find_image_files(folder):
    """Image files (by extension) in ``folder`` and all its sub-folders."""
    problems, listed = {}, []  # listed: (real path of a folder, its image files, those that are links)
    seen_folders = set()
    # depth first, in sorted order; each entry: (path, real paths of the folders above it)
    todo = [(folder, frozenset())]
    while todo:
        path, above = todo.pop()
        real, parent = os.path.realpath(path), os.path.realpath(os.path.dirname(path))
        if real in above or parent == real or parent.startswith(real.rstrip(os.sep) + os.sep):
            problems[path] = f"a symbolic link loop (it leads back to {real}, a folder above it)"
            continue
        if real in seen_folders:
            continue  # reached before through another link: its files are in already
        seen_folders.add(real)
        try:
            entries = list_entries(path)
        except OSError as e:
            problems[path] = f"cannot be read ({e.strerror})"
            continue
        problems.update(entries.problems)
        listed.append((real, [file for file in entries.files if file.lower().endswith(IMG_EXTENSIONS)],
                       entries.links))
        todo += [(sub, above | {real}) for sub in reversed(entries.folders)]
    if not any(links for _, _, links in listed):  # distinct real folders hold distinct files
        return FoundFiles([file for _, files, _ in listed for file in files], problems)
    return FoundFiles(_first_of_each_real_file(listed), problems)


def _first_of_each_real_file(listed):
    """The files of ``listed`` ((real folder, files, links) in walk order), each real file
    once, where it comes first; only links are resolved (a dozen system calls each)."""
    seen, kept = set(), []
    for real_folder, files, links in listed:
        for file in files:
            real_file = os.path.realpath(file) if file in links else os.path.join(real_folder, os.path.basename(file))
            if real_file not in seen:
                seen.add(real_file)
                kept.append(file)
    return kept


_NAME = operator.attrgetter("name")


def list_entries(folder):
    """The visible entries of ``folder`` (symlinks followed), sorted by name; OSError if it cannot be listed."""
    entries = Entries([], [], set(), {})
    for entry in sorted(os.scandir(folder), key=_NAME):
        if is_hidden(entry.name):
            continue
        if not entry.is_symlink():  # the common case, from the directory listing alone
            if entry.is_file():
                entries.files.append(entry.path)
                continue
            if entry.is_dir():
                entries.folders.append(entry.path)
                continue
        kind = _kind(entry)
        if kind == "folder":
            entries.folders.append(entry.path)
        elif kind == "file":
            entries.files.append(entry.path)
            if entry.is_symlink():
                entries.links.add(entry.path)
        elif kind != "other":
            entries.problems[entry.path] = kind
    return entries


def _kind(entry):
    """"folder", "file", "other" (a device, a socket), or why the entry cannot be followed."""
    try:
        if entry.is_dir():
            return "folder"
        if entry.is_file():
            return "file"
        if entry.is_symlink():
            os.stat(entry.path)  # raises: is_dir and is_file say False for a broken link
        return "other"
    except FileNotFoundError:
        return "cannot be read (a broken symbolic link)"
    except OSError as e:
        return f"cannot be read ({e.strerror})"


# --- Decoding -----------------------------------------------------------------------------------

def too_many_pixels(error):
    """Why PIL refuses an image as a possible decompression bomb (its DecompressionBombError)."""
    found = re.search(r"\((\d+) pixels\)", str(error))
    size = f"{int(found.group(1)):,} pixels, " if found else ""
    return (f"too many pixels ({size}more than PIL's limit of {2 * Image.MAX_IMAGE_PIXELS:,}, twice "
            "PIL.Image.MAX_IMAGE_PIXELS, against decompression bombs); shrink or remove the image")


def unreadable_reason(path):
    """None if PIL recognises ``path`` as an image (from its header: cheap, the pixels are not
    decoded), else why not, as the end of a line ``skipping PATH: ...``."""
    try:
        with Image.open(path) as img:
            img.verify()
        return None
    except Image.DecompressionBombError as e:
        return "not a readable image: " + too_many_pixels(e)
    except OSError as e:
        if e.errno is not None:  # the file itself cannot be opened: a symlink loop, no permission
            return f"cannot be read ({e.strerror})"
        return "not a readable image"
    except Exception:  # PIL raises many types for a broken file
        return "not a readable image"


def upright(img):
    """A PIL image turned as its EXIF orientation says; as stored if its EXIF cannot be parsed
    (torchvision's JPEG decoder ignores such EXIF too)."""
    try:
        return ImageOps.exif_transpose(img)
    except Exception:  # PIL raises several types for malformed EXIF
        return img


# The PIL mode an image file is read in, by the channels the data has.
MODES = {1: "L", 3: "RGB", 4: "RGBA"}


def load_rgb(path, channels=3):
    """Open any image file as 8-bit RGB (grayscale, palette, CMYK, 16-bit...), upright as its
    EXIF orientation says; with ``channels`` 1 as gray, with 4 as RGBA (alpha kept).

    Transparent pixels are put on a white background rather than whatever colour they hide
    (RGB and gray).
    """
    try:
        with Image.open(path) as img:
            img.load()
            img = upright(img)
            if channels == 4:
                return img.convert("RGBA")
            if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
                rgba = img.convert("RGBA")
                background = Image.new("RGB", rgba.size, (255, 255, 255))
                background.paste(rgba, mask=rgba.getchannel("A"))
                return background.convert(MODES[channels])
            if img.mode.startswith("I;16"):
                img = img.convert("I")
            if img.mode == "I":  # 16-bit grayscale: keep the top 8 bits
                img = img.point(lambda v: v / 256).convert("L")
            return img.convert(MODES[channels])
    except Image.DecompressionBombError as e:
        raise UnreadableImage(f"cannot decode image {path}: {too_many_pixels(e)}") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise UnreadableImage(f"cannot decode image {path} ({e}); delete or replace the file") from None


def read_image_uint8(path, keep_side=None, channels=3):
    """An image file as a uint8 RGB tensor (3, H, W), upright as its EXIF orientation says
    (``channels`` 1: gray (1, H, W); 4: RGBA, through PIL).

    JPEGs are decoded by TorchCodec where it is installed (``JPEG_DECODER`` says which), else
    by PIL; other formats and modes go through ``load_rgb``. With ``keep_side``, a JPEG whose
    shorter side is at least twice that is decoded at 1/2, 1/4 or 1/8 size (PIL's draft mode,
    done inside the JPEG decoder) with its shorter side still at least ``keep_side``. A file that is gone
    or cannot be opened or decoded is an UnreadableImage naming it.
    """
    data = _read_bytes(path)
    if channels != 3:
        return pil_to_tensor(load_rgb(path, channels))
    if data.startswith(JPEG_MAGIC) and decode_jpeg is not None:
        if keep_side:
            reduced = _decode_jpeg_reduced(data, keep_side, path)
            if reduced is not None:
                return reduced
        try:
            return decode_jpeg(data, mode="RGB")
        except RuntimeError:
            pass  # a JPEG libjpeg-turbo refuses: PIL decodes it, or names the file in its error
    return pil_to_tensor(load_rgb(path))


def _read_bytes(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise UnreadableImage(f"image {path} is gone (deleted or moved after the data was listed); put it back, "
                              "or take it out of the data") from None
    except OSError as e:
        raise UnreadableImage(f"image {path} cannot be read ({e.strerror}); fix it or take it out of "
                              "the data") from None


def _decode_jpeg_reduced(data, keep_side, path):
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            if min(width, height) < 2 * keep_side or img.mode not in ("RGB", "L"):
                return None
            scale = keep_side / min(width, height)
            img.draft("RGB", (max(1, round(width * scale)), max(1, round(height * scale))))
            return pil_to_tensor(upright(img).convert("RGB"))
    except Image.DecompressionBombError as e:
        raise UnreadableImage(f"cannot decode image {path}: {too_many_pixels(e)}") from None
    except (OSError, ValueError, SyntaxError):
        return None  # undecodable: the full-size path reports it


# --- Transforms (on uint8 tensors) ---------------------------------------------------------------

def resize_size(img_size):
    """Validation images are resized to 256/224 of the crop size, then center-cropped."""
    return round(img_size * 256 / 224)


AUTO_AUGMENT = {"ta_wide": v2.TrivialAugmentWide, "randaugment": v2.RandAugment, "autoaugment": v2.AutoAugment,
                "augmix": v2.AugMix}


def erase_value(mean):
    """Random erasing fills with the data's mean colour in 0-255 (ImageNet's by default): after
    normalisation that is 0, what torchvision's references erase to (they erase the normalised
    float image). Without a mean (None), black."""
    return [round(255 * m) for m in mean] if mean is not None else 0


def build_transforms(img_size, auto_augment="none", random_erase=0.0, val_resize_size=None, hflip=0.5,
                     fill=IMAGENET_MEAN):
    """Train: random resized crop + horizontal flip with probability ``hflip`` (0: none, for
    text, digits, left and right), then an ``auto_augment`` policy (ta_wide, randaugment,
    autoaugment, augmix) and random erasing with probability ``random_erase`` where asked,
    filling with the mean ``fill``; val: resize (shorter side to ``val_resize_size``, default
    ``resize_size(img_size)``) + center crop.

    All work on uint8 tensors; conversion to float and normalisation with the data's mean
    and std happen on the device, in the training loop (``DeviceNormalizer``).
    """
    train = [v2.RandomResizedCrop(img_size, antialias=True)]
    if hflip > 0:
        train.append(v2.RandomHorizontalFlip(p=hflip))
    if auto_augment and auto_augment != "none":
        train.append(AUTO_AUGMENT[auto_augment]())
    if random_erase > 0:
        train.append(v2.RandomErasing(p=random_erase, value=erase_value(fill)))
    val = v2.Compose([v2.Resize(val_resize_size or resize_size(img_size), antialias=True), v2.CenterCrop(img_size)])
    return v2.Compose(train), val


# --- On the device -------------------------------------------------------------------------------

class DeviceNormalizer:
    """Image batches from the loader -> normalised float batches on the device.

    uint8 batches (0-255, the built-in dataset's) are converted on the device: copying uint8
    moves a quarter of the bytes of float32. Float batches are taken to be in [0, 1]. ``mean``
    and ``std``: per channel (the data's; ImageNet's by default); None: no normalising (uint8
    scaled to [0, 1], floats as they come).
    """

    def __init__(self, device, channels_last=False, mean=IMAGENET_MEAN, std=IMAGENET_STD):
        self.device = device
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        mean = torch.tensor(mean if mean is not None else [0.0], device=device).view(1, -1, 1, 1)
        std = torch.tensor(std if std is not None else [1.0], device=device).view(1, -1, 1, 1)
        # (mean, 1 / std) of pixel values: 0-255 for uint8 images, 0-1 for float ones
        self.uint8_constants = (mean * 255, 1 / (std * 255))
        self.float_constants = (mean, 1 / std)

    def __call__(self, images, labels):
        return self.normalize(images), labels.to(self.device, non_blocking=True)

    def normalize(self, images):
        images = images.to(self.device, non_blocking=True).contiguous(memory_format=self.memory_format)
        mean, inv_std = self.uint8_constants if images.dtype == torch.uint8 else self.float_constants
        return (images.float() - mean) * inv_std
