"""Data helpers: find classes, split them, write the class index file, build transforms and
loaders, and generate the offline demo dataset."""
import glob
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
# As TensorFlow Datasets records them.
FLOWER_PHOTOS_BYTES = 228_813_984
FLOWER_PHOTOS_SHA256 = "4c54ace7911aaffe13a365c34f650e71dd5bf1be0a58b464e5a7183e3e595d9c"
FLOWER_PHOTOS_COUNTS = {"daisy": 633, "dandelion": 898, "roses": 641, "sunflowers": 699, "tulips": 799}
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


def read_run_settings(weights, model=None, img_size=None, class_indices=None):
    """(model name, image size, class names) of the run that wrote ``weights``: the given
    values first, else its args.json and class_indices.json beside the weights."""
    if not os.path.isfile(weights):
        raise UserError(f"--weights {weights}: no such file (e.g. weights/model-best.pth of a finished run)")
    run_dir = os.path.dirname(os.path.abspath(weights))
    run_args = {}
    args_file = os.path.join(run_dir, "args.json")
    if os.path.isfile(args_file) and not (model and img_size):
        try:
            with open(args_file) as f:
                run_args = json.load(f)
        except (OSError, ValueError) as e:
            raise UserError(f"{args_file}: cannot be read as JSON ({e}); give --model and --img-size") from None
    model = model or run_args.get("model")
    img_size = img_size or run_args.get("img_size")
    if not model or not img_size:
        raise UserError(f"no args.json beside {weights}: give --model and --img-size as in training")
    classes_file = class_indices or os.path.join(run_dir, "class_indices.json")
    if not os.path.isfile(classes_file):
        raise UserError(f"{classes_file}: not found; give --class-indices (the run's class_indices.json)")
    return model, int(img_size), read_class_indices(classes_file)


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


# --- Pictures -----------------------------------------------------------------------------------
# matplotlib Figures drawn straight into PNG files (and TensorBoard) by its Agg renderer:
# never a window, no display needed, and pyplot's global state is left alone.

PLOT_FILES = {"class_distribution": "class_distribution.png", "batch_preview": "batch_preview.png",
              "curves": "curves.png", "confusion_matrix": "confusion_matrix.png"}
MAX_INCHES = 20  # figures grow with the number of classes up to this size
MAX_LABELLED_CLASSES = 50  # beyond this, class names are left off the axes


def _figure(width, height):
    """A Figure laid out by matplotlib's constrained layout: the margins grow to fit the tick
    labels (long class names included), so no label overlaps the plot or is cut off the
    picture, also in TensorBoard, which draws the whole figure without trimming it."""
    from matplotlib.figure import Figure

    return Figure(figsize=(min(width, MAX_INCHES), min(height, MAX_INCHES)), layout="constrained")


def save_figure(fig, path, writer=None, tag=None, step=0):
    """Write ``fig`` as a PNG (atomically), and log it to TensorBoard if given a writer."""
    import io

    from multi_train_utils.checkpoint import write_bytes_atomic

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    write_bytes_atomic(buffer.getvalue(), path)
    if writer is not None:
        writer.add_figure(tag, fig, step, close=False)
    return path


def _class_ticks(axis, classes, rotate=False):
    """Class names as the tick labels of ``axis`` (ax.xaxis or ax.yaxis), unless there are too many.
    On the x axis, rotated names end at their tick; on the y axis names end left of the plot."""
    if len(classes) > MAX_LABELLED_CLASSES:
        return
    axis.set_ticks(range(len(classes)))
    if axis.axis_name == "y":
        axis.set_ticklabels(classes)  # right-aligned at the tick, left of the axes (matplotlib's default)
    else:
        axis.set_ticklabels(classes, rotation=45 if rotate else 0, ha="right" if rotate else "center",
                            rotation_mode="anchor" if rotate else "default")


def plot_class_distribution(split):
    """Bar chart of the images per class in the training and validation splits."""
    fig = _figure(max(6, 0.8 * len(split.classes)), 4)
    ax = fig.subplots()
    train = [split.train_images_label.count(i) for i in range(len(split.classes))]
    val = [split.val_images_label.count(i) for i in range(len(split.classes))]
    x = range(len(split.classes))
    for offset, counts, name in ((-0.2, train, "train"), (0.2, val, "val")):
        bars = ax.bar([i + offset for i in x], counts, width=0.4, label=f"{name} ({sum(counts)})")
        if len(split.classes) <= MAX_LABELLED_CLASSES:
            ax.bar_label(bars, fontsize=8)
    _class_ticks(ax.xaxis, split.classes, rotate=len(split.classes) > 6 or max(map(len, split.classes)) > 10)
    ax.set_ylabel("images")
    ax.set_title("images per class")
    ax.legend()
    return fig


