"""Multi-label classification (--multi-label): an image may carry several classes (or none).

Targets are multi-hot rows (one 0/1 entry per class), the model gives one logit per class, and
the loss is binary cross-entropy with logits (``MultiLabelLoss``). Evaluation ranks every
validation score, so each rank's scores are gathered from every rank (``ScoreTally``).

Average precision is scikit-learn's ``average_precision_score``: over the distinct scores t
of a class, from the highest, AP = sum of (R(t) - R(previous t)) x P(t), where P and R are
the precision and recall of "score >= t" (steps, no interpolation); images of equal scores
enter together. A class without positive validation images has AP nan and is left out of mAP.
"""
import math
import os
from functools import cached_property

import numpy as np
import torch
from torch import nn

from multi_train_utils.distributed_utils import all_gather_rows, all_reduce_sum
from multi_train_utils.files import NUMBER, check_fields, csv_text, read_json, write_json_atomic, write_text_atomic
from multi_train_utils.pictures import PLOT_FILES, plot_per_class_ap, plot_pr_curves, save_figure
from multi_train_utils.run_files import THRESHOLDS_FILE
from multi_train_utils.single_label import EVALUATION_FILES, loss_accumulator
from multi_train_utils.errors import UserError
from multi_train_utils.task import MAX_CLASSES_LISTED, WORST_SHOWN, Task, nanmean, ratio

# --class-weights balanced: each class's positive weight is its negatives / positives, at most
# this (a class in 1 of 10,000 images would otherwise weigh its positives 9,999 times).
POS_WEIGHT_CAP = 100.0
DEFAULT_THRESHOLD = 0.5  # a class is predicted when its probability is at least its threshold
CURVE_POINTS = 256  # points kept of each precision-recall curve drawn at the end
WORST_CURVES = 6  # classes of lowest AP whose precision-recall curves are drawn
PER_CLASS_FILE = "per_class_metrics.csv"
PER_CLASS_HEADER = ["class", "ap", "support", "threshold", "precision", "recall", "f1"]


def positive_weights(targets, cap=POS_WEIGHT_CAP):
    """--class-weights balanced under --multi-label: per class, its negatives / positives in
    the training ``targets``, at most ``cap``; 1 for a class that every image, or none, has
    (nothing to balance). A float32 tensor for ``MultiLabelLoss(pos_weight=...)``."""
    targets = np.asarray(targets).astype(np.int64)
    positives = targets.sum(axis=0)
    negatives = len(targets) - positives
    weights = [min(n / p, cap) if p and n else 1.0 for p, n in zip(positives.tolist(), negatives.tolist())]
    return torch.tensor(weights, dtype=torch.float32)


def smoothed(targets, label_smoothing):
    """Multi-hot targets moved toward 0.5 by ``label_smoothing`` (ε): y (1 - ε) + ε / 2, so a
    positive becomes 1 - ε/2 and a negative ε/2."""
    return targets * (1.0 - label_smoothing) + label_smoothing / 2 if label_smoothing else targets


class MultiLabelLoss(nn.Module):
    """Binary cross-entropy with logits, averaged over images and classes; targets multi-hot
    (or mixed by MixUp/CutMix), smoothed by ``label_smoothing``, each class's positive term
    weighed by ``pos_weight`` (--class-weights balanced)."""

    def __init__(self, pos_weight=None, label_smoothing=0.0):
        super().__init__()
        self.register_buffer("pos_weight", pos_weight)
        self.label_smoothing = label_smoothing

    def forward(self, logits, targets):
        targets = smoothed(targets.float(), self.label_smoothing)  # under autocast the loss runs in float32
        return nn.functional.binary_cross_entropy_with_logits(logits, targets, pos_weight=self.pos_weight)


def predicted_names(probabilities, thresholds, classes):
    """The classes whose probability reaches their threshold, highest first, as (name, p)."""
    chosen = [(float(p), c) for c, (p, t) in enumerate(zip(probabilities.tolist(), thresholds)) if p >= t]
    return [(classes[c], p) for p, c in sorted(chosen, key=lambda pc: (-pc[0], pc[1]))]


def _ranked(scores, positives):
    """For one class: (distinct scores from the highest, true positives and false positives of
    "score >= t" at each), images of equal scores counted together."""
    order = torch.argsort(scores, descending=True, stable=True)
    ranked, hits = scores[order], positives[order].double()
    tp, fp = torch.cumsum(hits, 0), torch.cumsum(1 - hits, 0)
    last = torch.ones(len(ranked), dtype=torch.bool)
    last[:-1] = ranked[1:] != ranked[:-1]  # the last image of each group of equal scores
    return ranked[last], tp[last], fp[last]


