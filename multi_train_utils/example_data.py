"""Data to start with: the tutorial's flower_photos (--download) and generated demo flowers (--demo).

The download is checked by size, SHA-256 and image counts; the demo data needs no network."""
import glob
import hashlib
import math
import os
import random
import shutil
import tarfile
import tempfile
import time
import urllib.error
import urllib.request

from PIL import Image, ImageDraw, ImageFilter
from tqdm import tqdm

from multi_train_utils.errors import UserError
from multi_train_utils.data_split import FLOWER_PHOTOS_URL, list_images

# As TensorFlow Datasets records them.
FLOWER_PHOTOS_BYTES = 228_813_984
FLOWER_PHOTOS_SHA256 = "4c54ace7911aaffe13a365c34f650e71dd5bf1be0a58b464e5a7183e3e595d9c"
FLOWER_PHOTOS_COUNTS = {"daisy": 633, "dandelion": 898, "roses": 641, "sunflowers": 699, "tulips": 799}


# --- Downloading flower_photos ----------------------------------------------------------------------

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

    def jitter(colour, amount=25):
        return tuple(max(0, min(255, c + rng.randint(-amount, amount))) for c in colour)

    w, h = size
    img = Image.new("RGB", size, jitter((60, 120, 50), 30))
    draw = ImageDraw.Draw(img)
    for _ in range(12):  # leaves and stems in the background
        x, y = rng.randrange(w), rng.randrange(h)
        r = rng.randint(min(w, h) // 12, min(w, h) // 5)
        draw.ellipse((x - r, y - r // 3, x + r, y + r // 3), fill=jitter((40, 100, 35), 30))
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
