"""Single-label classification, the default task: one class an image, cross-entropy.

A confusion matrix is counted on each rank and summed over ranks; its figures and reports."""
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from multi_train_utils.distributed_utils import all_reduce_sum
from multi_train_utils.files import csv_text, write_text_atomic
from multi_train_utils.loaders import class_weights
from multi_train_utils.pictures import most_confused_pairs, save_confusion_matrix
from multi_train_utils.task import MAX_CLASSES_LISTED, Task, WORST_SHOWN, nanmean as _nanmean, ratio


# What --eval-output writes besides the confusion matrix, in evaluation_metrics_csv's order.
EVALUATION_FILES = ("overall_metrics.csv", "per_class_metrics.csv")


class SingleLabel(Task):
    """One class an image (a class index), cross-entropy, exact counts: accuracy, balanced
    accuracy, macro-F1, top-5 (more than 5 classes), the confusion matrix."""

    name = "single-label"
    metrics = ("accuracy", "balanced_accuracy", "macro_f1", "loss")

    def class_weights(self, labels, num_classes):
        return class_weights(labels, num_classes)

    def loss(self, class_weights=None, label_smoothing=0.0):
        return nn.CrossEntropyLoss(weight=class_weights, label_smoothing=label_smoothing)

    def evaluation(self, num_classes, device):
        return ConfusionTally(num_classes, device)

    def cells(self, result, ema_result=None):
        columns = ["val_loss", "val_balanced_accuracy", "val_macro_f1", "val_top5_accuracy"]
        cells = dict(zip(["val_accuracy", *columns], [f"{result.accuracy:.6f}", *metric_cells(result, top5=True)]))
        if ema_result is not None:
            cells.update(zip(["ema_val_accuracy", "ema_val_loss", "ema_val_balanced_accuracy", "ema_val_macro_f1"],
                             metric_cells(ema_result)))
        return cells

    def epoch_text(self, result, ema_result=None):
        top5 = f"  val_top5: {result.top5_accuracy:.4f}" if result.top5_accuracy is not None else ""
        left_out = f", {result.left_out} unreadable left out" if result.left_out else ""
        ema = f"  ema_val_accuracy: {ema_result.accuracy:.4f}" if ema_result is not None else ""
        return f"val_accuracy: {result.accuracy:.4f} ({result.correct}/{result.total}{left_out}){top5}{ema}"

    def scalars(self, result):
        names = ("accuracy", "balanced_accuracy", "macro_f1", "top5_accuracy")
        figures = {name: getattr(result, name) for name in names}
        return {**{k: v for k, v in figures.items() if v is not None}, "val_loss": result.loss}

    def keep(self, result):
        return {"confusion": result.confusion, "report": None}

    def report_best(self, best, classes, folder, writer=None, step=0, pictures=True):
        if not pictures:
            return []
        if best.confusion is not None:
            return save_confusion_matrix(best.confusion, classes, folder, f"best epoch {best.epoch}, validation",
                                         writer=writer, step=step)
        # a checkpoint from before confusion matrices were kept, and no better epoch since
        print(f"note: no confusion matrix of the best epoch {best.epoch} was kept; draw one with "
              f"--eval-only --weights {os.path.join(folder, 'model-best.pth')} --eval-output DIR")
        return []

    def print_evaluation(self, result, classes):
        print_evaluation(result, classes)

    def write_evaluation(self, result, classes, folder, title):
        save_confusion_matrix(result.confusion, classes, folder, title)
        for text, name in zip(evaluation_metrics_csv(result, classes), EVALUATION_FILES):
            write_text_atomic(text, os.path.join(folder, name))


