"""Data as cameras and people store it: EXIF orientation, nested folders, symlinks and their
loops, names that are not UTF-8, decompression bombs, a class without validation images, and
an image removed while the run uses it."""
import json
import os
import struct
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import FAST, PROBE, PYTHON, outcome, run, torchcodec_decodes
from multi_train_utils.options import config_of  # noqa: E402
import multi_train_utils.images as images
from multi_train_utils.errors import MidRunError, UserError, report_error
from multi_train_utils.files import write_text_atomic
from multi_train_utils.checkpoint import complete_checkpoint
from multi_train_utils.run_files import file_list_fingerprint, read_inputs, warn_if_files_changed
from multi_train_utils.options import get_args_parser, parse_args
from multi_train_utils.files import RunLog
from my_dataset import build_datasets
from multi_train_utils.datasets import MyDataSet, image_file_datasets
from predict import ImageFiles
from utils import read_label_files, read_split_data

# Upright test picture: 4 quadrants of these colours (top-left, top-right, bottom-left, bottom-right).
QUADRANTS = ((220, 30, 30), (30, 200, 30), (30, 30, 220), (240, 240, 240))
PIL_LIMIT = f"{2 * Image.MAX_IMAGE_PIXELS:,}"  # what PIL refuses to open as a possible decompression bomb


def fs_name(raw):
    """A file name given as bytes (not UTF-8, say) as Python's os functions hold it."""
    return os.fsdecode(raw)


# --- EXIF orientation ----------------------------------------------------------------------------

