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

import numpy as np
import torch
from torch import nn

from multi_train_utils.distributed_utils import (all_reduce_sum, columns_of_every_rank, gather_objects,
                                                 get_rank, get_world_size)
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


CHUNK = 2 ** 20  # scores ranked at a time: classes x images (a few arrays of 8 MB each)
AP, SUPPORT, TP, FP, TUNED, TUNED_TP, TUNED_FP = range(7)  # the columns of a class table (see class_table)


def sort_keys(scores, positives):
    """int64 keys, one per score (rows: classes), whose ascending order is the scores' order,
    with the image's 0/1 target as the last bit: one integer sort ranks a class's scores and
    carries its targets along (torch sorts 1-D int64 by radix on CPU)."""
    bits = (scores.float() + 0.0).view(torch.int32).long()  # + 0.0 turns -0.0 into 0.0
    ordered = torch.where(bits >= 0, bits, -(2 ** 31) - 1 - bits) + 2 ** 31  # float order, 0 to 2^32 - 1
    return ordered << 1 | positives.long()


def key_scores(keys):
    """The scores that ``sort_keys`` encoded."""
    ordered = (keys >> 1) - 2 ** 31
    return torch.where(ordered >= 0, ordered, -(2 ** 31) - 1 - ordered).int().view(torch.float32)


def ranked_rows(keys):
    """Each row of ``keys`` sorted, the highest first (one row at a time on CPU, where a 1-D
    int64 sort is a radix sort; all rows at once elsewhere)."""
    if keys.device.type == "cpu":
        return torch.stack([torch.sort(row, stable=True).values for row in keys]).flip(1) if len(keys) else keys
    return torch.sort(keys, dim=1, descending=True).values


class Ranking:
    """Each class's scores from the highest (rows: classes; scores and positives classes x
    images): ``tp`` the true positives of "score >= this image's score", ``seen`` the images so
    far (TP + FP), ``last`` the last image of each group of equal scores (images of equal scores
    enter together: only there are "score >= t" counts defined), ``total`` each class's positives."""

    def __init__(self, scores, positives):
        self.keys = ranked_rows(sort_keys(scores, positives))
        self.tp = (self.keys & 1).cumsum(dim=1)
        self.seen = torch.arange(1, self.keys.shape[1] + 1, device=self.keys.device)
        self.total = self.tp[:, -1] if self.keys.shape[1] else self.tp.new_zeros(len(self.keys))
        scores = self.keys >> 1
        self.last = torch.ones_like(self.keys, dtype=torch.bool)
        self.last[:, :-1] = scores[:, 1:] != scores[:, :-1]

    def precision(self):
        return self.tp.double() / self.seen

    def average_precision(self):
        """Per class: the sum over the groups of equal scores of (its new positives / all
        positives) x precision at its end; nan without positives."""
        ends = torch.where(self.last, self.tp, 0)
        before = torch.cummax(ends, dim=1).values.roll(1, dims=1)  # TP at the end of the group before
        before[:, 0] = 0
        gained = torch.where(self.last, self.tp - before, 0)
        return (gained * self.precision()).sum(dim=1) / self.total

    def best_f1(self):
        """Per class: (threshold, TP, FP) of the cut of the highest F1 = 2 TP / (TP + FP + all
        positives); of equal F1s the highest threshold (the first)."""
        f1 = torch.where(self.last, 2 * self.tp.double() / (self.seen + self.total[:, None]), -1.0)
        best = f1.argmax(dim=1, keepdim=True)
        tp = self.tp.gather(1, best)[:, 0]
        return key_scores(self.keys.gather(1, best)[:, 0]), tp, best[:, 0] + 1 - tp

    def curve(self, points=CURVE_POINTS):
        """(precision, recall) lists of the first class over its distinct thresholds, from the
        highest, thinned to at most ``points`` (the first and last kept)."""
        ends = self.last[0]
        precision, recall = self.precision()[0][ends], self.tp[0][ends].double() / max(1, int(self.total[0]))
        keep = torch.linspace(0, len(precision) - 1, min(points, len(precision))).round().long().unique()
        return precision[keep].tolist(), recall[keep].tolist()


