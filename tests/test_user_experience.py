"""What a user sees and gets: the flower download, pictures of a run, train.log, the start and
end summaries, predict.py, --eval-output and export.py."""
import csv
import glob
import hashlib
import json
import os
import random
import tarfile

import pytest
import torch
from PIL import Image

import predict
from conftest import CLASSES, MODEL, PYTHON, REPO, outcome, read_metrics, run, script, write_class_folder
from multi_train_utils.errors import UserError
from multi_train_utils.datasets import download_flower_photos
from multi_train_utils.images import IMAGENET_MEAN, IMAGENET_STD
from multi_train_utils.pictures import plot_class_distribution, save_figure

PNGS = ("class_distribution.png", "batch_preview.png", "curves.png", "confusion_matrix.png")


# --- --download ---------------------------------------------------------------------------------

@pytest.fixture
def flower_archive(tmp_path):
    """A small flower_photos.tgz built here: flower_photos/<class>/*.jpg plus a LICENSE.txt."""
    source = tmp_path / "source" / "flower_photos"
    rng = random.Random(0)
    counts = {"daisy": 3, "roses": 2}
    for name, count in counts.items():
        write_class_folder(str(source), name, count, rng)
    (source / "LICENSE.txt").write_text("licence text")
    archive = tmp_path / "flower_photos.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(source, arcname="flower_photos")
    data = archive.read_bytes()
    return {"url": archive.as_uri(), "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "counts": counts}


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir())