def average_precision(scores, positives):
    """AP of one class (``scores``: 1-D, ``positives``: 1-D bool), as scikit-learn's; nan
    without positives."""
    total = int(positives.sum())
    if total == 0:
        return math.nan
    _, tp, fp = _ranked(scores, positives)
    precision, recall = tp / (tp + fp), tp / total
    return float(((recall - torch.cat([recall.new_zeros(1), recall[:-1]])) * precision).sum())


def best_f1_threshold(scores, positives, default=DEFAULT_THRESHOLD):
    """The threshold t (one of the class's scores) whose "score >= t" has the highest F1 for
    the class; of equal F1s the highest t. ``default`` for a class without positives."""
    total = int(positives.sum())
    if total == 0 or len(scores) == 0:
        return default
    thresholds, tp, fp = _ranked(scores, positives)
    f1 = 2 * tp / (2 * tp + fp + (total - tp))
    return float(thresholds[int(torch.argmax(f1))])  # argmax: the first of equal values, the highest threshold


def precision_recall_curve(scores, positives, points=CURVE_POINTS):
    """(precision, recall) lists of one class over its distinct thresholds, from the highest,
    thinned to at most ``points`` (the first and last kept)."""
    _, tp, fp = _ranked(scores, positives)
    total = max(1, int(positives.sum()))
    precision, recall = (tp / (tp + fp)), tp / total
    keep = torch.linspace(0, len(tp) - 1, min(points, len(tp))).round().long().unique()
    return precision[keep].tolist(), recall[keep].tolist()


class MultiLabelResult:
    """A multi-label validation pass: every image's probabilities (``scores``, N x C) and
    targets (N x C, 0/1), the ``thresholds`` in use (one per class), the summed BCE and the
    images left out. Every figure is computed from these, the same at any world size.

    Precision, recall and F1 per class are those of "probability >= threshold": precision nan
    for a class never predicted, recall nan for a class without positives, F1 = 2 TP / (2 TP +
    FP + FN), nan with neither; macro means leave nan out, micro ones pool the counts."""

    top5_accuracy = None  # no top-5 with several labels
    balanced_accuracy = None
    confusion = None

    def __init__(self, scores, targets, thresholds=None, loss_sum=math.nan, left_out=0):
        self.scores = scores.float().cpu()
        self.targets = targets.cpu() > 0.5
        classes = self.scores.shape[1]
        thresholds = [DEFAULT_THRESHOLD] * classes if thresholds is None else list(thresholds)
        self.thresholds = torch.tensor(thresholds, dtype=torch.float32)
        self.loss_sum, self.left_out = loss_sum, left_out

    @property
    def total(self):
        return len(self.scores)

    @property
    def num_classes(self):
        return self.scores.shape[1]

    @cached_property
    def predicted(self):
        return self.scores >= self.thresholds

    @cached_property
    def counts(self):
        """(TP, FP, FN) per class at the thresholds, int64 tensors."""
        predicted, targets = self.predicted, self.targets
        return ((predicted & targets).sum(0), (predicted & ~targets).sum(0), (~predicted & targets).sum(0))

    @property
    def support(self):
        """Positive validation images of each class."""
        return self.targets.sum(0).tolist()

    @cached_property
    def ap(self):
        """Average precision of each class (nan without positives)."""
        return [average_precision(self.scores[:, c], self.targets[:, c]) for c in range(self.num_classes)]

    @property
    def map(self):
        """The mean AP over the classes with at least one positive (0.0 when none has)."""
        return nanmean(self.ap)

    @property
    def precision(self):
        tp, fp, _ = self.counts
        return ratio(tp, tp + fp).tolist()

    @property
    def recall(self):
        tp, _, fn = self.counts
        return ratio(tp, tp + fn).tolist()

    @property
    def f1(self):
        tp, fp, fn = self.counts
        return ratio(2 * tp, 2 * tp + fp + fn).tolist()

    @property
    def macro_f1(self):
        return nanmean(self.f1)

    @property
    def macro_precision(self):
        return nanmean(self.precision)

    @property
    def macro_recall(self):
        return nanmean(self.recall)

    def _micro(self):
        tp, fp, fn = (int(c.sum()) for c in self.counts)
        return tp, fp, fn

    @property
    def micro_precision(self):
        tp, fp, _ = self._micro()
        return tp / (tp + fp) if tp + fp else 0.0

    @property
    def micro_recall(self):
        tp, _, fn = self._micro()
        return tp / (tp + fn) if tp + fn else 0.0

    @property
    def micro_f1(self):
        tp, fp, fn = self._micro()
        return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0

    @property
    def correct(self):
        """Images whose predicted classes are exactly their classes (subset accuracy's hits)."""
        return int((self.predicted == self.targets).all(dim=1).sum())

    @property
    def accuracy(self):
        """Exact-match (subset) accuracy: the share of images with every class right."""
        return self.correct / max(1, self.total)

    @property
    def loss(self):
        """Mean binary cross-entropy per image and class (no smoothing, no positive weights)."""
        return self.loss_sum / max(1, self.total * self.num_classes)

    def metric(self, name):
        """The value of --best-metric ``name``: map, accuracy (exact match), macro_f1, micro_f1 or loss."""
        return getattr(self, name)

    def tuned_thresholds(self):
        """Per class, the threshold of the highest F1 on these images (``best_f1_threshold``)."""
        return [best_f1_threshold(self.scores[:, c], self.targets[:, c], float(self.thresholds[c]))
                for c in range(self.num_classes)]

    def with_thresholds(self, thresholds):
        """The same images and scores, at other thresholds."""
        return MultiLabelResult(self.scores, self.targets, thresholds, self.loss_sum, self.left_out)

    def report(self, worst=WORST_CURVES):
        """What the run keeps of its best epoch (in the checkpoint): per class AP, support,
        threshold, precision, recall, F1, and the precision-recall curves of the ``worst``
        classes by AP."""
        measured = [c for c, ap in enumerate(self.ap) if not math.isnan(ap)]
        curves = {}
        for c in sorted(measured, key=lambda c: (self.ap[c], c))[:worst]:
            precision, recall = precision_recall_curve(self.scores[:, c], self.targets[:, c])
            curves[str(c)] = {"precision": precision, "recall": recall}
        return {"ap": self.ap, "support": self.support, "thresholds": self.thresholds.tolist(),
                "precision": self.precision, "recall": self.recall, "f1": self.f1, "curves": curves,
                "map": self.map}


