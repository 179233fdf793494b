"""Outputs in a hostile world: predict.py and export.py never write over a user's file or an
input, predict.py names and skips every file it cannot read, and CSV files open safely."""
import csv
import errno
import io
import json
import os
import random
import shutil
import struct
import zlib

import pytest
import torch

import export
import predict
from conftest import CLASSES, PYTHON, run, script, write_class_folder
from multi_train_utils.errors import UserError, printable
from multi_train_utils.files import csv_text
from multi_train_utils.pictures import confusion_matrix_csv
from multi_train_utils.run_files import read_metrics, write_metrics

# Class names a spreadsheet would run as formulas, and one that breaks a CSV joined by hand.
HOSTILE_CLASSES = ['=HYPERLINK("http://x","y")', "+cmd|' /C calc'!A0", "-2+3", "@SUM(A1)", 'a,b "q"\nline']
NEUTRALISED = ["'" + name for name in HOSTILE_CLASSES[:4]] + [HOSTILE_CLASSES[4]]


@pytest.fixture
def trained(single_run, tmp_path):
    """A copy of a finished run's weights, args.json and class_indices.json (never the original)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("model-best.pth", "args.json", "class_indices.json"):
        shutil.copy(os.path.join(single_run["out"], name), run_dir / name)
    return run_dir


def contents(folder):
    """{name: bytes} of the files in ``folder``, hidden ones included."""
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def png_header(width, height):
    """A 57-byte PNG that declares ``width`` x ``height`` pixels: PIL refuses it on opening."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IEND", b""))


def read_csv(path):
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")  # strict: an unescaped name that is not UTF-8 fails here
    except UnicodeDecodeError as e:
        text = e
    assert isinstance(text, str), f"{path} is not UTF-8: {text}"
    return list(csv.reader(io.StringIO(text, newline="")))


# --- predict.py finishes the folder ----------------------------------------------------------------

def test_predict_names_and_skips_every_file_it_cannot_read_and_writes_the_rest(trained, tmp_path):
    (trained / "class_indices.json").write_text(json.dumps(dict(enumerate(HOSTILE_CLASSES))))
    folder = tmp_path / "photos"
    write_class_folder(str(folder), "roses", 2, random.Random(3))  # roses/roses_000.jpg, roses_001.jpg
    good = sorted((folder / "roses").iterdir())
    odd_name = os.fsencode(folder) + b"/caf\xe9-\xff.jpg"  # Latin-1 bytes: not UTF-8
    with open(odd_name, "wb") as f:
        f.write(good[0].read_bytes())
    (folder / "bomb.png").write_bytes(png_header(30000, 30000))  # 9e8 pixels in 57 bytes
    os.symlink(tmp_path / "gone.jpg", folder / "dangling.jpg")
    os.symlink("loop_b.jpg", folder / "loop_a.jpg")
    os.symlink("loop_a.jpg", folder / "loop_b.jpg")
    output = tmp_path / "predictions.csv"

    result = run([PYTHON, script("predict.py"), "--weights", str(trained / "model-best.pth"),
                  "--image", str(folder), "--output", str(output), "--device", "cpu"])
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stdout + result.stderr
    warnings = sorted(line[line.index("warning: "):] for line in result.stdout.splitlines() if "warning: " in line)
    assert warnings == [
        f"warning: skipping {folder}/bomb.png: not a readable image: too many pixels (900,000,000 pixels, more than "
        "PIL's limit of 178,956,970, twice PIL.Image.MAX_IMAGE_PIXELS, against decompression bombs); shrink or "
        "remove the image",
        f"warning: skipping {folder}/dangling.jpg: cannot read it: a symbolic link to a missing file",
        f"warning: skipping {folder}/loop_a.jpg: cannot read it: a loop of symbolic links",
        f"warning: skipping {folder}/loop_b.jpg: cannot read it: a loop of symbolic links",
    ], result.stdout
    assert result.stdout.strip().splitlines()[-1] == \
        f"wrote 3 predictions to {output}; skipped 4 that could not be read (named above)"

    header, *rows = read_csv(output)
    assert header == ["path", "prediction", "probability", *NEUTRALISED]
    assert [r[0] for r in rows] == [f"{folder}/caf\\xe9-\\xff.jpg", str(good[0]), str(good[1])]
    for row in rows:
        probabilities = [float(v) for v in row[3:]]
        assert sum(probabilities) == pytest.approx(1, abs=1e-4)
        assert row[1] == NEUTRALISED[probabilities.index(max(probabilities))]
    assert rows[0][1:] == rows[1][1:]  # the same image under an odd name: the same prediction


