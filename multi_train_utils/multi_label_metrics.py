"""Multi-label evaluation from every validation score: AP, mAP, F1 at thresholds, tuned thresholds.

Average precision is scikit-learn's ``average_precision_score``: over the distinct scores t
of a class, from the highest, AP = sum of (R(t) - R(previous t)) x P(t), where P and R are
the precision and recall of "score >= t" (steps, no interpolation); images of equal scores
enter together. A class without positive validation images has AP nan and is left out of mAP.
"""
import math
from functools import cached_property

import torch

from multi_train_utils.multi_label import DEFAULT_THRESHOLD

CURVE_POINTS = 256  # points kept of each precision-recall curve drawn at the end
WORST_CURVES = 6  # classes of lowest AP whose precision-recall curves are drawn


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


def ratio(hits, denominators):
    """hits / denominators per class as floats, nan where a denominator is 0."""
    hits, denominators = hits.double(), denominators.double()
    return torch.where(denominators > 0, hits / denominators.clamp(min=1), torch.full_like(hits, math.nan))


def nanmean(values):
    """Mean of the values that are not nan; 0.0 when all are."""
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else 0.0


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
