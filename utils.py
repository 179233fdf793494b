"""Data helpers: find classes, split them, write the class index file, build transforms and
loaders, and generate the offline demo dataset."""
import json
import os
import random
import shutil
import tempfile
import time
from typing import List, NamedTuple

import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from multi_train_utils.errors import UserError

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")
FLOWER_PHOTOS_URL = "https://storage.googleapis.com/download.tensorflow.org/example_images/flower_photos.tgz"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class DataSplit(NamedTuple):
    """What ``read_split_data`` found: the two splits, the class names and skipped files."""

    train_images_path: List[str]
    train_images_label: List[int]
    val_images_path: List[str]
    val_images_label: List[int]
    classes: List[str]
    skipped: List[str]  # files with an image extension that PIL cannot open


def _is_hidden(name):
    return name.startswith(".")


def find_classes(root, flag="--data-path"):
    """Sorted class names: the visible sub-folders of ``root``."""
    if not os.path.exists(root):
        raise UserError(
            f"{flag} {root}: no such folder. Put one sub-folder of images per class there, "
            f"e.g. flower_photos from {FLOWER_PHOTOS_URL} extracted to data/, or try --demo"
        )
    if not os.path.isdir(root):
        raise UserError(f"{flag} {root}: not a folder; give a folder with one sub-folder of images per class")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not _is_hidden(e.name))
    if not classes:
        raise UserError(f"{flag} {root}: no class folders inside; put the images of each class in a sub-folder")
    return classes


def list_images(folder):
    """Image files directly in ``folder``, by extension (any case), hidden files ignored, sorted."""
    return sorted(
        os.path.join(folder, e.name)
        for e in os.scandir(folder)
        if e.is_file() and not _is_hidden(e.name) and os.path.splitext(e.name)[1].lower() in IMG_EXTENSIONS
    )


def is_readable_image(path):
    """Cheap check that PIL recognises the file (it reads the header, not the pixels)."""
    try:
        with Image.open(path) as img:
            img.verify()
        return True
    except Exception:  # PIL raises many types for a broken file
        return False


def _scan_class_folders(root, classes, flag):
    """Readable images and labels of every class folder; fails on a class with none."""
    images, labels, skipped = [], [], []
    for label, name in enumerate(classes):
        folder = os.path.join(root, name)
        if not os.path.isdir(folder):
            raise UserError(f"{flag} {root}: class folder {name!r} is missing (the training data has it)")
        files = list_images(folder)
        readable = [p for p in files if is_readable_image(p)]
        readable_set = set(readable)
        skipped += [p for p in files if p not in readable_set]
        if not readable:
            raise UserError(
                f"{flag} {root}: class folder {name!r} has no images "
                f"({', '.join(IMG_EXTENSIONS)}); add images or remove the folder"
            )
        images += readable
        labels += [label] * len(readable)
    return images, labels, skipped


def read_split_data(root, val_rate=0.2, seed=0, val_root=None, class_indices_dir=None):
    """Find the images of each class folder of ``root`` and split them into train and val.

    The split is stratified (``round(n * val_rate)`` images of each class go to val) and
    deterministic: files are sorted and shuffled with ``random.Random(seed)``, so it depends
    neither on ``os.listdir`` order nor on global random state. With ``val_root`` (same class
    folders) nothing is split: all of ``root`` trains and all of ``val_root`` validates.
    Files with an image extension that PIL cannot open are skipped and listed in ``skipped``.
    Writes ``class_indices.json`` into ``class_indices_dir`` if given.
    """
    classes = find_classes(root)
    if val_root is not None:
        val_classes = find_classes(val_root, flag="--val-path")
        if val_classes != classes:
            raise UserError(
                f"--val-path {val_root}: class folders {val_classes} differ from --data-path's {classes}; "
                "use the same class folder names"
            )
        train_images, train_labels, skipped = _scan_class_folders(root, classes, "--data-path")
        val_images, val_labels, val_skipped = _scan_class_folders(val_root, classes, "--val-path")
        skipped += val_skipped
    else:
        if not 0.0 <= val_rate < 1.0:
            raise UserError(f"--val-rate {val_rate}: must be at least 0 and below 1 (e.g. 0.2)")
        images, labels, skipped = _scan_class_folders(root, classes, "--data-path")
        rng = random.Random(seed)
        train_images, train_labels, val_images, val_labels = [], [], [], []
        for label in range(len(classes)):
            members = [p for p, y in zip(images, labels) if y == label]
            rng.shuffle(members)
            n_val = int(round(len(members) * val_rate))
            if n_val and n_val == len(members):
                raise UserError(
                    f"--val-rate {val_rate}: class {classes[label]!r} has only {len(members)} image(s), all of "
                    "them would go to validation; lower --val-rate or add images"
                )
            val_set = set(members[:n_val])
            for path in sorted(members):
                if path in val_set:
                    val_images.append(path)
                    val_labels.append(label)
                else:
                    train_images.append(path)
                    train_labels.append(label)
    if len(classes) < 2:
        raise UserError(f"--data-path {root}: found 1 class folder ({classes[0]}); a classifier needs at least 2")
    if not val_images:
        raise UserError(
            f"--val-rate {val_rate}: the validation split of {len(train_images)} images is empty; "
            "raise --val-rate or give --val-path"
        )
    if not train_images:
        raise UserError(f"--val-rate {val_rate}: no images left for training; lower --val-rate")
    if class_indices_dir is not None:
        write_class_indices(classes, class_indices_dir)
    return DataSplit(train_images, train_labels, val_images, val_labels, classes, skipped)