def test_predict_skips_a_file_or_folder_it_may_not_read(trained, tmp_path, monkeypatch, capsys):
    """Permission errors are injected: CI runs as root, who may read any file."""
    folder = tmp_path / "photos"
    write_class_folder(str(folder), "roses", 2, random.Random(4))
    write_class_folder(str(folder / "locked"), "tulips", 1, random.Random(5))
    secret = folder / "roses" / "roses_001.jpg"
    read_image, scandir = predict.read_image_uint8, os.scandir

    def read_image_or_refuse(path, keep_side=None, channels=3):
        if path == str(secret):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return read_image(path, keep_side, channels)

    def scandir_or_refuse(path="."):
        if os.fspath(path) == str(folder / "locked"):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return scandir(path)

    monkeypatch.setattr(predict, "read_image_uint8", read_image_or_refuse)
    monkeypatch.setattr(os, "scandir", scandir_or_refuse)
    flags = ["--weights", str(trained / "model-best.pth"), "--workers", "0", "--device", "cpu"]
    predict.main([*flags, "--image", str(folder)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert f"warning: skipping folder {folder / 'locked'}: cannot read it: Permission denied" in lines
    assert any(line.endswith(f"warning: skipping {secret}: cannot read it: Permission denied") for line in lines)
    assert sum(line.startswith(str(folder / "roses" / "roses_000.jpg") + ": ") for line in lines) == 1
    assert lines[-1] == "predicted 1 image; skipped 2 that could not be read (named above)"

    output = tmp_path / "none.csv"
    with pytest.raises(UserError, match=r"--image .*roses_001.jpg: no image could be read"):
        predict.main([*flags, "--image", str(secret), "--output", str(output)])
    with pytest.raises(UserError, match=r"--image .*locked: no image files could be listed \(.*locked: cannot read "
                                        r"it: Permission denied\)"):
        predict.main([*flags, "--image", str(folder / "locked"), "--output", str(output)])
    assert not output.exists()


# --- Never write over a user's file or an input ------------------------------------------------------

def refused(main, argv, message):
    """``main(argv)`` stops with a UserError matching ``message``; returns its text."""
    with pytest.raises(UserError, match=message) as caught:
        main(argv)
    return str(caught.value)


def test_predict_and_export_never_write_over_an_input_nor_unasked_over_a_file(trained, tmp_path, monkeypatch):
    weights = str(trained / "model-best.pth")
    image = tmp_path / "photos" / "roses" / "roses_000.jpg"
    write_class_folder(str(tmp_path / "photos"), "roses", 1, random.Random(6))
    (tmp_path / "names.json").write_text(json.dumps(dict(enumerate(CLASSES))))
    os.symlink(weights, tmp_path / "link.pth")
    os.link(trained / "args.json", tmp_path / "hard-link.json")
    mine = tmp_path / "mine.csv"
    mine.write_text("a file of the user's")
    program = tmp_path / "model.pt2"  # a .pt2 carries its run inside; --class-indices is still an input
    program.write_bytes(b"an exported program")
    before = {**contents(trained), **contents(tmp_path)}

    def work_started(*args, **kwargs):
        raise AssertionError("the output was checked after the work began")

    monkeypatch.setattr(predict, "load_trained_model", work_started)
    monkeypatch.setattr(export, "load_trained_model", work_started)
    monkeypatch.chdir(trained)
    reads = "which this command reads; choose another path"
    for output in (weights, "./model-best.pth", "../run/args.json", str(tmp_path / "link.pth"),
                   str(tmp_path / "hard-link.json"), "class_indices.json", str(tmp_path / "names.json")):
        for overwrite in ([], ["--overwrite"]):
            for main, flags in ((export.main, []), (predict.main, ["--image", str(image)])):
                refused(main, ["--weights", weights, "--class-indices", str(tmp_path / "names.json"), *flags,
                               "--output", output, *overwrite], reads)
    for overwrite in ([], ["--overwrite"]):
        refused(predict.main, ["--weights", str(program), "--class-indices", str(tmp_path / "names.json"),
                               "--image", str(image), "--output", str(tmp_path / "names.json"), *overwrite], reads)
    refused(predict.main, ["--weights", weights, "--image", str(image.parent), "--output", str(image), "--overwrite"],
            f"--output {image}: is an image to predict .*{reads}")
    for main, flags in ((export.main, ["--format", "onnx"]), (predict.main, ["--image", str(image)])):
        refused(main, ["--weights", weights, *flags, "--output", str(mine)],
                f"--output {mine}: exists; pass --overwrite to replace it, or choose another path")
        refused(main, ["--weights", weights, *flags, "--output", str(tmp_path)], "is a folder")
    (tmp_path / "link.pth").unlink()
    os.symlink(weights, trained / "model-best.pt2")
    refused(export.main, ["--weights", weights, "--overwrite"],
            "model-best.pt2: is the --weights file")  # the default name, a link to the weights
    (trained / "model-best.pt2").unlink()
    assert {**contents(trained), **contents(tmp_path)} == {k: v for k, v in before.items() if k != "link.pth"}


def test_with_overwrite_only_a_checked_export_replaces_the_file(trained, tmp_path, monkeypatch, capsys):
    from multi_train_utils.run_files import TrainedModel

    weights, output = str(trained / "model-best.pth"), tmp_path / "model.pt2"
    output.write_bytes(b"an earlier export")
    tiny = torch.nn.Sequential(torch.nn.Conv2d(3, 5, 8), torch.nn.Flatten()).eval()  # exported in a second
    monkeypatch.setattr(export, "load_trained_model",
                        lambda args, create_model, make_task: TrainedModel(tiny, "tiny", 8, CLASSES,
                                                                           task=make_task("single-label")))
    monkeypatch.setattr(export, "TOLERANCE", -1.0)  # every check fails
    refused(export.main, ["--weights", weights, "--output", str(output), "--overwrite"], "differs from the eager one")
    assert sorted(os.listdir(tmp_path)) == ["model.pt2", "run"] and output.read_bytes() == b"an earlier export"

    monkeypatch.setattr(export, "TOLERANCE", 1e-4)
    export.main(["--weights", weights, "--output", str(output), "--overwrite"])
    printed = capsys.readouterr().out
    assert printed.startswith(f"wrote {output} (pt2")
    assert "shorter side resized to 9, center-cropped" in printed  # round(8 x 256 / 224): no --val-resize-size
    assert sorted(os.listdir(tmp_path)) == ["model.pt2", "run"]
    images = torch.randn(2, 3, 8, 8)
    assert torch.equal(torch.export.load(str(output)).module()(images), tiny(images))
    # a program under another name would not load by torch.export.load: refused before any work
    refused(export.main, ["--weights", weights, "--output", str(tmp_path / "model.pt")], "must end in .pt2")
    assert sorted(os.listdir(tmp_path)) == ["model.pt2", "run"]


# --- CSV files that are safe to open ------------------------------------------------------------------

def test_every_csv_is_quoted_by_the_csv_module_and_formulas_are_neutralised(tmp_path):
    cells = ["=1+1", "+cmd", "-x", "@x", "\tx", "\rx", "a,b", 'say "hi"', "two\nlines", "plain", "caf\udce9",
             -0.5, 3, "-0.5", "+2", "-1e-3", "-inf", "nan"]
    (back,) = list(csv.reader(io.StringIO(csv_text([cells]), newline="")))
    assert back == ["'=1+1", "'+cmd", "'-x", "'@x", "'\tx", "'\rx", "a,b", 'say "hi"', "two\nlines", "plain",
                    "caf\\xe9", "-0.5", "3", "-0.5", "+2", "-1e-3", "-inf", "nan"]
    assert printable(b"\xff.jpg") == "\\xff.jpg" and printable("\ud800") == "\\ud800"

    confusion = torch.arange(25).view(5, 5)
    rows = list(csv.reader(io.StringIO(confusion_matrix_csv(confusion, HOSTILE_CLASSES), newline="")))
    assert rows[0] == ["true/predicted", *NEUTRALISED]
    assert rows[1:] == [[name, *(str(v) for v in range(5 * i, 5 * i + 5))] for i, name in enumerate(NEUTRALISED)]

    metrics = [[0, "1.500000", "0.400000", "0.001", "12.50", "3.000"], [1, "-0.5", "0.5", "1e-05", "nan", "2"]]
    write_metrics(str(tmp_path), metrics)
    # the six columns as written; the later ones empty for rows that lack them
    assert [list(r.values()) for r in read_metrics(str(tmp_path))] == [[str(v) for v in r] + [""] * 15 for r in metrics]