class ConfusionTally:
    """A validation pass's counts on the device: the confusion matrix, the top-5 hits and the
    images left out in one tensor (one all-reduce), and the summed cross-entropy. No host
    sync until ``result``."""

    def __init__(self, num_classes, device):
        self.num_classes, self.cells = num_classes, num_classes * num_classes
        self.top5 = num_classes > 5
        self.counts = torch.zeros(self.cells + 2, dtype=torch.int64, device=device)
        self.loss_sum = loss_accumulator(device)

    def add(self, logits, labels, weights):
        cells, counts = self.cells, self.counts
        left_out = labels < 0
        counts[cells + 1:].add_((left_out * weights).sum())
        weights, labels = weights * ~left_out, labels.clamp(min=0)
        predictions = logits.argmax(dim=1)
        # index_add_, not bincount: bincount reads its input's min and max back to the host.
        counts[:cells].index_add_(0, labels * self.num_classes + predictions, weights)
        if self.top5:
            hits = (logits.topk(5, dim=1).indices == labels[:, None]).any(dim=1)
            counts[cells:cells + 1].add_((hits * weights).sum())  # weights: padded rows count 0
        losses = nn.functional.cross_entropy(logits.float(), labels, reduction="none")
        self.loss_sum += (losses * weights).sum().to(self.loss_sum.dtype)

    def result(self):
        all_reduce_sum(self.counts)
        all_reduce_sum(self.loss_sum)
        counts = self.counts.cpu()
        top5_hits, left_out = counts[self.cells:].tolist()  # tolist: read on the host copy
        loss_total = self.loss_sum.cpu().tolist()  # one copy to the host, as for the counts
        return EvalResult(counts[:self.cells].view(self.num_classes, self.num_classes),
                          top5_hits if self.top5 else None, loss_total, left_out)


def loss_accumulator(device):
    """A zero to sum a pass's loss into, on the device: float64 (MPS has none: float32)."""
    return torch.zeros((), dtype=torch.float32 if device.type == "mps" else torch.float64, device=device)


@dataclass
class EvalResult:
    """Counts of a validation pass, summed over ranks: the confusion matrix (rows are true
    classes, columns predictions) and, with more than 5 classes, the top-5 hits.

    Empty denominators: a class with no validation images has recall nan and is left out of
    balanced accuracy; a class never predicted has precision nan; a class with neither images
    nor predictions has F1 nan and is left out of macro-F1 (it tells nothing about the model).
    A class with images but no predictions, or predictions but no images, has F1 0.
    """

    confusion: torch.Tensor
    top5_correct: Optional[int] = None  # None with 5 classes or fewer, where top-5 is always 100 %
    loss_sum: float = math.nan  # cross-entropy summed over the images (no smoothing, no class weights)
    left_out: int = 0  # validation images that could not be read (not in the counts)

    @property
    def correct(self):
        return int(self.confusion.diag().sum())

    @property
    def total(self):
        return int(self.confusion.sum())

    def _per_class(self, denominators):
        """Diagonal over ``denominators`` per class as floats, nan where a denominator is 0."""
        return ratio(self.confusion.diag(), denominators)

    @property
    def recall(self):
        """Per-class recall (correct / validation images of the class); nan for a class
        without validation images."""
        return self._per_class(self.confusion.sum(dim=1)).tolist()

    @property
    def precision(self):
        """Per-class precision (correct / predictions of the class); nan for a class the
        model never predicted."""
        return self._per_class(self.confusion.sum(dim=0)).tolist()

    @property
    def f1(self):
        """Per-class F1 = 2 TP / (2 TP + FP + FN), which is 0 rather than undefined when only
        precision is; nan for a class with neither images nor predictions."""
        return self._per_class((self.confusion.sum(dim=0) + self.confusion.sum(dim=1)).div(2)).tolist()

    @property
    def balanced_accuracy(self):
        """Mean recall over the classes that have validation images (0.0 when none has)."""
        return _nanmean(self.recall)

    @property
    def macro_f1(self):
        """Mean F1 over the classes with validation images or predictions (0.0 when none)."""
        return _nanmean(self.f1)

    @property
    def top5_accuracy(self):
        """Share of images whose class is among the 5 highest logits; None with 5 classes or fewer."""
        if self.top5_correct is None:
            return None
        return self.top5_correct / max(1, self.total)

    @property
    def accuracy(self):
        return self.correct / max(1, self.total)

    @property
    def loss(self):
        """Mean validation cross-entropy per image (plain: no label smoothing, no class weights)."""
        return self.loss_sum / max(1, self.total)

    def metric(self, name):
        """The value of --best-metric ``name``: accuracy, balanced_accuracy, macro_f1 or loss."""
        return getattr(self, name)


def metric_cells(result, top5=False):
    """metrics.csv's cells of an evaluation: loss, balanced accuracy, macro-F1 (and, with
    ``top5``, top-5 accuracy, empty with 5 classes or fewer; the EMA's cells start with its
    accuracy); all empty for no evaluation (no --model-ema)."""
    if result is None:
        return [""] * 4
    balanced = "" if result.balanced_accuracy is None else f"{result.balanced_accuracy:.6f}"  # None: multi-label
    cells = [f"{result.loss:.6f}", balanced, f"{result.macro_f1:.6f}"]
    if top5:
        return cells + ["" if result.top5_accuracy is None else f"{result.top5_accuracy:.6f}"]
    return [f"{result.accuracy:.6f}"] + cells