def per_class_rows(report, classes):
    """per_class_metrics.csv's rows: the header, then one row per class in index order (nan
    where a figure is undefined, see MultiLabelResult)."""
    rows = [PER_CLASS_HEADER]
    for c, name in enumerate(classes):
        rows.append([name, report["ap"][c], report["support"][c], report["thresholds"][c], report["precision"][c],
                     report["recall"][c], report["f1"][c]])
    return rows


def listed_classes(report, classes):
    """The class indices a report prints: all of them up to MAX_CLASSES_LISTED, else the
    WORST_SHOWN of lowest AP (classes without positives last)."""
    if len(classes) <= MAX_CLASSES_LISTED:
        return list(range(len(classes)))
    ap = report["ap"]
    return sorted(range(len(classes)), key=lambda c: (math.isnan(ap[c]), ap[c], c))[:WORST_SHOWN]


def print_class_lines(report, classes):
    """A line per class (or, beyond MAX_CLASSES_LISTED, per class of lowest AP): AP, precision,
    recall and F1 at its threshold, positive images."""
    shown = listed_classes(report, classes)
    if len(shown) < len(classes):
        print(f"the {len(shown)} classes of lowest AP (of {len(classes)}; all of them: {PER_CLASS_FILE}):")
    else:
        print("per class: AP, precision, recall, F1 at its threshold (nan: no positives / never predicted), "
              "positive images:")
    width = max(len(classes[c]) for c in shown)
    for c in shown:
        figures = "  ".join(f"{report[key][c]:.6f}" for key in ("ap", "precision", "recall", "f1"))
        print(f"  {classes[c]:<{width}}  {figures}  threshold {report['thresholds'][c]:.4g}  "
              f"({report['support'][c]} positive)")


def print_multi_label_evaluation(result, classes):
    """What --eval-only prints for a multi-label run: the class lines, micro and macro figures,
    the images left out, then ``exact match accuracy: ...`` as the last line."""
    print_class_lines(result.report(worst=0), classes)
    print(f"mAP: {result.map:.6f}  micro-F1: {result.micro_f1:.6f} (precision {result.micro_precision:.6f}, recall "
          f"{result.micro_recall:.6f})  macro-F1: {result.macro_f1:.6f}  val_loss: {result.loss:.6f}")
    if result.left_out:
        print(f"left out: {result.left_out} validation image(s) that could not be read (see the warnings)")
    print(f"exact match accuracy: {result.accuracy:.6f} ({result.correct}/{result.total})", flush=True)