def class_table(scores, positives, thresholds):
    """Every figure of some classes from one ranking of their scores (scores and positives:
    images x classes, as blocks of rows; thresholds: a float32 tensor, one per class): a
    classes x 7 float64 table of AP (nan without positives), positives, TP and FP of "score >=
    threshold", the best-F1 threshold (the class's threshold without positives), its TP and FP."""
    images, classes = sum(len(block) for block in scores), len(thresholds)
    table = torch.zeros(classes, 7, dtype=torch.float64)
    step = max(1, CHUNK // max(1, images))
    for lo in range(0, classes, step):
        hi = min(classes, lo + step)
        chunk = torch.cat([block[:, lo:hi].T for block in scores], dim=1)  # classes x images
        hits = torch.cat([block[:, lo:hi].T for block in positives], dim=1).bool()
        cut = thresholds[lo:hi].to(chunk.device)[:, None]
        ranking = Ranking(chunk, hits)
        tuned, tuned_tp, tuned_fp = ranking.best_f1() if images else (cut[:, 0], ranking.total, ranking.total)
        predicted = chunk >= cut
        tp = (predicted & hits).sum(dim=1)
        fp = predicted.sum(dim=1) - tp
        unmeasured = ranking.total == 0
        columns = (ranking.average_precision() if images else torch.full_like(cut[:, 0], math.nan, dtype=torch.float64),
                   ranking.total, tp, fp, torch.where(unmeasured, cut[:, 0], tuned),
                   torch.where(unmeasured, tp, tuned_tp), torch.where(unmeasured, fp, tuned_fp))
        table[lo:hi] = torch.stack([c.double().cpu() for c in columns], dim=1)
    return table


def worst_curves(scores, positives, table, first=0, worst=WORST_CURVES):
    """The precision-recall curves of the ``worst`` classes of lowest AP in ``table`` (of those
    with positives), as {str(first + class): {"precision": [...], "recall": [...]}}."""
    measured = [c for c, ap in enumerate(table[:, AP].tolist()) if not math.isnan(ap)]
    curves = {}
    for c in sorted(measured, key=lambda c: (float(table[c, AP]), c))[:worst]:
        ranking = Ranking(torch.cat([block[:, c] for block in scores])[None],
                          torch.cat([block[:, c] for block in positives])[None].bool())
        precision, recall = ranking.curve()
        curves[str(first + c)] = {"precision": precision, "recall": recall}
    return curves


def average_precision(scores, positives):
    """AP of one class (``scores``: 1-D, ``positives``: 1-D bool), as scikit-learn's; nan
    without positives."""
    return float(class_table([scores[:, None]], [positives[:, None]], torch.zeros(1))[0, AP])


def best_f1_threshold(scores, positives, default=DEFAULT_THRESHOLD):
    """The threshold t (one of the class's scores) whose "score >= t" has the highest F1 for
    the class; of equal F1s the highest t. ``default`` for a class without positives."""
    return float(class_table([scores[:, None]], [positives[:, None]], torch.tensor([default]))[0, TUNED])


def class_bounds(num_classes, world_size):
    """Where each rank's share of the classes begins and ends: rank r ranks classes
    bounds[r] to bounds[r + 1] - 1."""
    return [num_classes * r // world_size for r in range(world_size + 1)]


class MultiLabelResult:
    """A multi-label validation pass, as every figure of it: per class (``table``, see
    class_table) AP, positives, TP and FP at the ``thresholds`` in use and at the tuned ones;
    the curves of the classes of lowest AP; the images whose classes are all right
    (``correct``) of ``total``; the summed BCE and the images left out. The same at any world
    size. ``from_scores`` computes one in one process.

    Precision, recall and F1 per class are those of "probability >= threshold": precision nan
    for a class never predicted, recall nan for a class without positives, F1 = 2 TP / (2 TP +
    FP + FN), nan with neither; macro means leave nan out, micro ones pool the counts."""

    top5_accuracy = None  # no top-5 with several labels
    balanced_accuracy = None
    confusion = None

    def __init__(self, table, thresholds, curves, *, correct, total, loss_sum=math.nan, left_out=0):
        self.table, self.curves = table, curves
        self.thresholds = torch.as_tensor(thresholds, dtype=torch.float32)
        self.correct, self.total, self.loss_sum, self.left_out = correct, total, loss_sum, left_out
        self.ap = table[:, AP].tolist()
        self.support = table[:, SUPPORT].long().tolist()
        self.counts = self._counts(TP, FP)

    @classmethod
    def from_scores(cls, scores, targets, thresholds=None, loss_sum=math.nan, left_out=0):
        """The result of every image's probabilities (``scores``, N x C) and 0/1 ``targets``."""
        scores, targets = scores.float().cpu(), targets.cpu() > 0.5
        thresholds = torch.tensor(default_thresholds(scores.shape[1], thresholds))
        table = class_table([scores], [targets], thresholds)
        correct = int(((scores >= thresholds) == targets).all(dim=1).sum())
        return cls(table, thresholds, worst_curves([scores], [targets], table), correct=correct, total=len(scores),
                   loss_sum=loss_sum, left_out=left_out)

    def _counts(self, tp, fp):
        tp, fp = self.table[:, tp].long(), self.table[:, fp].long()
        return tp, fp, self.table[:, SUPPORT].long() - tp

    @property
    def num_classes(self):
        return len(self.table)

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
        """Per class, the threshold of the highest F1 on these images (its threshold in use
        where it has no positives)."""
        return self.table[:, TUNED].float().tolist()

    def tuned(self):
        """The per-class figures at the tuned thresholds (exact match is not counted again:
        ``correct`` stays that of the thresholds in use)."""
        tuned = MultiLabelResult(self.table, self.tuned_thresholds(), self.curves, correct=self.correct,
                                 total=self.total, loss_sum=self.loss_sum, left_out=self.left_out)
        tuned.counts = self._counts(TUNED_TP, TUNED_FP)
        return tuned

    def report(self, worst=WORST_CURVES):
        """What the run keeps of its best epoch (in the checkpoint): per class AP, support,
        threshold, precision, recall, F1, and the precision-recall curves of the ``worst``
        classes by AP (at most WORST_CURVES)."""
        shown = sorted(self.curves, key=lambda c: (self.ap[int(c)], int(c)))[:worst]
        return {"ap": self.ap, "support": self.support, "thresholds": self.thresholds.tolist(),
                "precision": self.precision, "recall": self.recall, "f1": self.f1,
                "curves": {c: self.curves[c] for c in sorted(shown, key=int)}, "map": self.map}


def default_thresholds(num_classes, thresholds=None):
    """``thresholds`` as a list, or DEFAULT_THRESHOLD for each class."""
    return [DEFAULT_THRESHOLD] * num_classes if thresholds is None else [float(t) for t in thresholds]


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

    recipe_defaults = {"opt": "adamw", "lr": 0.001}  # see docs/recipe.md: SGD's step shrinks with the classes

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
        tuned = result.tuned() if self.tune_thresholds else result
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
    """A validation pass's rows on the device: each rank keeps its shard's probabilities and
    targets (as bytes), and counts its images whose classes are all right. ``result`` gives
    each rank its share of the classes with every rank's images (one all-to-all), ranks them
    once for every per-class figure, and gathers the figures (a few per class): the same
    MultiLabelResult on every rank. Padded rows and images left out (targets -1) are dropped."""

    def __init__(self, num_classes, device, thresholds=None):
        self.num_classes, self.thresholds = num_classes, torch.tensor(default_thresholds(num_classes, thresholds))
        self.device_thresholds = self.thresholds.to(device)
        empty = torch.zeros(0, num_classes, device=device)
        self.scores, self.targets = [empty], [empty.byte()]  # a first empty block: a rank may have no images
        self.kept = [torch.zeros(0, dtype=torch.bool, device=device)]
        self.counted = torch.zeros(3, dtype=torch.int64, device=device)  # images, all classes right, left out
        self.loss_sum = loss_accumulator(device)

    def add(self, logits, labels, weights):
        keep = (weights > 0) & (labels[:, 0] >= 0)  # LEFT_OUT images have every target -1
        logits, targets = logits.float(), labels > 0.5
        losses = nn.functional.binary_cross_entropy_with_logits(logits, targets.float(), reduction="none").sum(dim=1)
        self.loss_sum += (losses * keep).sum().to(self.loss_sum.dtype)
        scores = torch.sigmoid(logits)
        right = ((scores >= self.device_thresholds) == targets).all(dim=1)
        self.counted += torch.stack([keep.sum(), (keep & right).sum(), ((weights > 0) & (labels[:, 0] < 0)).sum()])
        self.scores.append(scores)
        self.targets.append(targets.byte())
        self.kept.append(keep)

    def result(self):
        all_reduce_sum(self.loss_sum)
        total, correct, left_out = all_reduce_sum(self.counted).tolist()
        scores, targets = self._rows_kept(self.scores), self._rows_kept(self.targets)
        bounds, rank = class_bounds(self.num_classes, get_world_size()), get_rank()
        scores, targets = columns_of_every_rank(scores, bounds), columns_of_every_rank(targets, bounds)
        table = class_table(scores, targets, self.thresholds[bounds[rank]:bounds[rank + 1]])
        shares = gather_objects((table, worst_curves(scores, targets, table, first=bounds[rank])))
        curves = {c: curve for _, share in shares for c, curve in share.items()}
        return MultiLabelResult(torch.cat([table for table, _ in shares]), self.thresholds, curves, correct=correct,
                                total=total, loss_sum=float(self.loss_sum.cpu()), left_out=left_out)

    def _rows_kept(self, blocks):
        """``blocks`` without padded rows and images left out, each block's memory freed as
        its copy is made."""
        kept = []
        while blocks:
            kept.append(blocks.pop(0)[self.kept[len(kept)]])
        return kept
