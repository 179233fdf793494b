"""Multi-label classification: an image may carry several classes (or none).

Targets are multi-hot rows (one 0/1 entry per class), the model gives one logit per class, and
the loss is binary cross-entropy with logits (``MultiLabelLoss``). Evaluation ranks every
validation score (``multi_label_metrics``), so it needs them all, gathered from every rank.
"""
import numpy as np
import torch
from torch import nn

# --class-weights balanced: each class's positive weight is its negatives / positives, at most
# this (a class in 1 of 10,000 images would otherwise weigh its positives 9,999 times).
POS_WEIGHT_CAP = 100.0
DEFAULT_THRESHOLD = 0.5  # a class is predicted when its probability is at least its threshold


def is_multi_hot(targets):
    """Whether ``targets`` (a dataset's, or a batch's labels) are rows of one entry per class."""
    return getattr(targets, "ndim", 1) == 2


def positives_per_class(targets):
    """Images of each class (the column sums of the multi-hot ``targets``), as a list of ints."""
    return np.asarray(targets).astype(np.int64).sum(axis=0).tolist()


def labels_per_image(targets):
    """How many classes each image carries, as an int64 array."""
    return np.asarray(targets).astype(np.int64).sum(axis=1)


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