def overall_rows(result):
    """overall_metrics.csv's rows of a multi-label evaluation."""
    return [["metric", "value"], ["map", result.map], ["micro_f1", result.micro_f1],
            ["micro_precision", result.micro_precision], ["micro_recall", result.micro_recall],
            ["macro_f1", result.macro_f1], ["macro_precision", result.macro_precision],
            ["macro_recall", result.macro_recall], ["exact_match_accuracy", result.accuracy], ["loss", result.loss],
            ["images", result.total], ["left_out", result.left_out]]


def save_multi_label_report(report, classes, folder, title, writer=None, step=0, pictures=True):
    """per_class_metrics.csv and, with ``pictures``, per_class_ap.png and, where there are
    curves, pr_curves.png in ``folder`` (the pictures in TensorBoard too); returns the
    pictures' names (PLOT_FILES)."""
    os.makedirs(folder, exist_ok=True)
    write_text_atomic(csv_text(per_class_rows(report, classes)), os.path.join(folder, PER_CLASS_FILE))
    if not pictures:
        return []
    save_figure(plot_per_class_ap(classes, report["ap"], f"average precision per class, {title}"),
                os.path.join(folder, PLOT_FILES["per_class_ap"]), writer, "summary/per_class_ap", step)
    if not report["curves"]:
        return ["per_class_ap"]
    save_figure(plot_pr_curves(report["curves"], classes, report["ap"],
                               f"precision-recall of the classes of lowest AP, {title}"),
                os.path.join(folder, PLOT_FILES["pr_curves"]), writer, "summary/pr_curves", step)
    return ["per_class_ap", "pr_curves"]


def write_thresholds(output_dir, classes, thresholds, tuned, epoch):
    """thresholds.json of a multi-label run: {"classes": {name: threshold}, "tuned": whether
    --tune-thresholds chose them, "epoch": the best epoch's}, atomically."""
    write_json_atomic({"classes": {name: float(t) for name, t in zip(classes, thresholds)}, "tuned": bool(tuned),
                       "epoch": int(epoch)}, os.path.join(output_dir, THRESHOLDS_FILE))


def read_thresholds(run_dir, classes):
    """The thresholds in ``run_dir``'s thresholds.json, one per class of ``classes`` in their
    order, or None if there is no such file; a UserError if its classes differ."""
    path = os.path.join(run_dir, THRESHOLDS_FILE)
    if not os.path.isfile(path):
        return None
    values = read_json(path)
    named = values.get("classes") if isinstance(values, dict) else None
    if not isinstance(named, dict) or sorted(named) != sorted(classes):
        raise UserError(f"{path}: does not hold one threshold for each of the classes {list(classes)}; delete it "
                        "(0.5 each) or train again")
    check_fields(named, {name: NUMBER for name in classes}, path, "give numbers from 0 to 1, or delete it")
    return [float(named[name]) for name in classes]