def write_class_indices(classes, output_dir):
    """Write ``class_indices.json`` ({"0": "daisy", ...}) into ``output_dir``, atomically."""
    from multi_train_utils.checkpoint import write_json_atomic

    write_json_atomic({str(i): name for i, name in enumerate(classes)}, os.path.join(output_dir, "class_indices.json"))


def read_class_indices(path):
    """Class names, in index order, from a ``class_indices.json`` file; a UserError if it is not one."""
    try:
        with open(path) as f:
            mapping = json.load(f)
        return [mapping[str(i)] for i in range(len(mapping))]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path}: not a readable class index file ({{\"0\": \"daisy\", ...}}): {e}") from None


def resize_size(img_size):
    """Validation images are resized to 256/224 of the crop size, then center-cropped."""
    return round(img_size * 256 / 224)


def build_transforms(img_size):
    """Train: random resized crop + horizontal flip; val: resize + center crop.

    Both work on uint8 tensors; conversion to float and normalisation with ImageNet's mean
    and std happen on the device, in the training loop (``DeviceNormalizer``).
    """
    train = v2.Compose([v2.RandomResizedCrop(img_size, antialias=True), v2.RandomHorizontalFlip()])
    val = v2.Compose([v2.Resize(resize_size(img_size), antialias=True), v2.CenterCrop(img_size)])
    return train, val


def make_loader(dataset, batch_sampler, workers, device):
    """A DataLoader over a batch sampler; workers stay alive between epochs."""
    from multi_train_utils.signals import reset_in_worker

    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=workers,
        pin_memory=device.type == "cuda",
        persistent_workers=workers > 0,
        collate_fn=dataset.collate_fn,
        worker_init_fn=reset_in_worker,
        # its own generator: creating the loader's iterator must not draw from the global
        # one, which seed_epoch sets for the model
        generator=torch.Generator().manual_seed(0),
    )


def default_workers(local_world_size=1):
    """Loader workers per process: this process's share of the cores (a fixed cap would starve
    fast GPUs on big machines; on a CPU the workers mostly wait, the model uses the cores)."""
    from multi_train_utils.distributed_utils import cores_per_process

    return cores_per_process(local_world_size)


# --- The offline demo dataset -------------------------------------------------------------

DEMO_MARKER = "GENERATED_BY_DEMO.txt"  # a file, so not a class folder

DEMO_CLASSES = {
    # name: (petal colour, centre colour, number of petals)
    "daisy": ((245, 245, 240), (230, 190, 40), 12),
    "dandelion": ((250, 215, 30), (235, 180, 20), 24),
    "roses": ((200, 25, 45), (140, 10, 30), 6),
    "sunflowers": ((255, 185, 15), (80, 45, 20), 16),
    "tulips": ((235, 90, 170), (250, 220, 120), 4),
}


def _draw_flower(rng, petal, centre, petals, size):
    """One flower-like picture: coloured petals around a centre on a green, noisy background."""
    from PIL import ImageDraw, ImageFilter

    def jitter(colour, amount=25):
        return tuple(max(0, min(255, c + rng.randint(-amount, amount))) for c in colour)

    w, h = size
    img = Image.new("RGB", size, jitter((60, 120, 50), 30))
    draw = ImageDraw.Draw(img)
    for _ in range(12):  # leaves and stems in the background
        x, y = rng.randrange(w), rng.randrange(h)
        r = rng.randint(min(w, h) // 12, min(w, h) // 5)
        draw.ellipse((x - r, y - r // 3, x + r, y + r // 3), fill=jitter((40, 100, 35), 30))
    import math

    cx, cy = w / 2 + rng.uniform(-0.15, 0.15) * w, h / 2 + rng.uniform(-0.15, 0.15) * h
    radius = min(w, h) * rng.uniform(0.28, 0.42)
    start = rng.uniform(0, 360)
    for k in range(petals):
        angle = math.radians(start + 360 * k / petals)
        px, py = cx + math.cos(angle) * radius * 0.6, cy + math.sin(angle) * radius * 0.6
        pr = radius * (0.45 if petals <= 6 else 0.3)
        draw.ellipse((px - pr, py - pr, px + pr, py + pr), fill=jitter(petal))
    cr = radius * 0.3
    draw.ellipse((cx - cr, cy - cr, cx + cr, cy + cr), fill=jitter(centre))
    return img.filter(ImageFilter.GaussianBlur(rng.uniform(0, 1.2)))


def make_demo_dataset(root, images_per_class=60, seed=0, min_size=120, max_size=320):
    """Write a small learnable flower-like dataset (5 class folders of JPEGs) to ``root``.

    Written into a temporary folder beside ``root`` and renamed, so a half-written dataset
    never looks like a finished one. Does nothing if ``root`` already exists.
    """
    if os.path.exists(root):
        return root
    parent = os.path.dirname(os.path.abspath(root))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".demo-", dir=parent)
    try:
        rng = random.Random(seed)
        for name, (petal, centre, petals) in DEMO_CLASSES.items():
            os.makedirs(os.path.join(tmp, name))
            for i in range(images_per_class):
                size = (rng.randint(min_size, max_size), rng.randint(min_size, max_size))
                img = _draw_flower(rng, petal, centre, petals, size)
                img.save(os.path.join(tmp, name, f"{name}_{i:04d}.jpg"), quality=90)
        with open(os.path.join(tmp, DEMO_MARKER), "w") as f:
            f.write("Generated flower-like images written by --demo; not real photos.\n")
        os.rename(tmp, root)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isdir(root):  # another process finishing first is fine
            raise
    return root


def wait_for_folder(path, timeout_s=600):
    """Wait until another process has created ``path`` (used by ranks that don't write data)."""
    deadline = time.monotonic() + timeout_s
    while not os.path.isdir(path):
        if time.monotonic() > deadline:
            raise UserError(f"{path}: not created by local rank 0 within {timeout_s} s")
        time.sleep(0.2)


# --- What both training scripts do before building the model -------------------------------


def load_data(args, local_rank=0, world_size=1):
    """Generate the demo data if asked, split the data and check it against the flags.

    Every rank runs this (it only reads), so every rank fails the same way on bad input.
    """
    if args.demo:
        if os.path.exists(args.data_path) and not os.path.exists(os.path.join(args.data_path, DEMO_MARKER)):
            raise UserError(f"--demo --data-path {args.data_path}: that folder exists and is not demo data; "
                            "drop --data-path (demo data goes to data/demo) or run without --demo")
        if local_rank == 0:
            make_demo_dataset(args.data_path)
        else:
            wait_for_folder(args.data_path)
    split = read_split_data(args.data_path, args.val_rate, args.seed, args.val_path)
    found = len(split.classes)
    if args.num_classes is not None and args.num_classes != found:
        raise UserError(
            f"--num-classes {args.num_classes}: {args.data_path} has {found} class folders "
            f"({', '.join(split.classes)}); drop the flag or fix the folders"
        )
    if getattr(args, "run_classes", None) is not None and args.run_classes != split.classes:
        raise UserError(
            f"--data-path {args.data_path}: classes {split.classes} differ from the weights' class_indices.json "
            f"{args.run_classes}; evaluate on data with the same class folders"
        )
    share = len(split.train_images_path) // world_size
    if not args.eval_only and share == 0:
        raise UserError(
            f"{world_size} processes but only {len(split.train_images_path)} training images; "
            "start fewer processes or add images"
        )
    if not args.eval_only and args.batch_size > share:
        raise UserError(
            f"--batch-size {args.batch_size}: each of the {world_size} process(es) gets only {share} of the "
            f"{len(split.train_images_path)} training images; use --batch-size {max(1, share)} or less"
        )
    return split


def build_datasets(split, args):
    """Training and validation datasets with their transforms."""
    from my_dataset import MyDataSet

    train_transform, val_transform = build_transforms(args.img_size)
    # Large JPEGs are decoded at reduced size: training keeps twice the crop size (random
    # crops of a quarter of the image or more lose nothing), validation its resize size.
    train_set = MyDataSet(split.train_images_path, split.train_images_label, train_transform, seed=args.seed,
                          keep_side=2 * args.img_size)
    val_set = MyDataSet(split.val_images_path, split.val_images_label, val_transform,
                        keep_side=resize_size(args.img_size))
    return train_set, val_set


def print_data_summary(args, split):
    """Rank 0's description of the data: images per class and split sizes, skipped files."""
    if not args.demo and os.path.exists(os.path.join(args.data_path, DEMO_MARKER)):
        print(f"note: {args.data_path} holds generated demo images (written by --demo), not real photos")
    for path in split.skipped:
        print(f"warning: skipping {path}: not a readable image", flush=True)
    counts = {name: 0 for name in split.classes}
    for label in split.train_images_label + split.val_images_label:
        counts[split.classes[label]] += 1
    where = f"{args.data_path}" + (f" + {args.val_path} (validation)" if args.val_path else "")
    print(f"data: {where}: " + ", ".join(f"{n} {c}" for n, c in counts.items()))
    print(f"split: {len(split.train_images_path)} train, {len(split.val_images_path)} val images", flush=True)