def print_evaluation(result, classes):
    """Per-class accuracy lines, per-class precision, recall and F1 (with more than
    MAX_CLASSES_LISTED classes: the worst of them by recall, and the most-confused pairs),
    balanced accuracy and macro-F1, top-5 (more than 5 classes), the images left out, then
    ``top1 accuracy: 0.812500 (130/160)`` as the last line."""
    if len(classes) > MAX_CLASSES_LISTED:
        print_worst_classes(result, classes)
    else:
        print_every_class(result, classes)
    print(f"balanced accuracy: {result.balanced_accuracy:.6f}  macro-F1: {result.macro_f1:.6f}")
    if result.left_out:
        print(f"left out: {result.left_out} validation image(s) that could not be read (see the warnings)")
    if result.top5_accuracy is not None:
        print(f"top5 accuracy: {result.top5_accuracy:.6f} ({result.top5_correct}/{result.total})")
    print(f"top1 accuracy: {result.accuracy:.6f} ({result.correct}/{result.total})", flush=True)


def print_worst_classes(result, classes, shown=WORST_SHOWN):
    """The ``shown`` classes of lowest recall with their precision and F1, then the most-confused
    pairs of classes; the whole table is per_class_metrics.csv's (--eval-output)."""
    recall, precision, f1 = result.recall, result.precision, result.f1
    measured = [c for c in range(len(classes)) if recall[c] == recall[c]]  # not nan: the class has images
    worst = sorted(measured, key=lambda c: (recall[c], c))[:shown]
    width = max(len(classes[c]) for c in worst) if worst else 0
    print(f"the {len(worst)} classes of lowest recall (of {len(classes)}; all of them: per_class_metrics.csv "
          "with --eval-output), recall  precision  F1:")
    images = result.confusion.sum(dim=1).tolist()
    for c in worst:
        print(f"  {classes[c]:<{width}}  {recall[c]:.6f} ({int(result.confusion[c, c])}/{images[c]})  "
              f"{precision[c]:.6f}  {f1[c]:.6f}")
    pairs = most_confused_pairs(result.confusion, shown)
    if pairs:
        print("most confused (true -> predicted: images):")
        for true, predicted, count in pairs:
            print(f"  {classes[true]} -> {classes[predicted]}: {count}")


def print_every_class(result, classes):
    """A line per class: its accuracy; then a line per class: precision, recall, F1."""
    width = max(len(c) for c in classes)
    for i, name in enumerate(classes):
        row = result.confusion[i]
        total, correct = int(row.sum()), int(row[i])
        print(f"  {name:<{width}}  {correct / max(1, total):.6f} ({correct}/{total})")
    # nan where undefined (EvalResult says when): a made-up 0 would read as a measured one
    print("per-class precision, recall, F1 (nan: never predicted / no images / neither):")
    for name, values in zip(classes, zip(result.precision, result.recall, result.f1)):
        print(f"  {name:<{width}}  " + "  ".join(f"{v:.6f}" for v in values))


def evaluation_metrics_csv(result, classes):
    """(overall_metrics.csv, per_class_metrics.csv) as CSV text: ``metric,value`` rows (top-5
    only with more than 5 classes), and a row per class with its counts, precision, recall
    and F1 (nan where undefined, as EvalResult defines)."""
    overall = [["metric", "value"], ["top1_accuracy", result.accuracy]]
    if result.top5_accuracy is not None:
        overall.append(["top5_accuracy", result.top5_accuracy])
    overall += [["balanced_accuracy", result.balanced_accuracy], ["macro_f1", result.macro_f1],
                ["images", result.total], ["left_out", result.left_out]]
    per_class = [["class", "images", "predicted", "correct", "precision", "recall", "f1"]]
    images, predicted = result.confusion.sum(dim=1).tolist(), result.confusion.sum(dim=0).tolist()
    for i, name in enumerate(classes):
        per_class.append([name, images[i], predicted[i], int(result.confusion[i, i]),
                          result.precision[i], result.recall[i], result.f1[i]])
    return csv_text(overall), csv_text(per_class)


