"""In-process checks of the validation metrics: balanced accuracy, macro-F1, per-class
precision and recall against numbers worked out by hand, and evaluate's top-5 count (padded
rows of a short last batch left out, the same for any split of the images into batches)."""
import math

import pytest
import torch
from torch import nn

from multi_train_utils.images import IMAGENET_MEAN, IMAGENET_STD
from multi_train_utils.single_label import EvalResult
from multi_train_utils.train_eval_utils import evaluate
from test_device_paths import SYNCING_OPS, OpRecorder

NAN = float("nan")


def same(actual, expected):
    """Lists of floats equal, nan where expected is nan."""
    assert len(actual) == len(expected), (actual, expected)
    for a, e in zip(actual, expected):
        if math.isnan(e):
            assert math.isnan(a), (actual, expected)
        else:
            assert a == pytest.approx(e), (actual, expected)


# --- metrics of a hand-made confusion matrix -----------------------------------------------------

# Rows are true classes, columns predictions. Class 2 has no images but is predicted once;
# class 3 has images but is never predicted; class 4 has neither.
CONFUSION = torch.tensor([
    [3, 1, 0, 0, 0],
    [1, 2, 1, 0, 0],
    [0, 0, 0, 0, 0],
    [2, 0, 0, 0, 0],
    [0, 0, 0, 0, 0],
])


def test_metrics_equal_hand_computed_values_on_a_hand_made_confusion_matrix():
    result = EvalResult(CONFUSION)
    assert (result.correct, result.total) == (5, 10)
    assert result.accuracy == pytest.approx(0.5)
    # recall = diagonal / row sum (images 4, 4, 0, 2, 0); nan without images
    same(result.recall, [3 / 4, 2 / 4, NAN, 0 / 2, NAN])
    # precision = diagonal / column sum (predictions 6, 3, 1, 0, 0); nan when never predicted
    same(result.precision, [3 / 6, 2 / 3, 0 / 1, NAN, NAN])
    # F1 = 2 TP / (2 TP + FP + FN): class 0: 6 / (6 + 3 + 1), class 1: 4 / (4 + 1 + 2),
    # class 2: 0 / (0 + 1 + 0), class 3: 0 / (0 + 0 + 2), class 4: 0 / 0, left out
    same(result.f1, [6 / 10, 4 / 7, 0.0, 0.0, NAN])
    # balanced accuracy: mean recall over the 3 classes with images (0, 1, 3)
    assert result.balanced_accuracy == pytest.approx((0.75 + 0.5 + 0.0) / 3)
    # macro-F1: mean over the 4 classes with images or predictions (0, 1, 2, 3)
    assert result.macro_f1 == pytest.approx((0.6 + 4 / 7 + 0.0 + 0.0) / 4)
    assert result.top5_correct is None and result.top5_accuracy is None
    assert EvalResult(CONFUSION, top5_correct=7).top5_accuracy == pytest.approx(7 / 10)


def test_metrics_of_a_perfect_and_of_an_empty_confusion_matrix():
    perfect = EvalResult(torch.diag(torch.tensor([2, 0, 5])))
    same(perfect.recall, [1.0, NAN, 1.0])
    same(perfect.precision, [1.0, NAN, 1.0])
    assert (perfect.balanced_accuracy, perfect.macro_f1) == (1.0, 1.0)
    empty = EvalResult(torch.zeros(3, 3, dtype=torch.int64))
    assert (empty.accuracy, empty.balanced_accuracy, empty.macro_f1) == (0.0, 0.0, 0.0)


# --- top-5 in evaluate ---------------------------------------------------------------------------

class FixedLogits(nn.Module):
    """A model whose output for image i is row i of a table: image i is a uint8 image whose
    pixels are all i, read back here from the normalised channel 0."""

    def __init__(self, table):
        super().__init__()
        self.table = table

    def forward(self, images):
        pixels = images[:, 0, 0, 0] * (IMAGENET_STD[0] * 255) + IMAGENET_MEAN[0] * 255
        return self.table[pixels.round().long()]


def indexed_images(indices):
    return torch.as_tensor(indices, dtype=torch.uint8).view(-1, 1, 1, 1).expand(-1, 3, 2, 2).contiguous()


def batches_of(indices, labels, batch_size):
    """The (images, labels) batches a loader would give, in the order of ``indices``."""
    return [(indexed_images(indices[i:i + batch_size]), labels[indices[i:i + batch_size]])
            for i in range(0, len(indices), batch_size)]


def logits_ranking(label, rank, classes=7):
    """Logits over ``classes`` in which ``label`` has the given rank (1 = highest)."""
    order = [c for c in range(classes) if c != label]
    order.insert(rank - 1, label)
    logits = torch.empty(classes)
    logits[order] = torch.arange(classes, 0, -1, dtype=torch.float)
    return logits


