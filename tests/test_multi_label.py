"""Multi-label classification: an image carries several classes or none.

The figures are checked against definitions computed here, another way (loops over small
tables with ties, a class without positives, an image without labels); the runs against
what predict.py gives image by image: the mAP of a run is the mAP of its predictions,
scored here. One data set of coloured, striped PNGs (5 classes, one of them never in
validation) goes through both scripts, a kill and --resume auto, --eval-only at world 1, 2
and 3, predict.py on the .pth and the .pt2, and export.py."""
import csv
import json
import math
import os
import random
from argparse import Namespace

import pytest
import torch
from PIL import Image

from conftest import (PYTHON, REPO, TORCHRUN, free_port, full_flags, metrics_without_timing, probe_records,
                      read_metrics, run, run_ranks, script)
from multi_train_utils.multi_label import MultiLabelLoss, positive_weights
from multi_train_utils.multi_label import MultiLabelResult, average_precision, best_f1_threshold

CLASSES = ["blue", "green", "red", "stripes", "zebra"]  # zebra: training images only
PROBE = os.path.join(REPO, "tests", "helpers", "probe.py")
RUN_FLAGS = ["--multi-label", "--model", "resnet18", "--img-size", "48", "--batch-size", "4", "--no-plots",
             "--keep-last", "0", "--workers", "1", "--epochs", "3"]
RECIPE = ["--tune-thresholds", "--model-ema", "--mixup-alpha", "0.4", "--accum-steps", "2", "--class-weights",
          "balanced", "--label-smoothing", "0.1", "--seed", "3"]


# --- Definitions, computed here ---------------------------------------------------------------

def ap_by_definition(scores, positives):
    """scikit-learn's average precision, by its definition: for each distinct score t from
    the highest, precision and recall of "score >= t"; AP = sum of (R_t - R_before) * P_t."""
    total = sum(positives)
    if total == 0:
        return math.nan
    ap, recall_before = 0.0, 0.0
    for t in sorted(set(scores), reverse=True):
        chosen = [p for s, p in zip(scores, positives) if s >= t]
        precision, recall = sum(chosen) / len(chosen), sum(chosen) / total
        ap += (recall - recall_before) * precision
        recall_before = recall
    return ap


def f1_by_definition(scores, positives, t):
    tp = sum(1 for s, p in zip(scores, positives) if s >= t and p)
    fp = sum(1 for s, p in zip(scores, positives) if s >= t and not p)
    fn = sum(1 for s, p in zip(scores, positives) if s < t and p)
    return (2 * tp / (2 * tp + fp + fn) if 2 * tp + fp + fn else math.nan), (tp, fp, fn)


def score_table(seed, images=13, classes=4):
    """Scores rounded to one decimal (many ties), random targets; class 2 has no positive,
    image 0 no label."""
    rng = random.Random(seed)
    scores = [[round(rng.random(), 1) for _ in range(classes)] for _ in range(images)]
    targets = [[int(rng.random() < 0.4) if c != 2 else 0 for c in range(classes)] for _ in range(images)]
    targets[0] = [0] * classes
    targets[1][0] = targets[2][1] = targets[3][3] = 1  # every other class has a positive
    return scores, targets


def column(table, c):
    return [row[c] for row in table]


def test_average_precision_of_a_table_worked_by_hand():
    # 0.9 (pos) then a tie at 0.8 (one pos, one neg): (0.5 - 0) * 1 + (1 - 0.5) * 2/3
    assert average_precision(torch.tensor([0.9, 0.8, 0.8, 0.1]), torch.tensor([1, 0, 1, 0]).bool()) == \
        pytest.approx(0.5 + 0.5 * 2 / 3, abs=1e-12)
    # every score equal: one threshold, AP = the share of positives
    assert average_precision(torch.full((5,), 0.3), torch.tensor([1, 0, 0, 1, 0]).bool()) == pytest.approx(0.4)
    assert math.isnan(average_precision(torch.tensor([0.2, 0.7]), torch.tensor([0, 0]).bool()))


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_map_and_per_class_ap_equal_the_definition_on_tables_with_ties(seed):
    scores, targets = score_table(seed)
    result = MultiLabelResult.from_scores(torch.tensor(scores), torch.tensor(targets))
    expected = [ap_by_definition(column(scores, c), column(targets, c)) for c in range(4)]
    assert math.isnan(result.ap[2]) and math.isnan(expected[2])
    for c in (0, 1, 3):
        assert result.ap[c] == pytest.approx(expected[c], abs=1e-12)
    kept = [e for e in expected if not math.isnan(e)]
    assert result.map == pytest.approx(sum(kept) / len(kept), abs=1e-12)  # the class without positives left out
    assert result.support == [sum(column(targets, c)) for c in range(4)]


@pytest.mark.parametrize("seed", [0, 5])
def test_f1_precision_recall_and_exact_match_at_the_thresholds_equal_the_counts(seed):
    scores, targets = score_table(seed)
    thresholds = [0.5, 0.3, 0.6, 0.7]
    result = MultiLabelResult.from_scores(torch.tensor(scores), torch.tensor(targets), thresholds)
    counts = [f1_by_definition(column(scores, c), column(targets, c), t)[1] for c, t in enumerate(thresholds)]
    for c, (tp, fp, fn) in enumerate(counts):
        f1 = 2 * tp / (2 * tp + fp + fn) if 2 * tp + fp + fn else math.nan
        for got, want in ((result.f1[c], f1), (result.precision[c], tp / (tp + fp) if tp + fp else math.nan),
                          (result.recall[c], tp / (tp + fn) if tp + fn else math.nan)):
            assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, abs=1e-12), c
    tp, fp, fn = (sum(c[i] for c in counts) for i in range(3))
    assert result.micro_f1 == pytest.approx(2 * tp / (2 * tp + fp + fn))
    assert result.micro_precision == pytest.approx(tp / (tp + fp))
    assert result.micro_recall == pytest.approx(tp / (tp + fn))
    f1s = [2 * a / (2 * a + b + d) for a, b, d in counts if 2 * a + b + d]
    assert result.macro_f1 == pytest.approx(sum(f1s) / len(f1s))
    exact = sum(all((s >= t) == bool(y) for s, t, y in zip(srow, thresholds, trow))
                for srow, trow in zip(scores, targets))
    assert (result.correct, result.total) == (exact, len(scores))
    assert result.accuracy == pytest.approx(exact / len(scores))


