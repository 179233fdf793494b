"""A task of one's own, written as docs/layout.md ("A task of your own") shows: ordered classes.

The classes are grades in order (class 0 below class 1 below ...), so a prediction one grade
off is better than one four grades off. The model and its loss stay a classifier's
(cross-entropy); what changes is what evaluation counts and what the run reports: the mean
absolute error in grades (``mae``, lower is better, the default --best-metric), and predict.py's
expected grade. Chosen with ``--task tests/helpers/ordinal_task.py:Ordinal``; nothing in the
engine changes.
"""
import os

import torch
from torch import nn

from multi_train_utils.loaders import class_weights
from multi_train_utils.distributed_utils import all_reduce_sum
from multi_train_utils.files import csv_text, write_text_atomic
from multi_train_utils.task import Task


class Ordinal(Task):
    metrics = ("mae", "accuracy", "loss")  # the first is the default --best-metric
    lower_is_better = ("mae", "loss")
    columns = ("val_mae", "ema_val_mae")  # metrics.csv columns of its own, after the common ones

    def class_weights(self, labels, num_classes):
        return class_weights(labels, num_classes)

    def loss(self, class_weights=None, label_smoothing=0.0):
        return nn.CrossEntropyLoss(weight=class_weights, label_smoothing=label_smoothing)

    def evaluation(self, num_classes, device):
        return GradeTally(device)

    def cells(self, result, ema_result=None):
        cells = super().cells(result, ema_result)  # val_accuracy, val_loss and the EMA's
        cells["val_mae"] = f"{result.mae:.6f}"
        if ema_result is not None:
            cells["ema_val_mae"] = f"{ema_result.mae:.6f}"
        return cells

    def epoch_text(self, result, ema_result=None):
        return f"val_mae: {result.mae:.4f}  " + super().epoch_text(result, ema_result)

    def scalars(self, result):
        return {**super().scalars(result), "mae": result.mae}

    def keep(self, result):
        return {"confusion": None, "report": {"mae": result.mae, "images": result.total}}

    def print_best(self, best, classes, folder, tuned=False):
        if best.report is not None:
            print(f"grades: {best.report['mae']:.4f} off on average over {best.report['images']} validation images")

    def print_evaluation(self, result, classes):
        print(f"mae: {result.mae:.6f} ({result.total} images)  accuracy: {result.accuracy:.6f} "
              f"({result.correct}/{result.total})", flush=True)

    def write_evaluation(self, result, classes, folder, title):
        os.makedirs(folder, exist_ok=True)
        rows = [["metric", "value"], ["mae", result.mae], ["accuracy", result.accuracy], ["images", result.total]]
        write_text_atomic(csv_text(rows), os.path.join(folder, "overall_metrics.csv"))

    def describe(self, probabilities, classes, top_k):
        expected = float((probabilities * torch.arange(len(classes))).sum())
        best = int(probabilities.argmax())
        return f"grade {classes[best]} ({float(probabilities[best]):.3f}), expected grade {expected:.2f}"

    def prediction_table(self, rows, classes):
        table = [["path", "grade", "expected"]]
        for path, probabilities in rows:
            expected = float((probabilities * torch.arange(len(classes))).sum())
            table.append([path, classes[int(probabilities.argmax())], f"{expected:.6f}"])
        return table


class GradeTally:
    """Counts on the device, summed over ranks in one all-reduce at the end: images, right ones,
    grades off, images left out; and the summed cross-entropy."""

    def __init__(self, device):
        self.counts = torch.zeros(4, dtype=torch.int64, device=device)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, logits, labels, weights):
        left_out = labels < 0  # an image the dataset could not read
        self.counts[3] += (left_out * weights).sum()
        weights, labels = weights * ~left_out, labels.clamp(min=0)  # weights: 0 for padded rows
        off = (logits.argmax(dim=1) - labels).abs()
        self.counts[:3] += torch.stack([weights.sum(), ((off == 0) * weights).sum(), (off * weights).sum()])
        losses = nn.functional.cross_entropy(logits.float(), labels, reduction="none")
        self.loss_sum += (losses * weights).sum().double()

    def result(self):
        all_reduce_sum(self.counts)
        all_reduce_sum(self.loss_sum)
        total, correct, off, left_out = self.counts.tolist()
        return GradeResult(total, correct, off, float(self.loss_sum), left_out)


class GradeResult:
    def __init__(self, total, correct, off, loss_sum, left_out):
        self.total, self.correct, self.off, self.loss_sum, self.left_out = total, correct, off, loss_sum, left_out

    @property
    def accuracy(self):
        return self.correct / max(1, self.total)

    @property
    def mae(self):
        return self.off / max(1, self.total)

    @property
    def loss(self):
        return self.loss_sum / max(1, self.total)

    def metric(self, name):
        return getattr(self, name)