def test_top5_counts_known_logits_and_leaves_out_the_padding_of_a_short_last_batch():
    # 7 classes; per image (label, rank of the label in its logits). Batches of 3: 3 + 3 + 1,
    # the last one padded with 2 copies of image 6, a top-5 hit that must count once.
    cases = [(0, 1), (1, 5), (2, 6), (3, 2), (4, 7), (5, 5), (6, 3)]
    labels = torch.tensor([label for label, _ in cases])
    table = torch.stack([logits_ranking(label, rank) for label, rank in cases])
    batches = batches_of(list(range(7)), labels, 3)
    recorder = OpRecorder()
    with recorder:
        result = evaluate(FixedLogits(table), batches, torch.device("cpu"), 7)
    # the top-5 count stays on the device: no host sync per batch
    assert [op for op in recorder.ops if any(name in op for name in SYNCING_OPS)] == []
    # hits: ranks 1, 5, 2, 5, 3 (images 0, 1, 3, 5, 6); misses: ranks 6 and 7
    assert (result.total, result.top5_correct) == (7, 5)
    assert result.top5_accuracy == pytest.approx(5 / 7)
    assert result.correct == 1  # only image 0 has its label ranked first


def test_top5_is_absent_with_five_classes_or_fewer():
    table = torch.eye(5)
    labels = torch.tensor([0, 1, 2, 3, 4])
    result = evaluate(FixedLogits(table), batches_of(list(range(5)), labels, 2), torch.device("cpu"), 5)
    assert result.correct == 5
    assert result.top5_correct is None and result.top5_accuracy is None


def test_metrics_are_the_same_for_any_split_of_the_images_into_batches():
    generator = torch.Generator().manual_seed(0)
    count, classes = 23, 8
    table = torch.randn(count, classes, generator=generator)
    labels = torch.randint(0, classes, (count,), generator=generator)
    # reference, one image at a time by plain loops
    confusion = torch.zeros(classes, classes, dtype=torch.int64)
    top5 = 0
    for logits, label in zip(table, labels):
        confusion[label, int(logits.argmax())] += 1
        top5 += int(sorted(logits.tolist(), reverse=True).index(float(logits[label])) < 5)
    model = FixedLogits(table)
    for seed, batch_size in ((0, 1), (1, 4), (2, 5), (3, 7), (4, 23)):
        order = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()
        result = evaluate(model, batches_of(order, labels, batch_size), torch.device("cpu"), classes)
        assert torch.equal(result.confusion, confusion), batch_size
        assert result.top5_correct == top5, batch_size


# --- the report of --eval-only and --eval-output -------------------------------------------------

def test_eval_only_prints_every_metric_with_top1_last(capsys):
    from multi_train_utils.single_label import print_evaluation

    print_evaluation(EvalResult(CONFUSION), ["a", "b", "c", "d", "e"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[5:] == [
        "per-class precision, recall, F1 (nan: never predicted / no images / neither):",
        "  a  0.500000  0.750000  0.600000",
        "  b  0.666667  0.500000  0.571429",
        "  c  0.000000  nan  0.000000",
        "  d  nan  0.000000  0.000000",
        "  e  nan  nan  nan",
        "balanced accuracy: 0.416667  macro-F1: 0.292857",  # 1.25 / 3 and (0.6 + 4 / 7) / 4
        "top1 accuracy: 0.500000 (5/10)",
    ]
    print_evaluation(EvalResult(CONFUSION, top5_correct=7), ["a", "b", "c", "d", "e"])
    assert capsys.readouterr().out.splitlines()[-2:] == ["top5 accuracy: 0.700000 (7/10)",
                                                        "top1 accuracy: 0.500000 (5/10)"]


def test_eval_output_csv_holds_the_overall_and_per_class_metrics():
    import csv
    import io

    from multi_train_utils.single_label import evaluation_metrics_csv

    overall, per_class = (list(csv.reader(io.StringIO(text)))
                          for text in evaluation_metrics_csv(EvalResult(CONFUSION, top5_correct=7), list("abcde")))
    assert [(name, float(value)) for name, value in overall[1:]] == [
        ("top1_accuracy", 0.5), ("top5_accuracy", 0.7), ("balanced_accuracy", pytest.approx(1.25 / 3)),
        ("macro_f1", pytest.approx((0.6 + 4 / 7) / 4)), ("images", 10), ("left_out", 0)]
    assert per_class[0] == ["class", "images", "predicted", "correct", "precision", "recall", "f1"]
    assert [row[:4] for row in per_class[1:]] == [["a", "4", "6", "3"], ["b", "4", "3", "2"], ["c", "0", "1", "0"],
                                                 ["d", "2", "0", "0"], ["e", "0", "0", "0"]]
    same([float(row[4]) for row in per_class[1:]], [3 / 6, 2 / 3, 0.0, NAN, NAN])
    same([float(row[5]) for row in per_class[1:]], [3 / 4, 2 / 4, NAN, 0.0, NAN])
    same([float(row[6]) for row in per_class[1:]], [0.6, 4 / 7, 0.0, 0.0, NAN])
    overall, _ = evaluation_metrics_csv(EvalResult(CONFUSION), list("abcde"))
    assert "top5" not in overall  # 5 classes: no top-5