def plot_batch_preview(images, labels, classes):
    """A grid of augmented training images (uint8, as the loader gives them) with class names."""
    n = len(images)
    cols = min(8, n)
    rows = (n + cols - 1) // cols
    fig = _figure(1.6 * cols, 1.8 * rows)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, image, label in zip(axes.flat, images, labels):
        ax.imshow(image.permute(1, 2, 0).numpy())
        ax.set_title(classes[int(label)], fontsize=8)
    fig.suptitle("a training batch after augmentation")
    return fig


def plot_training_curves(rows):
    """Loss, validation accuracy and learning rate per epoch, from metrics.csv's rows."""
    from matplotlib.ticker import MaxNLocator

    epochs = [int(r["epoch"]) for r in rows]
    fig = _figure(12, 3.4)
    for ax, key, title in zip(fig.subplots(1, 3), ("train_loss", "val_accuracy", "lr"),
                              ("training loss", "validation accuracy", "learning rate")):
        ax.plot(epochs, [float(r[key]) for r in rows], marker="o", markersize=3)
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    return fig


def plot_confusion_matrix(confusion, classes, title="confusion matrix"):
    """Counts of true class (rows) against predicted class (columns); confusion_matrix.csv
    holds the exact numbers when there are too many classes to write them in."""
    size = max(4, 0.6 * len(classes) + 2)
    fig = _figure(size, size)
    ax = fig.subplots()
    ax.imshow(confusion.numpy(), cmap="Blues")
    _class_ticks(ax.xaxis, classes, rotate=True)
    _class_ticks(ax.yaxis, classes)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    peak = int(confusion.max()) if confusion.numel() else 0
    if len(classes) <= 30:
        for i in range(len(classes)):
            for j in range(len(classes)):
                value = int(confusion[i, j])
                ax.text(j, i, value, ha="center", va="center", fontsize=8,
                        color="white" if value > peak / 2 else "black")
    accuracy = confusion.diag().sum() / max(1, int(confusion.sum()))
    ax.set_title(f"{title} (accuracy {accuracy:.4f})")
    return fig


def confusion_matrix_csv(confusion, classes):
    """The confusion matrix as CSV text: a header of predicted classes, a row per true class."""
    lines = ["true/predicted," + ",".join(classes)]
    lines += [name + "," + ",".join(str(int(v)) for v in confusion[i]) for i, name in enumerate(classes)]
    return "\n".join(lines) + "\n"


def save_confusion_matrix(confusion, classes, folder, title, writer=None, step=0):
    """confusion_matrix.png and confusion_matrix.csv in ``folder`` (and the picture in TensorBoard)."""
    from multi_train_utils.checkpoint import write_text_atomic

    os.makedirs(folder, exist_ok=True)
    save_figure(plot_confusion_matrix(confusion, classes, title), os.path.join(folder, PLOT_FILES["confusion_matrix"]),
                writer, "summary/confusion_matrix", step)
    write_text_atomic(confusion_matrix_csv(confusion, classes), os.path.join(folder, "confusion_matrix.csv"))


def read_metrics_rows(run_dir):
    """metrics.csv of a run as a list of dicts."""
    import csv

    path = os.path.join(run_dir, "metrics.csv")
    try:
        with open(path) as f:
            return list(csv.DictReader(f))
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror}); is {run_dir} a run's --output-dir?") from None


def main(argv=None):
    """``python utils.py plot RUN_DIR``: draw curves.png of a finished (or running) run."""
    import argparse

    parser = argparse.ArgumentParser(description="Helpers for finished runs.")
    commands = parser.add_subparsers(dest="command", required=True)
    plot = commands.add_parser("plot", help="draw curves.png (loss, accuracy, lr per epoch) from RUN_DIR/metrics.csv")
    plot.add_argument("run_dir", help="the run's --output-dir (default weights)", nargs="?", default="weights")
    args = parser.parse_args(argv)
    rows = read_metrics_rows(args.run_dir)
    if not rows:
        raise UserError(f"{args.run_dir}/metrics.csv has no epochs yet")
    path = save_figure(plot_training_curves(rows), os.path.join(args.run_dir, PLOT_FILES["curves"]))
    print(f"wrote {path} ({len(rows)} epochs)")


# --- Downloading flower_photos ----------------------------------------------------------------