def upright_picture(width=256, height=128):
    img = Image.new("RGB", (width, height))
    for i, colour in enumerate(QUADRANTS):
        x, y = (i % 2) * width // 2, (i // 2) * height // 2
        img.paste(colour, (x, y, x + width // 2, y + height // 2))
    return img


def assert_upright(tensor, where):
    """A (3, H, W) uint8 image of the upright picture: landscape, quadrants in place."""
    assert tensor.dtype == torch.uint8 and tensor.shape[0] == 3, where
    _, h, w = tensor.shape
    assert w == 2 * h, f"{where}: decoded as {w}x{h}, the upright picture is twice as wide as high"
    for i, colour in enumerate(QUADRANTS):
        y, x = (i // 2) * h // 2, (i % 2) * w // 2
        middle = tensor[:, y + h // 8: y + 3 * h // 8, x + w // 8: x + 3 * w // 8].float().mean(dim=(1, 2))
        assert torch.allclose(middle, torch.tensor(colour, dtype=torch.float), atol=30), \
            f"{where}: quadrant {i} is {middle.tolist()}, expected {colour}"


# How a camera stores the upright picture for each EXIF orientation (PIL's ROTATE_90 turns
# counter-clockwise): 6, the phone held upright, means "turn 90 degrees clockwise to show".
STORED = {3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270}


@pytest.mark.parametrize("orientation", sorted(STORED))
def test_every_decoder_turns_photos_upright_as_their_exif_says(orientation, tmp_path, monkeypatch):
    stored = upright_picture().transpose(STORED[orientation])
    exif = Image.Exif()
    exif[0x0112] = orientation
    jpeg, png = str(tmp_path / "phone.jpg"), str(tmp_path / "phone.png")
    stored.save(jpeg, quality=95, exif=exif)
    stored.save(png, exif=exif)
    one_image = SimpleNamespace(train_images_path=[jpeg], train_images_label=[0], val_images_path=[jpeg],
                                val_images_label=[0], classes=["a"], skipped=[], skip_reasons={}, notes=[])
    data = image_file_datasets(one_image, img_size=32)  # the datasets training builds, with their decode sizes
    for dataset in (data.train, data.val):
        dataset.transform = None  # the decoded image itself, at the reduced size training reads
    decoded = {
        f"JPEG by {images.JPEG_DECODER}": images.read_image_uint8(jpeg),
        "JPEG at reduced size": images.read_image_uint8(jpeg, keep_side=32),
        "PIL (benchmark.py)": torch.as_tensor(np.array(images.load_rgb(jpeg))).permute(2, 0, 1),
        "PNG": images.read_image_uint8(png),
        "training dataset": data.train[0][0],
        "validation dataset": data.val[0][0],
        "predict.py": ImageFiles([jpeg], transform=lambda image: image, keep_side=images.resize_size(32))[0][0],
    }
    assert decoded["JPEG at reduced size"].shape[1] < 128  # the draft path was taken
    assert torchcodec_decodes() == ("JPEG by TorchCodec" in decoded)  # its path, wherever it is installed
    monkeypatch.setattr(images, "decode_jpeg", None)  # without TorchCodec: PIL, the fallback
    decoded["PIL for a JPEG"] = images.read_image_uint8(jpeg)
    for where, tensor in decoded.items():
        assert_upright(tensor, f"orientation {orientation}, {where}")


# --- A data folder as people keep it --------------------------------------------------------------

def write_bomb(path, side=20000):
    """A PNG that claims side x side pixels (more than PIL opens): a header and no pixel data."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)  # 1-bit grayscale
    chunks = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunks)


def small_jpeg(path, shade):
    Image.new("RGB", (24, 24), (shade, 255 - shade, 90)).save(path)


def hostile_tree(root):
    """A data folder with what people's folders hold; returns the paths the tests look at.

    roses: 4 images + 1 in sub/ + 1 in sub/deeper/ + 1 in a linked folder outside = 7; a link
    to one of its own files (counted once), a link back to roses (a loop), a hidden folder.
    café (not UTF-8: b"caf\\xe9"): 4 images, one named c\\xff.jpg; a broken one named
    bad\\xff.jpg, two links pointing at each other, a decompression bomb. solo: 1 image.
    At the top: a link to itself.
    """
    roses, cafe, solo = os.path.join(root, "roses"), os.path.join(root, fs_name(b"caf\xe9")), os.path.join(root, "solo")
    outside = os.path.join(os.path.dirname(root), os.path.basename(root) + "-elsewhere")
    for folder in (os.path.join(roses, "sub", "deeper"), os.path.join(roses, ".hidden"), cafe, solo, outside):
        os.makedirs(folder)
    for i, name in enumerate(["r0.jpg", "r1.jpg", "r2.jpg", "r3.jpg", "sub/r4.jpg", "sub/deeper/r5.jpg",
                              ".hidden/h.jpg"]):
        small_jpeg(os.path.join(roses, name), 20 * i)
    small_jpeg(os.path.join(outside, "e0.jpg"), 200)
    os.symlink(outside, os.path.join(roses, "linked"))
    os.symlink("r0.jpg", os.path.join(roses, "twin.jpg"))
    os.symlink("..", os.path.join(roses, "sub", "deeper", "back"))  # -> roses/sub: a loop
    for i, name in enumerate(["c0.jpg", "c1.jpg", "c2.jpg", fs_name(b"c\xff.jpg")]):
        small_jpeg(os.path.join(cafe, name), 60 + 30 * i)
    with open(os.path.join(cafe, fs_name(b"bad\xff.jpg")), "wb") as f:
        f.write(b"not a jpeg")
    os.symlink("loop2.jpg", os.path.join(cafe, "loop1.jpg"))
    os.symlink("loop1.jpg", os.path.join(cafe, "loop2.jpg"))
    write_bomb(os.path.join(cafe, "huge.png"))
    small_jpeg(os.path.join(solo, "s0.jpg"), 10)
    os.symlink("tangle", os.path.join(root, "tangle"))
    return {"roses": roses, "cafe": cafe, "solo": solo, "outside": outside}


def expected_skips(root, tree):
    cafe = tree["cafe"]
    return {
        os.path.join(root, "tangle"): "cannot be read (Too many levels of symbolic links)",
        os.path.join(cafe, "loop1.jpg"): "cannot be read (Too many levels of symbolic links)",
        os.path.join(cafe, "loop2.jpg"): "cannot be read (Too many levels of symbolic links)",
        os.path.join(cafe, fs_name(b"bad\xff.jpg")): "not a readable image",
        os.path.join(cafe, "huge.png"): f"not a readable image: too many pixels (400,000,000 pixels, more than "
                                        f"PIL's limit of {PIL_LIMIT}, twice PIL.Image.MAX_IMAGE_PIXELS, against "
                                        "decompression bombs); shrink or remove the image",
        os.path.join(tree["roses"], "sub", "deeper", "back"):
            f"a symbolic link loop (it leads back to {os.path.realpath(os.path.join(tree['roses'], 'sub'))}, "
            "a folder above it)",
    }


SOLO_NOTE = ("class 'solo' gets no validation image (1 image(s), round(1 x --val-rate 0.2) = 0): its accuracy is "
             "never measured; add images or raise --val-rate")


def test_class_folders_are_read_as_imagefolder_reads_them_and_what_is_left_out_is_named(tmp_path):
    root = str(tmp_path / "data")
    tree = hostile_tree(root)
    split = outcome(lambda: read_split_data(root, val_rate=0.2, seed=0, check_images=True))
    assert isinstance(split, tuple), f"read_split_data failed: {split!r}"
    assert split.classes == [fs_name(b"caf\xe9"), "roses", "solo"]
    found = sorted(os.path.relpath(p, root) for p in split.train_images_path + split.val_images_path)
    assert found == sorted([os.path.join(fs_name(b"caf\xe9"), n) for n in ["c0.jpg", "c1.jpg", "c2.jpg",
                                                                           fs_name(b"c\xff.jpg")]]
                           + [os.path.join("roses", n) for n in ["r0.jpg", "r1.jpg", "r2.jpg", "r3.jpg", "sub/r4.jpg",
                                                                 "sub/deeper/r5.jpg", "linked/e0.jpg"]]
                           + ["solo/s0.jpg"])  # nested and linked folders in; the twin link once; hidden out
    # round(n * 0.2) of each class to validation: cafe 4 -> 1, roses 7 -> 1, solo 1 -> 0
    assert [split.val_images_label.count(c) for c in range(3)] == [1, 1, 0]
    assert [split.train_images_label.count(c) for c in range(3)] == [3, 6, 1]
    assert split.skip_reasons == expected_skips(root, tree)
    assert sorted(split.skipped) == sorted(expected_skips(root, tree))
    assert split.notes == [SOLO_NOTE]
    # without --check-images no image is opened: the two that PIL cannot open are listed by name
    listed = read_split_data(root, val_rate=0.2, seed=0)
    opened_only = {os.path.join(tree["cafe"], fs_name(b"bad\xff.jpg")), os.path.join(tree["cafe"], "huge.png")}
    assert set(listed.skip_reasons) == set(expected_skips(root, tree)) - opened_only
    assert opened_only <= set(listed.train_images_path + listed.val_images_path)
    assert len(listed.train_images_path) + len(listed.val_images_path) == len(found) + 2


def write_list(path, rows):
    """A label file; rows of (bytes path, bytes label), written as bytes (names that are not UTF-8)."""
    with open(path, "wb") as f:
        f.write(b"path,label\n" + b"".join(p + b"," + label + b"\n" for p, label in rows))


def test_label_files_get_the_same_handling(tmp_path):
    root = str(tmp_path / "data")
    tree = hostile_tree(root)
    listed = [(b"roses/r0.jpg", b"roses"), (b"roses/sub/deeper/r5.jpg", b"roses"), (b"roses/linked/e0.jpg", b"roses"),
              (b"roses/r1.jpg", b"roses"), (b"roses/r2.jpg", b"roses"), (b"caf\xe9/c\xff.jpg", b"caf\xe9"),
              (b"caf\xe9/c0.jpg", b"caf\xe9"), (b"caf\xe9/c1.jpg", b"caf\xe9"), (b"caf\xe9/loop1.jpg", b"caf\xe9"),
              (b"caf\xe9/huge.png", b"caf\xe9"), (b"solo/s0.jpg", b"solo")]
    write_list(os.path.join(root, "train.csv"), listed)
    listed = outcome(lambda: read_label_files(os.path.join(root, "train.csv")))  # none opened: all 11 listed
    assert isinstance(listed, tuple), f"read_label_files failed: {listed!r}"
    assert len(listed.train_images_path) + len(listed.val_images_path) == 11 and listed.skip_reasons == {}
    split = outcome(lambda: read_label_files(os.path.join(root, "train.csv"), check_images=True))
    assert isinstance(split, tuple), f"read_label_files failed: {split!r}"
    assert split.classes == [fs_name(b"caf\xe9"), "roses", "solo"]
    assert os.path.join(root, fs_name(b"caf\xe9/c\xff.jpg")) in split.train_images_path + split.val_images_path
    assert len(split.train_images_path) + len(split.val_images_path) == 9
    reasons = expected_skips(root, tree)
    assert split.skip_reasons == {p: reasons[p] for p in (os.path.join(root, fs_name(b"caf\xe9"), "loop1.jpg"),
                                                          os.path.join(root, fs_name(b"caf\xe9"), "huge.png"))}
    assert split.notes == [SOLO_NOTE]
    write_list(os.path.join(root, "val.csv"), [(b"roses/r3.jpg", b"roses"), (b"caf\xe9/c2.jpg", b"caf\xe9")])
    split = read_label_files(os.path.join(root, "train.csv"), os.path.join(root, "val.csv"))
    assert split.notes == [f"class 'solo' gets no validation image (--val-list {os.path.join(root, 'val.csv')} lists "
                           "none of its 1): its accuracy is never measured; list some of them there"]


# --- Names that are not UTF-8 ---------------------------------------------------------------------

def test_names_that_are_not_utf8_are_printed_logged_and_written_escaped(tmp_path, capsys):
    from multi_train_utils.pictures import plot_batch_preview, save_confusion_matrix, save_figure

    name = fs_name(b"caf\xe9")
    log = RunLog()
    try:
        log.attach(str(tmp_path / "train.log"))
        print(f"data: {name}: 4 images")
        report_error(UserError(f"class folder {fs_name(b'caf/x')}{name} is odd"))
        failure = None
    except UnicodeEncodeError as e:
        failure = e
    finally:
        log.close()
    assert failure is None, f"printing a name that is not UTF-8 failed: {failure}"
    out, err = capsys.readouterr()
    assert out == "data: caf\\xe9: 4 images\n" and err == "error: class folder caf/xcaf\\xe9 is odd\n"
    with open(tmp_path / "train.log", encoding="ascii") as f:
        assert f.read() == "data: caf\\xe9: 4 images\nerror: class folder caf/xcaf\\xe9 is odd\n"
    # files: text files keep the name's own bytes; pictures draw it escaped
    write_text_atomic(f"{name}\n", str(tmp_path / "names.txt"))
    with open(tmp_path / "names.txt", "rb") as f:
        assert f.read() == b"caf\xe9\n"
    classes = [name, "roses"]
    drawn = outcome(lambda: (save_confusion_matrix(torch.tensor([[1, 0], [1, 2]]), classes, str(tmp_path), name),
                             save_figure(plot_batch_preview([torch.zeros(3, 8, 8, dtype=torch.uint8)] * 2, [0, 1],
                                                            classes), str(tmp_path / "batch.png"))))
    assert not isinstance(drawn, Exception), f"drawing a name that is not UTF-8 failed: {drawn!r}"
    assert os.path.getsize(tmp_path / "confusion_matrix.png") > 0 and os.path.getsize(tmp_path / "batch.png") > 0
    with open(tmp_path / "confusion_matrix.csv", "rb") as f:  # a CSV is for spreadsheets: UTF-8, escaped
        assert f.read().startswith(b"true/predicted,caf\\xe9,roses\r\n")


# --- An image removed while the run uses it -------------------------------------------------------

def test_an_image_gone_mid_run_is_one_line_naming_it(tmp_path, capsys):
    path = str(tmp_path / "gone.jpg")
    small_jpeg(path, 0)
    dataset = MyDataSet([path], [0])
    os.remove(path)
    error = outcome(lambda: dataset[0])
    assert isinstance(error, MidRunError), f"expected a MidRunError, got {error!r}"
    gone = f"image {path} is gone (deleted or moved after the data was listed); put it back, or take it out of the data"
    assert str(error) == gone
    # a loader worker's error reaches the main process with the worker's traceback as its text
    in_worker = MidRunError(f"Caught MidRunError in DataLoader worker process 0.\nOriginal Traceback (most recent "
                            f"call last):\n  File \"x.py\", line 1, in f\nmulti_train_utils.errors.MidRunError: {gone}")
    for raised in (error, in_worker):
        report_error(raised)
        assert capsys.readouterr().err == f"error: {gone}\n"  # the run adds the checkpoint to resume from


# --- A whole run on such a folder (one subprocess) ------------------------------------------------

@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory):
    """train_single.py --check-images on the hostile tree, 2 epochs, one loader worker; a
    validation image is deleted as epoch 1 begins."""
    base = tmp_path_factory.mktemp("hostile")
    root, out = str(base / "data"), str(base / "out")
    tree = hostile_tree(root)
    split = read_split_data(root, val_rate=0.2, seed=0, check_images=True)
    data = image_file_datasets(split, 32)
    fingerprint = file_list_fingerprint(data)
    victim = next(p for p, y in zip(split.val_images_path, split.val_images_label) if split.classes[y] == "roses")
    flags = ["--data-path", root, "--check-images", *FAST, "--output-dir", out, "--log-dir", out + "-tb", "--epochs", "2"]
    result = run([PYTHON, PROBE, "single", *flags, "--workers", "1"],
                 env={"PROBE_REMOVE_AT_EPOCH": f"1:{victim}"})
    return {"root": root, "out": out, "tree": tree, "result": result, "victim": victim, "flags": flags,
            "fingerprint": fingerprint}


def test_a_run_on_a_hostile_folder_warns_trains_and_leaves_out_an_image_that_vanishes(hostile_run):
    result, root, out = hostile_run["result"], hostile_run["root"], hostile_run["out"]
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    gone = (f"image {hostile_run['victim']} is gone (deleted or moved after the data was listed); put it back, or "
            "take it out of the data; left out of this validation")
    printed = [line.removeprefix("warning: ") for line in result.stdout.splitlines() if line.startswith("warning: ")]
    skips = {path.replace(os.fsdecode(b"\xe9"), "\\xe9").replace(os.fsdecode(b"\xff"), "\\xff"): why
             for path, why in expected_skips(root, hostile_run["tree"]).items()}
    imbalance = ("the classes are imbalanced: roses has 6 training images, solo 1; consider --sampler balanced or "
                 "--class-weights balanced")  # 3 caf\xe9, 6 roses, 1 solo
    assert printed == [f"skipping {path}: {why}" for path, why in skips.items()] + [SOLO_NOTE, imbalance]
    assert [line for line in result.stderr.splitlines() if line.startswith("warning: ")] == ["warning: " + gone]
    assert f"data: {root}: 4 caf\\xe9, 7 roses, 1 solo\nsplit: 10 train, 2 val images\n" in result.stdout
    epochs = [line.split("val_accuracy: ")[1].split(")")[0] for line in result.stdout.splitlines()
              if line.startswith("[epoch ")]
    assert [e.split("(")[1].split("/")[1] for e in epochs] == ["2", "1, 1 unreadable left out"], epochs
    with open(os.path.join(out, "train.log"), encoding="utf-8") as f:  # strict: no raw bytes in it
        log = f.read()
    assert "warning: skipping " + os.path.join(root, "caf\\xe9", "bad\\xff.jpg: not a readable image\n") in log
    with open(os.path.join(out, "class_indices.json")) as f:
        assert json.load(f) == {"0": fs_name(b"caf\xe9"), "1": "roses", "2": "solo"}
    checkpoint = torch.load(os.path.join(out, "checkpoint.pth"), map_location="cpu", weights_only=True)
    assert checkpoint["epoch"] == 1 and checkpoint["file_list"] == hostile_run["fingerprint"]


def test_a_resume_whose_files_differ_from_the_checkpoints_warns(hostile_run, capsys):
    out = hostile_run["out"]
    args = parse_args(get_args_parser(distributed=False), [*hostile_run["flags"], "--epochs", "3", "--resume", "auto"])
    capsys.readouterr()
    inputs = read_inputs(config_of(args), lambda: build_datasets(args), torch.device("cpu"))  # the victim is gone: one validation image less
    inputs.output_lock.discard()
    assert inputs.checkpoint["file_list"] == hostile_run["fingerprint"]
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: --resume")]
    assert warnings == [f"warning: --resume {out}/checkpoint.pth: the data's files are not those the checkpoint was "
                        "trained on (10 train + 2 val images then, 9 + 2 now: files were added, removed, renamed or "
                        "moved); training goes on with the files as they are now, so the run will not repeat the "
                        "original exactly"]
    same = dict(inputs.checkpoint, file_list=file_list_fingerprint(inputs.data))
    old = complete_checkpoint({k: v for k, v in same.items() if k != "file_list"})  # as load_checkpoint reads one
    for checkpoint in (same, old):  # the same files; an old checkpoint
        warn_if_files_changed(checkpoint, "x", inputs.data)
        assert capsys.readouterr().out == ""