@pytest.mark.parametrize("seed", [0, 2, 9])
def test_the_tuned_threshold_is_the_cut_of_the_best_f1_the_highest_of_equals(seed):
    scores, targets = score_table(seed, images=17)
    result = MultiLabelResult.from_scores(torch.tensor(scores), torch.tensor(targets))
    tuned = result.tuned_thresholds()
    for c in range(4):
        column_scores, positives = column(scores, c), column(targets, c)
        if not any(positives):
            assert tuned[c] == 0.5  # nothing to tune: the default stays
            continue
        best = max(sorted(set(column_scores), reverse=True), key=lambda t: f1_by_definition(column_scores, positives, t)[0])
        assert tuned[c] == pytest.approx(best, abs=1e-7), c  # max(): the first (highest) of equal F1s
    as_float32 = torch.tensor(scores).tolist()  # the scores as the run holds them: a tuned threshold is one
    for c, threshold in enumerate(tuned):  # the report at the tuned thresholds counts there
        tp, fp, fn = f1_by_definition(column(as_float32, c), column(targets, c), threshold)[1]
        assert [int(counts[c]) for counts in result.tuned().counts] == [tp, fp, fn], c
    # F1 2/3 at 0.9 (1 TP, 1 FN) and at 0.4 (2 TP, 2 FP): the higher threshold
    assert best_f1_threshold(torch.tensor([0.9, 0.6, 0.5, 0.4]), torch.tensor([1, 0, 0, 1]).bool()) == \
        pytest.approx(0.9)


@pytest.mark.parametrize("seed", [3, 4])
def test_scores_of_any_sign_rank_as_numbers_with_minus_zero_equal_to_zero(seed):
    """The ranking sorts integer keys made of the scores' bits: negative scores, -0.0 and 0.0
    (one group of equal scores) rank as the numbers do; AP, the tuned threshold and the
    counts equal the definitions."""
    rng = random.Random(seed)
    values = [-2.5, -1.0, -0.0, 0.0, 1e-30, 0.75, 3.0]
    scores = [[rng.choice(values) for _ in range(3)] for _ in range(15)]
    targets = [[int(rng.random() < 0.5) for _ in range(3)] for _ in range(15)]
    for c in range(3):
        targets[c][c] = 1
    result = MultiLabelResult.from_scores(torch.tensor(scores), torch.tensor(targets), [0.0, -1.0, 0.75])
    for c, t in enumerate([0.0, -1.0, 0.75]):
        column_scores, positives = column(scores, c), column(targets, c)
        assert result.ap[c] == pytest.approx(ap_by_definition(column_scores, positives), abs=1e-12)
        best = max(sorted(set(column_scores), reverse=True), key=lambda v: f1_by_definition(column_scores, positives, v)[0])
        assert result.tuned_thresholds()[c] == best and [int(n[c]) for n in result.counts] == \
            list(f1_by_definition(column_scores, positives, t)[1])


def test_the_loss_is_bce_with_positive_weights_and_targets_smoothed_toward_a_half():
    logits = torch.tensor([[2.0, -1.0, 0.5], [-0.3, 0.8, -2.0]])
    targets = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    weights = torch.tensor([3.0, 0.5, 1.0])
    eps = 0.2
    expected = 0.0
    for i in range(2):
        for c in range(3):
            y = targets[i, c].item() * (1 - eps) + eps / 2
            p = 1 / (1 + math.exp(-logits[i, c].item()))
            expected -= weights[c].item() * y * math.log(p) + (1 - y) * math.log(1 - p)
    loss = MultiLabelLoss(pos_weight=weights, label_smoothing=eps)(logits, targets)
    assert float(loss) == pytest.approx(expected / 6, rel=1e-6)
    from model import create_loss
    made = create_loss(full_flags(multi_label=True, label_smoothing=eps), weights)
    assert float(made(logits, targets)) == pytest.approx(expected / 6, rel=1e-6)


def test_positive_weights_are_negatives_over_positives_capped_at_100():
    # 202 images: class 0 in 2 (200 / 2 = 100), class 1 in 1 (201, capped), class 2 in 101
    # (101 / 101 = 1), class 3 in every image and class 4 in none (1: nothing to balance)
    targets = torch.zeros(202, 5, dtype=torch.uint8)
    targets[:2, 0] = 1
    targets[5, 1] = 1
    targets[:101, 2] = 1
    targets[:, 3] = 1
    assert positive_weights(targets.numpy()).tolist() == pytest.approx([100.0, 100.0, 1.0, 1.0, 1.0])
    targets[:4, 0] = 1  # 198 / 4
    assert positive_weights(targets.numpy())[0].item() == pytest.approx(198 / 4)


def test_mixup_mixes_the_multi_hot_targets_as_it_mixes_the_images():
    from multi_train_utils.loaders import make_batch_mixer

    mixer = make_batch_mixer(full_flags(multi_label=True, mixup_alpha=0.4, seed=11), num_classes=3, rank=1)
    images = torch.rand(6, 3, 4, 4)
    targets = torch.tensor([[1, 0, 1], [0, 0, 0], [0, 1, 0], [1, 1, 1], [0, 0, 1], [1, 0, 0]], dtype=torch.float32)
    for step in range(3):
        mixed, soft = mixer(images, targets, epoch=2, step=step)
        # MixUp: mixed = lam * x + (1 - lam) * x rolled by one image; lam read off the pixels
        lam = float(((mixed - images.roll(1, 0)) / (images - images.roll(1, 0)))[0, 0, 0, 0])
        torch.testing.assert_close(mixed, lam * images + (1 - lam) * images.roll(1, 0), rtol=0, atol=1e-5)
        torch.testing.assert_close(soft, lam * targets + (1 - lam) * targets.roll(1, 0), rtol=0, atol=1e-5)


# --- The data ---------------------------------------------------------------------------------

def colour_image(labels, rng):
    """A 40-pixel square: red, green and blue bright where the image has the class, white
    stripes for "stripes"; a little noise."""
    base = [200 if name in labels else 40 for name in ("red", "green", "blue")]
    image = Image.new("RGB", (40, 40), tuple(min(255, v + rng.randrange(30)) for v in base))
    if "stripes" in labels:
        for x in range(0, 40, 5):
            for y in range(40):
                image.putpixel((x, y), (255, 255, 255))
    return image