def download_flower_photos(root, url=FLOWER_PHOTOS_URL, size=FLOWER_PHOTOS_BYTES, sha256=FLOWER_PHOTOS_SHA256,
                           counts=FLOWER_PHOTOS_COUNTS):
    """Download flower_photos.tgz, check its size and SHA-256, and extract it to ``root``.

    Does nothing if ``root`` exists. The archive goes to a temporary file and is extracted
    into a temporary folder beside ``root``, renamed only when complete: a broken or
    half-finished download never looks like a dataset. Returns ``root``.
    """
    if os.path.isdir(root):
        return root
    parent = os.path.dirname(os.path.abspath(root))
    os.makedirs(parent, exist_ok=True)
    for stale in glob.glob(os.path.join(glob.escape(parent), ".flower_photos-*.tgz.part")):
        os.remove(stale)  # left by a download that was killed
    for stale in glob.glob(os.path.join(glob.escape(parent), ".extract-*")):
        shutil.rmtree(stale, ignore_errors=True)
    fd, archive = tempfile.mkstemp(prefix=".flower_photos-", suffix=".tgz.part", dir=parent)
    try:
        with os.fdopen(fd, "wb") as f:
            _fetch(url, f, size, root)
        check_archive(archive, size, sha256)
        extract_dataset(archive, root, counts)
    finally:
        os.remove(archive)
    return root


def download_failure_marker(root):
    """The file local rank 0 leaves when its download failed, so that the ranks waiting for
    ``root`` stop with its message instead of waiting (one name per job: its port)."""
    parent, name = os.path.split(os.path.abspath(root))
    return os.path.join(parent, f".{name}.download-failed-{os.environ.get('MASTER_PORT', '0')}")


def _fetch(url, file, size, root):
    import urllib.error
    import urllib.request

    from tqdm import tqdm

    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            with tqdm(total=size, unit="B", unit_scale=True, unit_divisor=1024, desc="flower_photos.tgz") as bar:
                while True:
                    chunk = response.read(1 << 20)
                    if not chunk:
                        break
                    file.write(chunk)
                    bar.update(len(chunk))
    except urllib.error.HTTPError as e:
        raise UserError(f"--download: {url} answered HTTP {e.code} ({e.reason}); try again later") from None
    except (urllib.error.URLError, OSError) as e:
        parent = os.path.dirname(root) or "."
        raise UserError(
            f"--download: cannot fetch {url} ({getattr(e, 'reason', e)}). Offline? Download it by hand, then: "
            f"mkdir -p {parent} && tar xzf flower_photos.tgz -C {parent} (gives {parent}/flower_photos)") from None


def check_archive(path, size, sha256):
    """Raise UserError unless the file at ``path`` has ``size`` bytes and this SHA-256."""
    import hashlib

    found = os.path.getsize(path)
    if found != size:
        raise UserError(f"--download: got {found:,} bytes, expected {size:,}; the download was cut short "
                        "or the file changed; try again")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != sha256:
        raise UserError(f"--download: SHA-256 {digest.hexdigest()} differs from the expected {sha256}; "
                        "the file is damaged or not the flower data; try again")


def extract_dataset(archive, root, counts=None):
    """Extract a .tgz holding one top folder of class folders to ``root``, atomically."""
    import tarfile

    parent = os.path.dirname(os.path.abspath(root))
    tmp = tempfile.mkdtemp(prefix=".extract-", dir=parent)
    try:
        try:
            with tarfile.open(archive, "r:gz") as tar:
                tar.extractall(tmp, filter="data")  # no absolute paths, links out or device files
        except (tarfile.TarError, EOFError, OSError) as e:
            raise UserError(f"--download: the archive cannot be extracted ({e}); try again") from None
        tops = [d for d in os.listdir(tmp) if os.path.isdir(os.path.join(tmp, d))]
        if len(tops) != 1:
            raise UserError(f"--download: the archive holds {len(tops)} top folders, expected one")
        top = os.path.join(tmp, tops[0])
        for name, expected in (counts or {}).items():
            found = len(list_images(os.path.join(top, name))) if os.path.isdir(os.path.join(top, name)) else 0
            if found != expected:
                raise UserError(f"--download: {name} has {found} images, expected {expected}; try again")
        try:
            os.rename(top, root)
        except OSError:
            if not os.path.isdir(root):  # another node sharing the folder finishing first is fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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


def wait_for_folder(path, timeout_s=600, failure_marker=None):
    """Wait until another process has created ``path`` (used by ranks that don't write data);
    stop with its message if that process left ``failure_marker`` instead."""
    deadline = time.monotonic() + timeout_s
    while not os.path.isdir(path):
        if failure_marker and os.path.exists(failure_marker):
            with open(failure_marker) as f:
                raise UserError(f.read().strip())
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
    if args.download:
        marker = download_failure_marker(args.data_path)
        if local_rank == 0:
            for stale in glob.glob(glob.escape(marker.rsplit("-", 1)[0]) + "-*"):
                os.remove(stale)
            try:
                download_flower_photos(args.data_path)
            except UserError as e:
                if world_size > 1:  # tell the other local ranks, which wait for the folder
                    with open(marker, "w") as f:
                        f.write(str(e))
                raise
        else:
            wait_for_folder(args.data_path, timeout_s=3600, failure_marker=marker)
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


if __name__ == "__main__":
    from multi_train_utils.errors import run_cli

    run_cli(main)