class MultiLabel(Task):
    """Several classes an image: multi-hot targets, binary cross-entropy per class, every
    validation score ranked (mAP, F1 at per-class thresholds, exact match)."""

    name = "multi-label"
    several_labels = True
    metrics = ("map", "micro_f1", "macro_f1", "accuracy", "loss")
    headline = ("map", "mAP")
    tunes_thresholds = True
    balance_flags = "--class-weights balanced"

    def class_weights(self, labels, num_classes):
        return positive_weights(labels)

    def loss(self, class_weights=None, label_smoothing=0.0):
        return MultiLabelLoss(pos_weight=class_weights, label_smoothing=label_smoothing)

    def evaluation(self, num_classes, device):
        return ScoreTally(num_classes, device, self.thresholds)

    def cells(self, result, ema_result=None):
        cells = super().cells(result, ema_result)
        cells["val_macro_f1"] = f"{result.macro_f1:.6f}"
        cells.update(zip(("val_map", "val_micro_f1", "val_micro_precision", "val_micro_recall"),
                         (f"{v:.6f}" for v in (result.map, result.micro_f1, result.micro_precision,
                                               result.micro_recall))))
        if ema_result is not None:
            cells.update(ema_val_macro_f1=f"{ema_result.macro_f1:.6f}", ema_val_map=f"{ema_result.map:.6f}")
        return cells

    def epoch_text(self, result, ema_result=None):
        ema = f"  ema_val_map: {ema_result.map:.4f}" if ema_result is not None else ""
        left_out = f", {result.left_out} unreadable left out" if result.left_out else ""
        return (f"val_map: {result.map:.4f}  exact_match: {result.accuracy:.4f} ({result.correct}/{result.total}"
                f"{left_out})  micro_f1: {result.micro_f1:.4f}{ema}")

    def scalars(self, result):
        names = ("accuracy", "macro_f1", "map", "micro_f1", "micro_precision", "micro_recall")
        return {**{name: getattr(result, name) for name in names}, "val_loss": result.loss}

    def keep(self, result):
        """The best epoch's per-class figures, at the thresholds the run keeps (--tune-thresholds:
        each class's best-F1 threshold on this validation pass; else 0.5 each)."""
        tuned = result.with_thresholds(result.tuned_thresholds()) if self.tune_thresholds else result
        return {"confusion": None, "report": tuned.report()}

    def write_best_files(self, folder, classes, best):
        if best.report is not None:  # the thresholds of model-best.pth
            write_thresholds(folder, classes, best.report["thresholds"], self.tune_thresholds, best.epoch)

    def report_best(self, best, classes, folder, writer=None, step=0, pictures=True):
        if best.report is None:
            return []
        return save_multi_label_report(best.report, classes, folder, f"best epoch {best.epoch}", writer=writer,
                                       step=step, pictures=pictures)

    def print_best(self, best, classes, folder):
        if best.report is None:
            return
        print_class_lines(best.report, classes)
        how = "tuned for each class's best F1 on validation (--tune-thresholds)" if self.tune_thresholds else \
            "0.5 each (--tune-thresholds picks each class's)"
        print(f"thresholds: {how}; in {os.path.join(folder, THRESHOLDS_FILE)}")

    def print_evaluation(self, result, classes):
        print_multi_label_evaluation(result, classes)

    def write_evaluation(self, result, classes, folder, title):
        save_multi_label_report(result.report(), classes, folder, title)
        write_text_atomic(csv_text(overall_rows(result)), os.path.join(folder, EVALUATION_FILES[0]))

    def probabilities(self, logits):
        return torch.sigmoid(logits)

    def _thresholds(self, classes):
        return self.thresholds or [DEFAULT_THRESHOLD] * len(classes)

    def describe(self, probabilities, classes, top_k):
        """The classes at or above their thresholds, most probable first."""
        chosen = predicted_names(probabilities, self._thresholds(classes), classes)
        return ", ".join(f"{name} {p:.3f}" for name, p in chosen) or "none of the classes reaches its threshold"

    def prediction_table(self, rows, classes):
        """The header path, labels, then the classes in index order; per image its path, its
        classes at or above their thresholds (space-separated, in index order) and every
        class's probability."""
        thresholds = self._thresholds(classes)
        table = [["path", "labels", *classes]]
        for path, probabilities in rows:
            labels = " ".join(name for name, p, t in zip(classes, probabilities.tolist(), thresholds) if p >= t)
            table.append([path, labels, *(f"{float(p):.6f}" for p in probabilities)])
        return table

    def read_run_files(self, run_dir, classes):
        return type(self)(read_thresholds(run_dir, classes), self.tune_thresholds)


class ScoreTally:
    """A validation pass's rows on the device: each rank scores its shard (sigmoid
    probabilities); ``result`` gathers every image's scores and targets from every rank,
    each image once, and computes the same MultiLabelResult on every rank. Padded rows and
    images left out (targets -1) are dropped there."""

    def __init__(self, num_classes, device, thresholds=None):
        empty = torch.zeros(0, num_classes, device=device)
        self.num_classes, self.thresholds = num_classes, thresholds
        self.scores, self.targets = [empty], [empty]  # a first empty block: a rank may have no images
        self.kept = [torch.zeros(0, dtype=torch.bool, device=device)]
        self.left_out = torch.zeros(1, dtype=torch.int64, device=device)
        self.loss_sum = loss_accumulator(device)

    def add(self, logits, labels, weights):
        keep = (weights > 0) & (labels[:, 0] >= 0)  # LEFT_OUT images have every target -1
        self.left_out += ((weights > 0) & (labels[:, 0] < 0)).sum()
        logits, labels = logits.float(), labels.float().clamp(min=0)
        losses = nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="none").sum(dim=1)
        self.loss_sum += (losses * keep).sum().to(self.loss_sum.dtype)
        self.scores.append(torch.sigmoid(logits))
        self.targets.append(labels)
        self.kept.append(keep)

    def result(self):
        scores, targets, kept = torch.cat(self.scores), torch.cat(self.targets), torch.cat(self.kept)
        rows = all_gather_rows(torch.cat([scores, targets], dim=1)[kept])  # every image once, from every rank
        all_reduce_sum(self.loss_sum)
        all_reduce_sum(self.left_out)
        n = self.num_classes
        return MultiLabelResult(rows[:, :n], rows[:, n:], self.thresholds, float(self.loss_sum.cpu()),
                                int(self.left_out.cpu()))