def test_download_with_a_wrong_checksum_is_rejected_and_leaves_nothing(flower_archive, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for change, message in (({"sha256": "0" * 64}, "SHA-256"), ({"size": flower_archive["size"] + 1}, "bytes")):
        settings = {**flower_archive, **change}
        with pytest.raises(UserError, match=message):
            download_flower_photos(str(data / "flower_photos"), **settings)
        assert leftovers(data) == []  # no archive, no half-extracted folder


def test_download_extracts_class_folders_once(flower_archive, tmp_path):
    root = tmp_path / "data" / "flower_photos"
    download_flower_photos(str(root), **flower_archive)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["daisy", "roses"]
    assert len(list((root / "daisy").glob("*.jpg"))) == 3 and len(list((root / "roses").glob("*.jpg"))) == 2
    assert leftovers(root.parent) == ["flower_photos"]
    stamp = os.stat(root / "daisy").st_mtime_ns
    # a second call does nothing: not even the (now unreachable) URL is opened
    download_flower_photos(str(root), url="file:///nonexistent/flower_photos.tgz", size=1, sha256="0")
    assert os.stat(root / "daisy").st_mtime_ns == stamp


@pytest.mark.parametrize("expected", [4, 2])  # the archive's daisy folder holds 3: one fewer, one more
def test_download_with_wrong_class_counts_is_rejected(flower_archive, tmp_path, expected):
    data = tmp_path / "data"
    settings = {**flower_archive, "counts": {"daisy": expected, "roses": 2}}
    with pytest.raises(UserError, match=f"daisy has 3 images, expected {expected}"):
        download_flower_photos(str(data / "flower_photos"), **settings)
    assert leftovers(data) == []


# --- What a training run leaves ------------------------------------------------------------------

def test_a_run_draws_every_picture(single_run):
    out = single_run["out"]
    for name in PNGS:
        path = os.path.join(out, name)
        with Image.open(path) as img:
            img.verify()
        with Image.open(path) as img:
            assert img.format == "PNG" and min(img.size) >= 200, (name, img.size)
        assert os.path.getsize(path) > 5000, name
    with open(os.path.join(out, "confusion_matrix.csv")) as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["true/predicted", *CLASSES] and [r[0] for r in rows[1:]] == CLASSES
    counts = [[int(v) for v in r[1:]] for r in rows[1:]]
    assert sum(map(sum, counts)) == 7  # every validation image once
    assert [sum(r) for r in counts] == [2, 2, 1, 1, 1]
    best = max(float(r["val_accuracy"]) for r in read_metrics(out))
    assert sum(counts[i][i] for i in range(5)) == round(best * 7)  # the best epoch's matrix


def test_tensorboard_holds_the_pictures(single_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = glob.glob(single_run["out"] + "-tb/*/events.out.tfevents.*")
    accumulator = EventAccumulator(events, size_guidance={"images": 0})
    accumulator.Reload()
    assert set(accumulator.Tags()["images"]) == {"data/class_distribution", "data/batch_preview",
                                                 "summary/curves", "summary/confusion_matrix", "summary/most_confused"}
    # the metrics.csv figures (no top-5 with 5 classes, no ema/ without --model-ema)
    assert set(accumulator.Tags()["scalars"]) == {"loss", "learning_rate", "images_per_second", "accuracy",
                                                  "balanced_accuracy", "macro_f1", "val_loss"}
    rows = read_metrics(single_run["out"])
    assert [round(e.value, 6) for e in accumulator.Scalars("macro_f1")] == [float(r["val_macro_f1"]) for r in rows]


def test_train_log_and_summaries(single_run):
    with open(os.path.join(single_run["out"], "train.log"), newline="") as f:
        log = f.read()
    assert "\r" not in log
    stdout = single_run["result"].stdout
    for text in ("world size: 1 (single process", "split: 36 train, 7 val images", f"model: {MODEL}",
                 "batch: 4 per process x 1 accumulation step x 1 process = 4 per optimizer step",
                 "[epoch 1] train_loss", "best val accuracy:", "best weights: ", "plots: ",
                 "tensorboard --logdir"):
        assert text in stdout, text
        assert text in log, text
    assert log.count("[train epoch 0]") == 1  # the bar's final state only
    assert "broken.jpg: not a readable image" in log  # printed before the output folder was ready


def test_ddp_train_log_is_written_by_rank_0_only(ddp_run):
    with open(os.path.join(ddp_run["out"], "train.log"), newline="") as f:
        log = f.read()
    assert "\r" not in log
    assert log.count("world size: 2 (torchrun, backend gloo)") == 1 and log.count("[epoch 1] train_loss") == 1
    assert not glob.glob(os.path.join(ddp_run["out"], "*.png"))  # this run had --no-plots


def test_plot_command_redraws_curves_of_a_finished_run(single_run, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(single_run["out"], run_dir)
    os.remove(run_dir / "curves.png")
    result = run([PYTHON, "-m", "multi_train_utils.pictures", str(run_dir)])
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout and "(2 epochs)" in result.stdout
    with Image.open(run_dir / "curves.png") as img:
        assert min(img.size) >= 200
    missing = run([PYTHON, "-m", "multi_train_utils.pictures", str(tmp_path / "nope")])
    assert missing.returncode == 2 and "metrics.csv: cannot be read" in missing.stderr


# --- What the pictures show (in-process, no training run) ----------------------------------------

FIVE_CLASSES = ["daisy", "dandelion_meadow_wild", "roses", "sunflowers_giant_russian", "tulips"]
TWELVE_CLASSES = [f"species_{i:02d}" + "_var" * (i % 4) for i in range(12)]


def drawn(fig):
    """Render ``fig`` with the Agg canvas (as savefig and TensorBoard do); return its renderer."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def assert_tick_labels_readable(fig, ax, renderer, classes, y_names):
    """The tick labels are the class names in order; y labels end left of the axes, x labels
    below them; none is cut off the figure; unrotated x labels do not overlap each other."""
    figure_box, axes_box = fig.bbox, ax.get_window_extent(renderer)
    for axis in (ax.yaxis,) if y_names else ():
        assert [t.get_text() for t in axis.get_ticklabels()] == classes
        for label in axis.get_ticklabels():
            box = label.get_window_extent(renderer)
            assert box.x1 <= axes_box.x0, f"y label {label.get_text()!r} ends at x={box.x1:.1f}, " \
                                          f"inside the axes starting at x={axes_box.x0:.1f}"
            assert box.x0 >= 0 and box.y0 >= 0 and box.y1 <= figure_box.y1, \
                f"y label {label.get_text()!r} is cut off the figure: {box}"
    labels = ax.xaxis.get_ticklabels()
    assert [t.get_text() for t in labels] == classes
    boxes = [label.get_window_extent(renderer) for label in labels]
    for label, box in zip(labels, boxes):
        assert box.y1 <= axes_box.y0, f"x label {label.get_text()!r} reaches into the axes: {box}"
        assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= figure_box.x1, \
            f"x label {label.get_text()!r} is cut off the figure: {box}"
    if not labels[0].get_rotation():
        for (left, a), (right, b) in zip(zip(classes, boxes), zip(classes[1:], boxes[1:])):
            assert a.x1 <= b.x0, f"x labels {left!r} and {right!r} overlap"


@pytest.mark.parametrize("classes", [FIVE_CLASSES, TWELVE_CLASSES], ids=["5-classes", "12-classes"])
def test_confusion_matrix_picture_shows_every_class_and_count(classes, tmp_path, monkeypatch):
    """What a run writes (save_confusion_matrix): the figure of its PNG and its CSV."""
    from multi_train_utils import pictures

    n = len(classes)
    generator = torch.Generator().manual_seed(n)
    confusion = torch.randint(0, 30, (n, n), generator=generator) + 40 * torch.eye(n, dtype=torch.int64)
    confusion[0, 1], confusion[1, 0] = 7, 0  # not symmetric: a transposed matrix would show
    figures = []
    monkeypatch.setattr(pictures, "save_figure", lambda fig, path, *args: figures.append((fig, path)) or
                        save_figure(fig, path, *args))
    pictures.save_confusion_matrix(confusion, classes, str(tmp_path), "validation")
    ((fig, path),) = [(f, p) for f, p in figures if p.endswith("confusion_matrix.png")]
    renderer = drawn(fig)
    (ax,) = fig.axes[:1]
    assert_tick_labels_readable(fig, ax, renderer, classes, y_names=True)

    drawn_counts = [[None] * n for _ in range(n)]
    for text in ax.texts:
        column, row = text.get_position()
        drawn_counts[round(row)][round(column)] = int(text.get_text())
    assert drawn_counts == confusion.tolist()
    with open(tmp_path / "confusion_matrix.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["true/predicted", *classes] and [r[0] for r in rows[1:]] == classes
    assert [[int(v) for v in r[1:]] for r in rows[1:]] == drawn_counts  # the picture and its CSV agree
    assert ax.get_title().endswith(f"(accuracy {int(confusion.diag().sum()) / int(confusion.sum()):.4f})")
    assert path == str(tmp_path / "confusion_matrix.png")
    with Image.open(path) as img:
        assert img.format == "PNG" and min(img.size) >= 300


def test_class_distribution_picture_labels_are_readable():
    for classes in (CLASSES, FIVE_CLASSES, TWELVE_CLASSES):  # the flower names stay unrotated
        fig = plot_class_distribution(list(classes), [3] * len(classes), [1] * len(classes))
        renderer = drawn(fig)
        assert_tick_labels_readable(fig, fig.axes[0], renderer, classes, y_names=False)


# --- predict.py -----------------------------------------------------------------------------------

def test_predict_a_file_and_a_folder_with_a_corrupt_image(single_run, tiny_data, tmp_path):
    import json
    import shutil

    # the weights with their args.json, and class names that only class_indices.json knows
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("model-best.pth", "args.json"):
        shutil.copy(os.path.join(single_run["out"], name), run_dir / name)
    names = [f"kind-{c}" for c in CLASSES]
    (run_dir / "class_indices.json").write_text(json.dumps({str(i): c for i, c in enumerate(names)}))
    weights = str(run_dir / "model-best.pth")
    folder = tmp_path / "photos"
    write_class_folder(str(folder), "roses", 3, random.Random(5))
    write_class_folder(str(folder / "more"), "tulips", 2, random.Random(6))
    (folder / "corrupt.jpg").write_bytes(b"not a jpeg at all")
    one = sorted((folder / "roses").glob("*.png")) + sorted((folder / "roses").glob("*.jpg"))

    single = run([PYTHON, script("predict.py"), "--weights", weights, "--image", str(one[0]), "--top-k", "2"])
    assert single.returncode == 0, single.stderr
    (line,) = [l for l in single.stdout.splitlines() if l.startswith(str(one[0]))]
    top = [part.rsplit(" ", 1)[0] for part in line.split(": ", 1)[1].split(", ")]
    assert len(top) == 2 and set(top) <= set(names)

    output = tmp_path / "predictions.csv"
    many = run([PYTHON, script("predict.py"), "--weights", weights, "--image", str(folder), "--output", str(output)])
    assert many.returncode == 0, many.stderr
    assert f"skipping {folder / 'corrupt.jpg'}" in many.stdout
    with open(output) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 5  # 3 + 2 in a sub-folder; the corrupt one skipped
    assert list(rows[0]) == ["path", "prediction", "probability", *names]  # class_indices.json's names
    for row in rows:
        probabilities = [float(row[c]) for c in names]
        assert sum(probabilities) == pytest.approx(1, abs=1e-4)
        assert row["prediction"] == names[probabilities.index(max(probabilities))]
    missing = run([PYTHON, script("predict.py"), "--weights", str(run_dir / "nope.pth"), "--image", str(folder)])
    assert missing.returncode == 2 and "nope.pth: no such file" in missing.stderr


# --- --eval-only with --eval-output and a checkpoint --------------------------------------------

def test_eval_only_writes_the_confusion_matrix_only_with_eval_output(single_run, tmp_path):
    out = single_run["out"]
    target = tmp_path / "evaluation"
    result = run([PYTHON, script("train_single.py"), "--eval-only", "--weights", os.path.join(out, "checkpoint.pth"),
                  "--workers", "0", "--eval-output", str(target)], cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    correct = round(float(read_metrics(out)[-1]["val_accuracy"]) * 7)  # checkpoint.pth: the last epoch
    assert result.stdout.strip().splitlines()[-1] == f"top1 accuracy: {correct / 7:.6f} ({correct}/7)"
    confused = ["most_confused.png"] if correct < 7 else []  # drawn where the model confused any classes
    assert sorted(os.listdir(target)) == ["confusion_matrix.csv", "confusion_matrix.png", *confused,
                                          "overall_metrics.csv", "per_class_metrics.csv"]
    with open(target / "confusion_matrix.csv") as f:
        counts = [[int(v) for v in r[1:]] for r in list(csv.reader(f))[1:]]
    assert sum(map(sum, counts)) == 7 and sum(counts[i][i] for i in range(5)) == correct
    with open(target / "overall_metrics.csv") as f:
        overall = dict(list(csv.reader(f))[1:])
    assert float(overall["top1_accuracy"]) == correct / 7 and int(overall["images"]) == 7
    assert "top5_accuracy" not in overall  # 5 classes
    with open(target / "per_class_metrics.csv") as f:
        per_class = list(csv.reader(f))[1:]
    assert [int(r[1]) for r in per_class] == [sum(row) for row in counts]  # images per class
    assert sorted(os.listdir(tmp_path)) == ["evaluation"]  # nothing else written


# --- export.py ------------------------------------------------------------------------------------

def exported_matches_eager(single_run, tmp_path, fmt, load, env=None, flags=()):
    """export.py --format ``fmt`` exits 0, and ``load(path, images)`` of its file gives the eager
    model's logits (loaded here from the weights) on a batch of another size; its result."""
    from model import create_model

    weights = os.path.join(single_run["out"], "model-best.pth")
    output = tmp_path / f"model.{fmt}"
    result = run([PYTHON, script("export.py"), "--weights", weights, "--format", fmt, "--output", str(output),
                  *flags], env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "max difference to the eager model" in result.stdout
    model = create_model(MODEL, 5)
    model.load_state_dict(torch.load(weights, weights_only=True))
    model.eval()
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (load(str(output), images) - model(images)).abs().max() <= 1e-4
    return result


# Loads the .pt2 as a deployment would: torch alone, in a new process in another folder, where no
# module of the project is imported or importable (its folder taken off sys.path).
LOAD_PT2 = """
import importlib.util, json, os, sys, torch
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != sys.argv[4]]
assert importlib.util.find_spec("multi_train_utils") is None and "model" not in sys.modules
extra = {"run.json": ""}
model = torch.export.load(sys.argv[1], extra_files=extra).module()
assert not any(name.split(".")[0] in ("multi_train_utils", "model", "export") for name in sys.modules)
torch.save({"logits": model(torch.load(sys.argv[2])), "run": json.loads(extra["run.json"])}, sys.argv[3])
"""


def test_export_pt2_loads_with_torch_alone_and_predict_py_runs_it(single_run, tiny_data, tmp_path):
    """The .pt2 (with a resize of 48) loads in another folder with torch alone and gives the
    eager logits, with the run inside; predict.py on it alone predicts as on the .pth."""
    elsewhere = tmp_path / "deployment"
    elsewhere.mkdir()

    (elsewhere / "load.py").write_text(LOAD_PT2)

    def load(path, images):
        torch.save(images, elsewhere / "images.pt")
        result = run([PYTHON, str(elsewhere / "load.py"), path, "images.pt", "out.pt", REPO], cwd=str(elsewhere),
                     env={"PYTHONPATH": ""})
        assert result.returncode == 0, result.stderr
        out = torch.load(elsewhere / "out.pt", weights_only=True)
        load.run = out["run"]
        return out["logits"]

    result = exported_matches_eager(single_run, tmp_path, "pt2", load, flags=["--val-resize-size", "48"])
    assert "(pt2, " in result.stdout and "Warning" not in result.stderr, result.stderr
    with open(os.path.join(single_run["out"], "class_indices.json")) as f:
        classes = [name for _, name in sorted(json.load(f).items(), key=lambda item: int(item[0]))]
    assert load.run == {"model": MODEL, "img_size": 32, "val_resize_size": 48, "channels": 3,
                        "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD), "classes": classes,
                        "task": "single-label", "multi_label": False, "thresholds": None}

    program = elsewhere / "flowers.pt2"  # away from its run: no args.json beside it
    os.replace(tmp_path / "model.pt2", program)
    weights = os.path.join(single_run["out"], "model-best.pth")
    renamed = tmp_path / "renamed.json"  # --class-indices overrides the names inside, in index order
    renamed.write_text(json.dumps({str(i): f"flower-{i}" for i in range(5)}))
    tables = {}
    for name, flags in (("pth", ["--weights", weights, "--val-resize-size", "48"]), ("pt2", ["--weights", str(program)]),
                        ("pth default resize", ["--weights", weights]),  # 37 = round(32 x 256 / 224)
                        ("pt2 renamed, resize 37", ["--weights", str(program), "--val-resize-size", "37",
                                                    "--class-indices", str(renamed)])):
        predicted = outcome(lambda: predict.main([*flags, "--image", tiny_data["val"], "--workers", "0",
                                                  "--output", str(tmp_path / f"{name}.csv")]))
        assert predicted is None, predicted
        with open(tmp_path / f"{name}.csv") as f:
            tables[name] = list(csv.reader(f))
    assert tables["pt2"][0] == tables["pth"][0] and len(tables["pt2"]) == 8  # header with the class names, 7 images
    renamed_header = tables["pt2 renamed, resize 37"][0]
    assert renamed_header == ["path", "prediction", "probability"] + [f"flower-{i}" for i in range(5)]
    names = {f"flower-{i}": name for i, name in enumerate(classes)}
    for ours, theirs in (("pt2", "pth"), ("pt2 renamed, resize 37", "pth default resize")):
        for mine, other in zip(tables[ours][1:], tables[theirs][1:]):
            assert mine[0] == other[0] and names.get(mine[1], mine[1]) == other[1]  # path, prediction (its name)
            assert max(abs(float(a) - float(b)) for a, b in zip(mine[2:], other[2:])) <= 1e-5, (ours, theirs)
    resized = [row[2:] for row in tables["pt2 renamed, resize 37"][1:]]
    assert resized != [row[2:] for row in tables["pt2"][1:]]  # the resize taken from the flag, not run.json's 48
    renamed.write_text(json.dumps({"0": "a", "1": "b"}))
    with pytest.raises(UserError, match="names 2 classes, the .pt2 predicts 5"):
        predict.main(["--weights", str(program), "--image", tiny_data["val"], "--class-indices", str(renamed)])
    with pytest.raises(UserError, match="^--img-size: a .pt2 holds its model and image size"):
        predict.main(["--weights", str(program), "--image", tiny_data["val"], "--img-size", "32"])


def test_export_onnx(single_run, tmp_path):
    for package in ("onnx", "onnxscript"):
        pytest.importorskip(package, reason="ONNX export is optional: pip install onnx onnxscript onnxruntime")
    onnxruntime = pytest.importorskip("onnxruntime", reason="ONNX export is optional: pip install onnx onnxscript "
                                                            "onnxruntime")

    def load(path, images):
        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        return torch.from_numpy(session.run(None, {"images": images.numpy()})[0])

    exported_matches_eager(single_run, tmp_path, "onnx", load)


def test_export_torchscript_still_works_and_says_it_is_deprecated(single_run, tmp_path):
    def load(path, images):
        with pytest.warns(FutureWarning, match="deprecated"):  # torch's own warning, not hidden
            return torch.jit.load(path)(images)

    # torch's FutureWarnings shown as a user sees them, not raised as the suite's errors
    result = exported_matches_eager(single_run, tmp_path, "torchscript", load,
                                    env={"PYTHONWARNINGS": "error::DeprecationWarning"})
    assert "note: TorchScript is deprecated by PyTorch; --format pt2 (the default) is its successor" in result.stdout
    assert "FutureWarning: `torch.jit.trace` is deprecated" in result.stderr  # shown to the user as torch wrote it


def test_export_onnx_without_the_package_is_a_clear_error(single_run, tmp_path):
    """Whether or not onnx is installed here: a folder first on the child's PYTHONPATH holds an
    onnx.py (or onnxruntime.py) that fails to import, as a missing package does."""
    for missing in ("onnx", "onnxscript", "onnxruntime"):
        blocked = tmp_path / f"without-{missing}"
        blocked.mkdir()
        (blocked / f"{missing}.py").write_text(f"raise ImportError('{missing} is blocked by the test')\n")
        output = tmp_path / "m.onnx"
        result = run([PYTHON, script("export.py"), "--weights", os.path.join(single_run["out"], "model-best.pth"),
                      "--format", "onnx", "--output", str(output)],
                     env={"PYTHONPATH": os.pathsep.join([str(blocked), REPO])})
        assert result.returncode == 2, (missing, result.stdout + result.stderr)
        assert "Traceback" not in result.stderr, result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("error: --format onnx needs") and "pip install onnx onnxscript onnxruntime" in line, line
        left = {p.name for p in tmp_path.iterdir()}
        assert left <= {"without-onnx", "without-onnxscript", "without-onnxruntime"}  # no file left