def write_lists(root, seed=0, train=24, val=11):
    """Images and the two CSVs (header path,labels) in ``root``: the first training image and
    the first validation image carry no class; zebra is on 6 training images and no validation one."""
    rng = random.Random(seed)
    rows = {}
    os.makedirs(os.path.join(root, "img"), exist_ok=True)
    for split, count in (("train", train), ("val", val)):
        rows[split] = []
        for i in range(count):
            labels = [] if i == 0 else [c for c in CLASSES[:4] if rng.random() < 0.45]
            if split == "train" and i == 1:
                labels = ["red", "stripes"]  # line 3: the first row of several labels
            if split == "train" and 0 < i <= 6:
                labels.append("zebra")
            name = f"img/{split} {i}.png"  # a space in the name
            colour_image(labels, rng).save(os.path.join(root, name))
            rows[split].append((name, labels))
        with open(os.path.join(root, f"{split}.csv"), "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["path", "labels"])
            writer.writerows([(name, " ".join(labels)) for name, labels in rows[split]])
    return rows


@pytest.fixture(scope="module")
def lists(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi-label-data")
    rows = write_lists(str(root))
    return {"root": str(root), "train": str(root / "train.csv"), "val": str(root / "val.csv"), "rows": rows}


def test_the_lists_read_as_multi_hot_rows_with_the_sorted_union_of_classes(lists):
    from utils import read_label_files
    from multi_train_utils.datasets import compact_split

    split = compact_split(read_label_files(lists["train"], lists["val"], multi_label=True))
    assert split.classes == CLASSES
    assert split.train_images_label.shape == (24, 5) and split.val_images_label.shape == (11, 5)
    for labels_array, rows in ((split.train_images_label, lists["rows"]["train"]),
                               (split.val_images_label, lists["rows"]["val"])):
        expected = [[int(name in labels) for name in CLASSES] for _, labels in rows]
        assert labels_array.tolist() == expected
    assert split.train_images_label[0].sum() == 0  # the empty cell: no class
    assert any("'zebra' gets no validation image" in note and "AP" in note for note in split.notes)
    # without --val-list: round(24 x 0.25) = 6 images to validation, the same for the same seed
    a, b, c = (read_label_files(lists["train"], None, 0.25, seed, multi_label=True) for seed in (4, 4, 5))
    assert len(a.val_images_path) == 6 and len(a.train_images_path) == 18
    assert a.val_images_path == b.val_images_path != c.val_images_path
    assert sorted(a.val_images_path + a.train_images_path) == sorted(
        os.path.join(lists["root"], name) for name, _ in lists["rows"]["train"])


# --- Bad input: one line, exit 2, nothing written ----------------------------------------------

def bad_list(root, name, text):
    path = os.path.join(root, name)
    with open(path, "w") as f:
        f.write(text)
    return path


BAD_CASES = {
    "an unknown label in validation": (lambda d: ["--val-list", bad_list(d["root"], "v1.csv", "path,labels\nimg/val 1.png,red purple\n")],
                                       ["--val-list", "v1.csv, line 2", "'purple' is not one of the training classes"]),
    "a label twice in a row": (lambda d: ["--val-list", bad_list(d["root"], "v2.csv", "path,labels\nimg/val 1.png,red blue red\n")],
                               ["v2.csv, line 2", "'red' is there twice"]),
    "an empty file": (lambda d: ["--val-list", bad_list(d["root"], "v3.csv", "")],
                      ["--val-list", "v3.csv", "the first line must be the header path,labels"]),
    "no rows": (lambda d: ["--val-list", bad_list(d["root"], "v4.csv", "path,labels\n")], ["v4.csv", "lists no images"]),
    "several labels without --multi-label": (lambda d: ["--no-multi-label-marker", "--train-list", bad_list(
        d["root"], "t1.csv", "path,labels\nimg/train 1.png,red\nimg/train 2.png,red blue\n")],
        ["--train-list", "t1.csv, line 3: 2 labels ('red blue')", "needs --multi-label"]),
    "the balanced sampler": (lambda d: ["--val-list", d["val"], "--sampler", "balanced"],
                             ["--sampler balanced with --multi-label", "--class-weights balanced"]),
    "balanced accuracy": (lambda d: ["--val-list", d["val"], "--best-metric", "balanced_accuracy"],
                          ["--best-metric balanced_accuracy", "not defined with --multi-label"]),
}


def bad_command(case, lists, out):
    flags, expected = BAD_CASES[case][0](lists), BAD_CASES[case][1]
    multi = ["--multi-label"]
    if "--no-multi-label-marker" in flags:
        flags.remove("--no-multi-label-marker")
        multi = []
    return [PYTHON, script("train_single.py"), *multi, "--train-list", lists["train"], *flags, "--model", "resnet18",
            "--output-dir", str(out)], expected


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_multi_label_input_is_one_line_and_nothing_is_written(case, lists, tmp_path):
    cmd, expected = bad_command(case, lists, tmp_path / "out")
    result = run(cmd)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for text in expected:
        assert text in lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "out").exists()


def test_a_row_of_no_class_under_the_labels_header_without_multi_label_names_the_flag(tmp_path):
    """A list whose header says ``labels``, read without --multi-label, with an empty label cell:
    one line naming the file, the line, the row and --multi-label (a row of no class is a
    multi-label row); under the header ``label`` the same row is the plain path,label error."""
    from multi_train_utils.errors import UserError
    from utils import read_label_files

    (tmp_path / "a.png").write_bytes(b"")
    (tmp_path / "b.png").write_bytes(b"")
    for header, expected in (("labels", "line 3: no label ('b.png,'): an image of no class needs --multi-label"),
                             ("label", "line 3: expected path,label; found 'b.png,'")):
        listed = tmp_path / f"{header}.csv"
        listed.write_text(f"path,{header}\na.png,cat\nb.png,\n")
        with pytest.raises(UserError) as refused:
            read_label_files(str(listed), None, 0.2, 0)
        assert f"{listed}, {expected}" in str(refused.value)


def test_class_folders_with_multi_label_and_single_label_metrics_are_refused(tmp_path):
    from multi_train_utils.errors import UserError
    from multi_train_utils.run_files import check_datasets
    from multi_train_utils.datasets import Datasets, MyDataSet
    from multi_train_utils.options import get_args_parser, parse_args

    folders = Datasets(MyDataSet(["a.png"], [0]), MyDataSet(["b.png"], [1]), ["x", "y"])
    with pytest.raises(UserError, match="--multi-label: my_dataset.build_datasets: the training dataset has one "
                                        "class an image"):
        check_datasets(folders, several_labels=True)
    rows = Datasets(MyDataSet(["a.png"], torch.ones(1, 2, dtype=torch.uint8).numpy()),
                    MyDataSet(["b.png"], torch.ones(1, 2, dtype=torch.uint8).numpy()), ["x", "y"])
    with pytest.raises(UserError, match="multi-hot labels .*: add --multi-label"):
        check_datasets(rows, several_labels=False)
    check_datasets(rows, several_labels=True)
    for flags, message in ((["--best-metric", "map"], "--best-metric map: for --multi-label runs"),
                           (["--tune-thresholds"], "--tune-thresholds is for --multi-label runs"),
                           (["--multi-label", "--demo"], "--multi-label with --demo")):
        with pytest.raises(UserError, match=message):
            parse_args(get_args_parser(distributed=False), flags)
    assert parse_args(get_args_parser(distributed=False), ["--multi-label"]).best_metric == "map"
    assert parse_args(get_args_parser(distributed=True), []).best_metric == "accuracy"


def test_a_dataset_of_your_own_with_multi_hot_labels_is_checked_at_the_start():
    from multi_train_utils.errors import UserError
    from multi_train_utils.run_files import check_datasets
    from multi_train_utils.datasets import Datasets

    class Own(torch.utils.data.Dataset):
        def __init__(self, label):
            self.label = label

        def __len__(self):
            return 2

        def __getitem__(self, i):
            return torch.zeros(3, 8, 8, dtype=torch.uint8), self.label

    good = Own(torch.tensor([1.0, 0.0, 1.0]))
    check_datasets(Datasets(good, good, ["a", "b", "c"]), several_labels=True)
    with pytest.raises(UserError, match=r"first label is a tensor of shape \(2,\); give a float tensor of 3 values"):
        check_datasets(Datasets(Own(torch.tensor([1.0, 0.0])), good, ["a", "b", "c"]), several_labels=True)
    with pytest.raises(UserError, match="first label is a int"):
        check_datasets(Datasets(Own(1), good, ["a", "b", "c"]), several_labels=True)
    with pytest.raises(UserError, match="values from 0 to 2"):
        check_datasets(Datasets(Own(torch.tensor([2.0, 0.0, 1.0])), good, ["a", "b", "c"]), several_labels=True)
    with pytest.raises(UserError, match="add --multi-label"):
        check_datasets(Datasets(good, good, ["a", "b", "c"]), several_labels=False)


# --- Runs ---------------------------------------------------------------------------------------

def train_command(kind, lists, out, *extra, probe=False):
    flags = [*RUN_FLAGS, *RECIPE, "--train-list", lists["train"], "--val-list", lists["val"], "--output-dir", str(out),
             "--log-dir", str(out.parent / "runs"), *extra]
    if kind == "single":
        entry = [PROBE, "single"] if probe else [script("train_single.py")]
        return [PYTHON, *entry, *flags]
    entry = [PROBE, "multi"] if probe else [script("train_multi_gpu.py")]
    return [*TORCHRUN, "--nproc_per_node=2", "--master_port", str(free_port()), *entry, *flags]


@pytest.fixture(scope="module")
def straight(lists, tmp_path_factory):
    """Uninterrupted runs of 3 epochs, one per script, made when a test first asks."""
    done = {}

    def get(kind):
        if kind not in done:
            out = tmp_path_factory.mktemp(f"straight-{kind}") / "out"
            result = run(train_command(kind, lists, out, *(["--plots"] if kind == "ddp" else [])))
            assert result.returncode == 0, result.stdout + result.stderr
            done[kind] = (out, result)
        return done[kind]

    return get


def test_a_run_fills_the_multi_label_columns_and_keeps_the_best_epochs_thresholds(straight, lists):
    out, result = straight("ddp")
    rows = read_metrics(out)
    assert [r["epoch"] for r in rows] == ["0", "1", "2"]
    for r in rows:
        for key in ("val_map", "val_micro_f1", "val_micro_precision", "val_micro_recall", "ema_val_map", "val_loss",
                    "val_macro_f1", "val_accuracy"):
            assert 0 <= float(r[key]) <= (1 if key != "val_loss" else 10), (key, r)
        assert r["val_balanced_accuracy"] == r["val_top5_accuracy"] == ""  # single-label figures
    best = max(range(3), key=lambda e: (max(float(rows[e]["val_map"]), float(rows[e]["ema_val_map"])), -e))
    thresholds = json.loads((out / "thresholds.json").read_text())
    assert thresholds["epoch"] == best and thresholds["tuned"] is True
    assert list(thresholds["classes"]) == CLASSES and thresholds["classes"]["zebra"] == 0.5
    assert torch.load(out / "checkpoint.pth", weights_only=True)["best_epoch"] == best
    for name in ("per_class_metrics.csv", "per_class_ap.png", "pr_curves.png", "class_distribution.png",
                 "batch_preview.png", "curves.png"):
        assert (out / name).stat().st_size > 0, name
    assert not (out / "confusion_matrix.png").exists()
    assert f"best val map: {max(float(rows[best]['val_map']), float(rows[best]['ema_val_map'])):.4f} at epoch {best}" \
        in result.stdout
    assert "thresholds: tuned for each class's best F1" in result.stdout
    assert [l.split()[0] for l in result.stdout.splitlines() if l.startswith("  ") and "threshold" in l] == CLASSES
    assert "labels: " in result.stdout and "1 training image with none" in result.stdout


def predicted_table(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], {os.path.basename(r[0]): r[1:] for r in rows[1:]}


@pytest.fixture(scope="module")
def served(straight, lists):
    """--eval-only (train_single.py), predict.py on the .pth, export.py (.pt2 and ONNX) and
    predict.py on the .pt2, in one Python process; then --eval-only at world 2 and 3."""
    out, _ = straight("ddp")
    driver = (
        "import sys, export, predict, train_single\n"
        "from multi_train_utils.errors import run_cli\n"
        "out, images = sys.argv[1], sys.argv[2]\n"
        "def go(main, argv):\n"
        "    print('=== ' + main.__module__, flush=True)\n"
        "    try: run_cli(main, argv)\n"
        "    except SystemExit as e: print('exit', e.code, flush=True)\n"
        "go(train_single.main, ['--eval-only', '--weights', out + '/model-best.pth', '--batch-size', '4', '--amp', 'off', '--eval-output', out + '/eval'])\n"
        "go(train_single.main, ['--eval-only', '--weights', out + '/model-best.pth'])\n"
        "go(predict.main, ['--weights', out + '/model-best.pth', '--image', images, '--output', out + '/pth.csv'])\n"
        "go(predict.main, ['--weights', out + '/model-best.pth', '--image', images + '/val 2.png'])\n"
        "go(export.main, ['--weights', out + '/model-best.pth'])\n"
        "go(export.main, ['--weights', out + '/model-best.pth', '--format', 'onnx'])\n"
        "go(predict.main, ['--weights', out + '/model-best.pt2', '--image', images, '--output', out + '/pt2.csv'])\n")
    driver_file = out.parent / "served_driver.py"
    driver_file.write_text(driver)
    result = run([PYTHON, str(driver_file), str(out), os.path.join(lists["root"], "img")])
    assert result.returncode == 0, result.stdout + result.stderr
    worlds = {1: result.stdout.split("=== predict")[0].split("=== train_single")[1]}
    worlds["as trained"] = result.stdout.split("=== predict")[0].split("=== train_single")[2]  # the run's --amp
    for world, batch in ((2, "3"), (3, "2")):  # ranks started as srun starts them (run_ranks)
        launched = run_ranks(world, [PYTHON, script("train_multi_gpu.py"), "--eval-only", "--weights",
                                     str(out / "model-best.pth"), "--batch-size", batch, "--amp", "off"])  # as predict.py
        assert launched.returncode == 0, launched.stdout + launched.stderr
        worlds[world] = launched.stdout
    return out, result, worlds


def figures(stdout):
    """mAP, micro-F1 and exact match of an --eval-only report's last two lines."""
    lines = [l for l in stdout.splitlines() if l.startswith("mAP: ") or l.startswith("exact match accuracy: ")]
    return lines[-2:]


def test_evaluation_is_the_same_at_world_1_2_and_3_and_equals_the_predictions_scored_here(served, lists):
    out, result, worlds = served
    assert figures(worlds[1]) and figures(worlds[1]) == figures(worlds[2]) == figures(worlds[3])
    header, predicted = predicted_table(out / "pth.csv")
    assert header == ["path", "labels", *CLASSES]
    val = lists["rows"]["val"]
    scores = [[float(p) for p in predicted[os.path.basename(name)][1:]] for name, _ in val]
    targets = [[int(c in labels) for c in CLASSES] for _, labels in val]
    aps = [ap_by_definition(column(scores, c), column(targets, c)) for c in range(len(CLASSES))]
    expected_map = sum(a for a in aps if not math.isnan(a)) / sum(1 for a in aps if not math.isnan(a))
    reported = dict(line.split(": ", 1) for line in worlds[1].splitlines() if line.startswith("mAP: "))
    assert float(reported["mAP"].split()[0]) == pytest.approx(expected_map, abs=2e-5)
    # the tuned thresholds of the run, applied here to predict.py's probabilities
    thresholds = list(json.loads((out / "thresholds.json").read_text())["classes"].values())
    tp = fp = fn = exact = 0
    for s_row, t_row in zip(scores, targets):
        chosen = [s >= t for s, t in zip(s_row, thresholds)]
        tp += sum(c and y for c, y in zip(chosen, t_row))
        fp += sum(c and not y for c, y in zip(chosen, t_row))
        fn += sum(y and not c for c, y in zip(chosen, t_row))
        exact += chosen == [bool(y) for y in t_row]
    assert f"exact match accuracy: {exact / len(val):.6f} ({exact}/{len(val)})" in worlds[1]
    assert f"micro-F1: {2 * tp / (2 * tp + fp + fn):.6f}" in worlds[1]
    # the best epoch's mAP in metrics.csv (training, world 2) is the mAP of model-best.pth, at the run's precision
    best = json.loads((out / "thresholds.json").read_text())["epoch"]
    row = read_metrics(out)[best]
    ema = torch.load(out / "checkpoint.pth", weights_only=True)["best_source"] == "ema"
    as_trained = dict(line.split(": ", 1) for line in worlds["as trained"].splitlines() if line.startswith("mAP: "))
    assert float(row["ema_val_map" if ema else "val_map"]) == pytest.approx(float(as_trained["mAP"].split()[0]),
                                                                               abs=2e-6)
    # per_class_metrics.csv of --eval-output: AP per class, as scored here
    with open(out / "eval" / "per_class_metrics.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [r["class"] for r in table] == CLASSES
    for c, (r, ap) in enumerate(zip(table, aps)):
        assert (math.isnan(ap) and r["ap"] == "nan") or float(r["ap"]) == pytest.approx(ap, abs=2e-5)
        _, (tp, fp, fn) = f1_by_definition(column(scores, c), column(targets, c), thresholds[c])
        for key, value in (("precision", tp / (tp + fp) if tp + fp else math.nan),
                           ("recall", tp / (tp + fn) if tp + fn else math.nan),
                           ("threshold", thresholds[c])):
            assert (math.isnan(value) and r[key] == "nan") or float(r[key]) == pytest.approx(value, abs=1e-6), (c, key)
    assert [int(r["support"]) for r in table] == [sum(column(targets, c)) for c in range(len(CLASSES))]
    # --eval-output writes these four files, the precision-recall curves among them (docs/multi-label.md)
    assert sorted(os.listdir(out / "eval")) == ["overall_metrics.csv", "per_class_ap.png", "per_class_metrics.csv",
                                                 "pr_curves.png"]
    assert (out / "eval" / "pr_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_predict_writes_the_classes_above_their_thresholds_and_the_pt2_and_onnx_carry_them(served, lists):
    out, result, _ = served
    header, from_pth = predicted_table(out / "pth.csv")
    header_pt2, from_pt2 = predicted_table(out / "pt2.csv")
    assert header == header_pt2 and sorted(from_pth) == sorted(from_pt2)
    thresholds = list(json.loads((out / "thresholds.json").read_text())["classes"].values())
    for name, row in from_pth.items():
        probabilities = [float(p) for p in row[1:]]
        assert [float(p) for p in from_pt2[name][1:]] == pytest.approx(probabilities, abs=1e-5)
        assert row[0] == " ".join(c for c, p, t in zip(CLASSES, probabilities, thresholds) if p >= t)
        assert from_pt2[name][0] == row[0]
    line = [l for l in result.stdout.splitlines() if l.startswith(os.path.join(lists["root"], "img", "val 2.png"))][0]
    row = [float(p) for p in from_pth["val 2.png"][1:]]
    expected = sorted(((p, c) for c, p, t in zip(CLASSES, row, thresholds) if p >= t), key=lambda x: -x[0])
    assert line.split(": ", 1)[1] == (", ".join(f"{c} {p:.3f}" for p, c in expected)
                                      or "none of the classes reaches its threshold")
    extra = {"run.json": ""}
    program = torch.export.load(str(out / "model-best.pt2"), extra_files=extra).module()
    run_json = json.loads(extra["run.json"])
    # each probability is the sigmoid of its class's logit (not a softmax over the classes)
    from multi_train_utils.images import build_transforms, read_image_uint8
    _, val_transform = build_transforms(run_json["img_size"], val_resize_size=run_json["val_resize_size"])
    image = val_transform(read_image_uint8(os.path.join(lists["root"], "img", "val 2.png"))).float() / 255
    mean, std = (torch.tensor(run_json[k]).view(3, 1, 1) for k in ("mean", "std"))
    with torch.no_grad():
        logits = program(((image - mean) / std)[None])[0]
    assert torch.sigmoid(logits).tolist() == pytest.approx(row, abs=1e-5)
    assert run_json["multi_label"] is True and run_json["classes"] == CLASSES
    assert run_json["thresholds"] == pytest.approx(thresholds)
    onnx = pytest.importorskip("onnx")
    props = {p.key: p.value for p in onnx.load(str(out / "model-best.onnx")).metadata_props}
    assert json.loads(props["run.json"])["thresholds"] == pytest.approx(thresholds)
    assert json.loads(props["run.json"])["multi_label"] is True


def assert_ends_as(reference, out):
    """A resumed run ``out`` ends as the straight run ``reference``: metrics.csv (timing aside),
    the last weights (1e-6), thresholds.json, and the per-class table (the best epoch's report
    came through the checkpoint)."""
    assert metrics_without_timing(out) == metrics_without_timing(reference)
    final, expected = (torch.load(d / "model-2.pth", weights_only=True) for d in (out, reference))
    for key in expected:
        torch.testing.assert_close(final[key], expected[key], rtol=0, atol=1e-6, msg=key)
    assert json.loads((out / "thresholds.json").read_text()) == json.loads((reference / "thresholds.json").read_text())
    assert (out / "per_class_metrics.csv").read_text() == (reference / "per_class_metrics.csv").read_text()


@pytest.mark.parametrize("kind", ["single", "ddp"])
def test_a_kill_and_resume_auto_equal_a_straight_run(kind, straight, lists, tmp_path):
    reference, _ = straight(kind)
    out = tmp_path / "out"
    # SIGKILL as epoch 1's validation begins (every process kills itself): epoch 0's checkpoint is the last
    killed = run(train_command(kind, lists, out, probe=True), env={"PROBE_STOP": "SIGKILL:validation-1:self"})
    assert killed.returncode != 0, killed.stdout + killed.stderr
    saved = torch.load(out / "checkpoint.pth", weights_only=True)["epoch"]
    assert saved == 0
    resumed = run(train_command(kind, lists, out, "--resume", "auto"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"(epoch {saved} done): epochs {saved + 1} to 2" in resumed.stdout
    assert_ends_as(reference, out)


@pytest.mark.parametrize("kind", ["single", "ddp"])
def test_a_notice_inside_an_epoch_and_resume_auto_equal_a_straight_run(kind, straight, lists, tmp_path):
    """A crossing of the task and a stop inside an epoch: SIGTERM to every process as epoch 1's
    first step begins (--print-freq 1: agreed at that step), a save at the end of its
    accumulation group (--accum-steps 2: after step 1) and exit 75; then --resume auto ends with
    the straight run's metrics.csv, weights, thresholds.json and per-class table (the best
    epoch's report carried by a checkpoint saved inside an epoch)."""
    reference, _ = straight(kind)
    out = tmp_path / "out"
    stopped = run(train_command(kind, lists, out, "--print-freq", "1", probe=True),
                  env={"PROBE_STOP": "SIGTERM:step-1-0:self", "PROBE_OUT": f"{out}.probe"})
    codes = [record["exit_code"] for record in probe_records(f"{out}.probe", 1 if kind == "single" else 2)]
    assert codes == [75] * len(codes), stopped.stdout + stopped.stderr  # every rank's
    assert "stopped at epoch 1, step 2 on a preemption notice (SIGTERM)" in stopped.stderr, stopped.stderr
    checkpoint = torch.load(out / "checkpoint.pth", weights_only=True)
    assert (checkpoint["epoch"], checkpoint["position"]["epoch"], checkpoint["position"]["step"]) == (0, 1, 2)
    assert checkpoint["best_report"] is not None  # epoch 0's, for the end's per-class table
    resumed = run(train_command(kind, lists, out, "--print-freq", "1", "--resume", "auto"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert_ends_as(reference, out)


def test_eval_only_on_a_list_of_other_classes_is_one_line_and_writes_nothing(straight, lists, tmp_path):
    out, _ = straight("ddp")
    other = bad_list(lists["root"], "other.csv", "path,labels\nimg/train 1.png,red\nimg/train 2.png,blue green\n")
    other_val = bad_list(lists["root"], "other_val.csv", "path,labels\nimg/val 1.png,red\n")
    result = run([PYTHON, script("train_single.py"), "--eval-only", "--weights", str(out / "model-best.pth"),
                  "--train-list", other, "--val-list", other_val, "--eval-output", str(tmp_path / "eval")])
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --train-list "), result.stderr
    assert "classes ['blue', 'green', 'red'] differ from the weights' class_indices.json" in lines[0]
    assert "Traceback" not in result.stdout + result.stderr and not (tmp_path / "eval").exists()


def test_a_resume_restores_the_best_epochs_report_and_thresholds_json_from_the_checkpoint(tmp_path):
    """The best epoch's per-class report (thresholds among it) travels in the checkpoint: a run
    resumed after its best epoch writes the same thresholds.json and table without
    evaluating that epoch again."""
    from multi_train_utils.checkpoint import TrainState, build_checkpoint, load_checkpoint, restore_training_state
    from multi_train_utils.datasets import Datasets
    from conftest import run_recorder

    model = torch.nn.Linear(3, 2)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), epoch=2)
    report = MultiLabelResult.from_scores(torch.tensor([[0.9, 0.2], [0.3, 0.7], [0.6, 0.1]]),
                              torch.tensor([[1, 0], [0, 1], [1, 0]])).report()
    report["thresholds"] = [0.25, 0.75]
    state.best.value, state.best.epoch, state.best.report = 0.9, 0, report
    args = full_flags(multi_label=True, tune_thresholds=True, output_dir=str(tmp_path / "out"),
                      log_dir=str(tmp_path / "runs"), epochs=4, resume="auto")
    os.makedirs(args.output_dir)
    torch.save(build_checkpoint(state, model.state_dict(), metrics=[], flags=vars(args), classes=["a", "b"],
                                file_list=None, world_size=1, log_dir=None), tmp_path / "out" / "checkpoint.pth")
    checkpoint = load_checkpoint(str(tmp_path / "out" / "checkpoint.pth"))
    resumed = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    restore_training_state(resumed, checkpoint)
    assert resumed.best.report["thresholds"] == [0.25, 0.75] and resumed.best.epoch == 0
    empty = Datasets(torch.utils.data.TensorDataset(torch.zeros(1)), torch.utils.data.TensorDataset(torch.zeros(1)),
                     ["a", "b"])
    from multi_train_utils.options import task_of

    recorder = run_recorder(args, empty, resumed, checkpoint=checkpoint, resume_path=str(tmp_path / "out" / "checkpoint.pth"),
                           task=task_of(args))
    recorder.close()
    written = json.loads((tmp_path / "out" / "thresholds.json").read_text())
    assert written == {"classes": {"a": 0.25, "b": 0.75}, "tuned": True, "epoch": 0}


# --- Round 11's survivors: each with its own test ----------------------------------------------

def test_the_note_on_classes_without_validation_images_counts_every_label_of_a_row(tmp_path):
    from utils import read_label_files

    for name in ("a", "b", "c", "d"):
        colour_image([], random.Random(0)).save(tmp_path / f"{name}.png")
    (tmp_path / "train.csv").write_text("path,labels\na.png,red blue\nb.png,green\n")
    (tmp_path / "val.csv").write_text("path,labels\nc.png,green red\nd.png,\n")  # blue never; red as a second label
    split = read_label_files(str(tmp_path / "train.csv"), str(tmp_path / "val.csv"), multi_label=True)
    assert [note.split(" gets")[0] for note in split.notes] == ["class 'blue'"]


def test_a_negative_multi_hot_value_of_your_own_dataset_is_refused():
    from multi_train_utils.errors import UserError
    from multi_train_utils.run_files import check_datasets
    from multi_train_utils.datasets import Datasets

    class Own(torch.utils.data.Dataset):
        def __len__(self):
            return 1

        def __getitem__(self, i):
            return torch.zeros(3, 8, 8, dtype=torch.uint8), torch.tensor([-1.0, 0.0, 1.0])

    with pytest.raises(UserError, match="values from -1 to 1; give 0 or 1 per class"):
        check_datasets(Datasets(Own(), Own(), ["a", "b", "c"]), several_labels=True)


def test_class_weights_balanced_of_a_multi_label_run_are_the_capped_positive_weights():
    import numpy as np
    from multi_train_utils.loaders import loss_class_weights

    class Listed(torch.utils.data.Dataset):
        targets = np.zeros((300, 3), dtype=np.uint8)
        targets[:1, 0] = 1  # 299 / 1: capped at 100
        targets[:30, 1] = 1  # 270 / 30 = 9
        targets[:150, 2] = 1  # 1

        def __len__(self):
            return 300

    from multi_train_utils.options import task_of

    weights = loss_class_weights(task_of(full_flags(multi_label=True)), "balanced", Listed(), 3)
    assert weights.tolist() == pytest.approx([100.0, 9.0, 1.0])


@pytest.mark.parametrize("metric", ["accuracy", "macro_f1", "micro_f1", "loss", "map"])
def test_every_multi_label_best_metric_is_taken(metric):
    from multi_train_utils.options import get_args_parser, parse_args

    from conftest import outcome

    parsed = outcome(lambda: parse_args(get_args_parser(distributed=False), ["--multi-label", "--best-metric", metric]))
    assert not isinstance(parsed, Exception), parsed
    assert parsed.best_metric == metric


def test_a_class_never_predicted_has_precision_nan_and_is_left_out_of_macro_precision():
    scores = torch.tensor([[0.9, 0.2], [0.8, 0.4], [0.1, 0.3]])
    targets = torch.tensor([[1, 1], [0, 0], [0, 1]])
    result = MultiLabelResult.from_scores(scores, targets, [0.5, 0.5])  # class 1 never reaches 0.5
    assert math.isnan(result.precision[1]) and result.recall[1] == 0.0 and result.f1[1] == 0.0
    assert result.precision[0] == pytest.approx(0.5)
    assert result.macro_precision == pytest.approx(0.5)  # class 1 left out, not counted as 0
    assert result.macro_recall == pytest.approx(0.5)  # (1 + 0) / 2


def test_the_report_keeps_the_curves_of_the_classes_of_lowest_ap_point_by_point():
    scores, targets = score_table(4, images=15)
    result = MultiLabelResult.from_scores(torch.tensor(scores), torch.tensor(targets))
    report = result.report(worst=2)
    measured = sorted((ap, c) for c, ap in enumerate(result.ap) if not math.isnan(ap))
    assert sorted(report["curves"]) == sorted(str(c) for _, c in measured[:2])
    for key, curve in report["curves"].items():
        c = int(key)
        points = []
        for t in sorted(set(column(scores, c)), reverse=True):  # fewer than 256: none thinned out
            _, (tp, fp, fn) = f1_by_definition(column(scores, c), column(targets, c), t)
            points.append((tp / (tp + fp), tp / (tp + fn)))
        assert curve["precision"] == pytest.approx([p for p, _ in points])
        assert curve["recall"] == pytest.approx([r for _, r in points])
    scores, targets = score_table(6, images=30, classes=11)  # more classes than the 6 curves kept
    result = MultiLabelResult.from_scores(torch.tensor(scores), torch.tensor(targets))
    lowest = sorted((ap, c) for c, ap in enumerate(result.ap) if not math.isnan(ap))[:6]
    assert sorted(result.report()["curves"], key=int) == [str(c) for c in sorted(c for _, c in lowest)]


def test_metrics_csv_holds_the_figures_at_a_half_while_the_run_keeps_the_tuned_thresholds(tmp_path):
    from multi_train_utils.checkpoint import TrainState
    from multi_train_utils.datasets import Datasets
    from conftest import run_recorder
    from multi_train_utils.train_eval_utils import TrainStats

    scores, targets = score_table(6, images=15)
    model = torch.nn.Linear(3, 4)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    args = full_flags(multi_label=True, tune_thresholds=True, best_metric="map", output_dir=str(tmp_path / "out"),
                      log_dir=str(tmp_path / "runs"), epochs=2, plots=False)
    empty = Datasets(torch.utils.data.TensorDataset(torch.zeros(1)), torch.utils.data.TensorDataset(torch.zeros(1)),
                     ["a", "b", "c", "d"])
    from multi_train_utils.options import task_of

    recorder = run_recorder(args, empty, state, task=task_of(args))
    recorder.end_epoch(0, TrainStats(0.5, 15, 1.0, 0.1, 15.0), MultiLabelResult.from_scores(torch.tensor(scores), torch.tensor(targets)))
    recorder.finish()  # per_class_metrics.csv: the best epoch at the tuned thresholds
    row = read_metrics(tmp_path / "out")[0]
    tp = fp = fn = 0
    for c in range(4):
        _, (a, b, d) = f1_by_definition(column(scores, c), column(targets, c), 0.5)
        tp, fp, fn = tp + a, fp + b, fn + d
    assert row["val_micro_f1"] == f"{2 * tp / (2 * tp + fp + fn):.6f}"  # at 0.5, as every epoch's row
    assert row["val_micro_precision"] == f"{tp / (tp + fp):.6f}" and row["val_micro_recall"] == f"{tp / (tp + fn):.6f}"
    tuned = json.loads((tmp_path / "out" / "thresholds.json").read_text())["classes"]
    for c, name in enumerate("abcd"):
        if any(column(targets, c)):
            best = max(sorted(set(column(scores, c)), reverse=True),
                       key=lambda t: f1_by_definition(column(scores, c), column(targets, c), t)[0])
            assert tuned[name] == pytest.approx(best, abs=1e-7)
    with open(tmp_path / "out" / "per_class_metrics.csv", newline="") as f:
        table = list(csv.DictReader(f))
    as_stored = torch.tensor(scores).tolist()  # float32, as the thresholds (one of them 0.4 in float32)
    for c, r in enumerate(table):
        _, (a, b, d) = f1_by_definition(column(as_stored, c), column(targets, c), tuned[r["class"]])
        assert float(r["threshold"]) == pytest.approx(tuned[r["class"]])
        for key, value in (("precision", a / (a + b) if a + b else math.nan), ("recall", a / (a + d) if a + d else math.nan),
                           ("f1", 2 * a / (2 * a + b + d) if 2 * a + b + d else math.nan)):
            assert (math.isnan(value) and r[key] == "nan") or float(r[key]) == pytest.approx(value), (r["class"], key)


def test_every_weights_file_of_a_run_is_predicted_at_the_runs_thresholds(straight):
    from model import create_model
    from multi_train_utils.options import make_task
    from multi_train_utils.run_files import load_trained_model

    out, _ = straight("ddp")
    thresholds = list(json.loads((out / "thresholds.json").read_text())["classes"].values())
    for name in ("model-0.pth", "model-2.pth", "checkpoint.pth", "model-best.pth"):
        trained = load_trained_model(Namespace(weights=str(out / name), model=None, img_size=None, class_indices=None),
                                     create_model, make_task)
        assert trained.task.name == "multi-label" and trained.task.thresholds == pytest.approx(thresholds), name


def test_a_report_of_many_classes_lists_the_lowest_ap_first_and_those_without_positives_last(capsys):
    """multi_label.listed_classes: beyond MAX_CLASSES_LISTED (20) classes, a report lists the
    WORST_SHOWN (10) "of lowest AP (classes without positives last)": 21 classes of which 8 have
    positives give those 8 from the lowest AP (equal APs in index order), then the first 2
    classes without positives."""
    from multi_train_utils.multi_label import listed_classes, print_class_lines

    classes = [f"class{c}" for c in range(21)]
    ap = [math.nan] * 21
    for c, value in {20: 0.9, 3: 0.2, 7: 0.5, 12: 0.2, 1: 0.7, 15: 0.1, 9: 0.95, 18: 0.4}.items():
        ap[c] = value
    report = {"ap": ap, "precision": [0.5] * 21, "recall": [0.5] * 21, "f1": [0.5] * 21,
              "thresholds": [0.5] * 21, "support": [1 if a == a else 0 for a in ap]}
    assert listed_classes(report, classes) == [15, 3, 12, 18, 7, 1, 20, 9, 0, 2]
    print_class_lines(report, classes)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("the 10 classes of lowest AP (of 21;")
    assert [line.split()[0] for line in lines[1:]] == [f"class{c}" for c in (15, 3, 12, 18, 7, 1, 20, 9, 0, 2)]
    assert listed_classes(report, classes[:20]) == list(range(20))  # 20 classes: every one


@pytest.mark.parametrize("distributed", [False, True])
def test_multi_label_trains_with_adamw_unless_an_optimizer_or_a_rate_is_given(distributed, tmp_path):
    """recipe.md: with --multi-label the defaults are AdamW at lr 0.001 (weight decay 0.05),
    taken whole: a given --opt or --lr keeps the usual defaults for the rest; single-label
    keeps SGD."""
    from conftest import parse_flags

    listed = tmp_path / "train.csv"
    listed.write_text("path,labels\na.png,x y\n")
    flags = ["--multi-label", "--train-list", str(listed)]
    got = lambda *more: (lambda a: (a.opt, a.lr, a.weight_decay))(parse_flags(distributed, *flags, *more))
    assert got() == ("adamw", 0.001, 0.05)
    assert got("--opt", "sgd") == ("sgd", 0.001, 0.005)
    assert got("--lr", "0.01") == ("sgd", 0.01, 0.005)
    assert got("--opt", "adamw", "--weight-decay", "0.1") == ("adamw", 0.001, 0.1)
    single = parse_flags(distributed, "--train-list", str(listed))
    assert (single.opt, single.lr, single.weight_decay) == ("sgd", 0.001, 0.005)
    from multi_train_utils.options import get_args_parser

    opt = next(a for a in get_args_parser(distributed)._actions if a.dest == "opt")
    assert "with --multi-label adamw at --lr 0.001 unless --opt or --lr is given" in " ".join(opt.help.split())


def test_eval_only_of_a_multi_label_run_takes_its_task_before_its_flags_are_checked(tmp_path):
    """multi-label.md: "--eval-only uses the run's thresholds.json" and its task: on the weights
    of a multi-label run, without --multi-label typed, the flags are those of a multi-label run:
    --best-metric map is taken, and the default best metric is map."""
    from conftest import parse_flags
    from multi_train_utils.options import args_to_dict

    listed = tmp_path / "train.csv"
    listed.write_text("path,labels\na.png,x y\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ran = full_flags(multi_label=True, task="multi-label", train_list=str(listed), best_metric="map", opt="adamw")
    (run_dir / "args.json").write_text(json.dumps(args_to_dict(ran)))
    weights = str(run_dir / "model-best.pth")
    from multi_train_utils.errors import UserError

    try:
        taken = parse_flags(False, "--eval-only", "--weights", weights, "--best-metric", "map").best_metric
    except UserError as refused:  # checked as single-label: the assertion below says so
        taken = f"refused: {refused}"
    assert taken == "map"
    args = parse_flags(True, "--eval-only", "--weights", weights)
    assert (args.multi_label, args.best_metric) == (True, "map")
