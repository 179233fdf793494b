"""The task seam: what differs between kinds of labels, behind one object the engine asks.

A task owns its targets (one class an image, or a row of 0/1 per class), its loss, what
evaluation counts on each rank and how the ranks combine it, its metrics and which is best,
its metrics.csv cells, epoch line and TensorBoard figures, its report (the end summary, the
--eval-only lines and files, the pictures), what predict.py prints and writes, and what an
export carries. Two are built in: ``single_label.SingleLabel`` (the default) and the one of
--multi-label; options.make_task chooses. Your own is a subclass in a file of yours, chosen
with ``--task path/to/file.py:ClassName`` (docs/layout.md, "A task of your own").

``Task`` below is the contract, with what most tasks share; a method that raises
NotImplementedError is one every task writes.
"""
import math

import torch

MAX_CLASSES_LISTED = 20  # beyond this many classes, reports list the WORST_SHOWN (and the counts' extremes)
WORST_SHOWN = 10


def ratio(hits, denominators):
    """hits / denominators per class as floats, nan where a denominator is 0."""
    hits, denominators = hits.double(), denominators.double()
    return torch.where(denominators > 0, hits / denominators.clamp(min=1), torch.full_like(hits, math.nan))


def nanmean(values):
    """Mean of the values that are not nan; 0.0 when all are."""
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else 0.0


class Task:
    """What a kind of labels needs from training, evaluation, reports, predict.py and export.py.

    ``thresholds``: per class, where a task predicts by thresholds (None: its default);
    ``tune_thresholds``: --tune-thresholds, for a task that has them."""

    name = "task"  # what args.json's "task" says
    several_labels = False  # a label is a row of one 0/1 value per class (a list file row names any number)
    metrics = ("accuracy", "loss")  # --best-metric's choices; the first is the default
    lower_is_better = ("loss",)
    headline = ("accuracy", "accuracy")  # (metric, in words): --target-accuracy and curves.png
    columns = ()  # metrics.csv columns this task adds after the common ones
    tunes_thresholds = False  # whether --tune-thresholds means something to it
    balance_flags = "--sampler balanced or --class-weights balanced"  # what helps an imbalanced training set
    recipe_defaults = {}  # {dest: value}: this task's recipe, taken whole unless one of its flags is given

    def __init__(self, thresholds=None, tune_thresholds=False):
        self.thresholds, self.tune_thresholds = thresholds, tune_thresholds

    # --- training -------------------------------------------------------------------------------
    def class_weights(self, labels, num_classes):
        """--class-weights balanced: the loss's weights from the training ``labels``."""
        raise NotImplementedError

    def loss(self, class_weights=None, label_smoothing=0.0):
        """The training loss (model.create_loss returns it unless you edit that)."""
        raise NotImplementedError

    # --- evaluation -----------------------------------------------------------------------------
    def evaluation(self, num_classes, device):
        """A tally for one validation pass: ``add(logits, labels, weights)`` per batch on every
        rank (weights: 1 an image, 0 a padded row; a label below 0: an image that could not be
        read, counted in ``left_out``), then ``result()``, the same on every rank, which
        combines all ranks exactly (each image once). A result has ``total``, ``left_out``,
        ``accuracy``, ``loss`` and ``metric(name)`` for each of ``metrics``."""
        raise NotImplementedError

    def is_better(self, metric, value, best):
        """Whether ``value`` of ``metric`` beats ``best`` (None: nothing yet)."""
        if best is None:
            return True
        return value < best if metric in self.lower_is_better else value > best

    def cells(self, result, ema_result=None):
        """metrics.csv's cells of an epoch's evaluation, as {column: text}; the common columns
        (val_accuracy, val_loss, ema_val_accuracy, ...) and ``columns``; what is left out stays empty."""
        cells = {"val_accuracy": f"{result.accuracy:.6f}", "val_loss": f"{result.loss:.6f}"}
        if ema_result is not None:
            cells.update(ema_val_accuracy=f"{ema_result.accuracy:.6f}", ema_val_loss=f"{ema_result.loss:.6f}")
        return cells

    def epoch_text(self, result, ema_result=None):
        """The validation part of the line printed after each epoch."""
        left_out = f", {result.left_out} unreadable left out" if result.left_out else ""
        ema = f"  ema_val_accuracy: {ema_result.accuracy:.4f}" if ema_result is not None else ""
        return f"val_accuracy: {result.accuracy:.4f} ({result.correct}/{result.total}{left_out}){ema}"

    def scalars(self, result):
        """The evaluation's figures for TensorBoard, {name: value}."""
        return {"accuracy": result.accuracy, "val_loss": result.loss}

    # --- the best epoch and the end of a run -----------------------------------------------------
    def keep(self, result):
        """What the run keeps of its best epoch's evaluation for the end report (in the
        checkpoint): {"confusion": tensor or None, "report": dict or None}."""
        return {"confusion": None, "report": None}

    def write_best_files(self, folder, classes, best):
        """Files that go with model-best.pth, written when it is (``best``: checkpoint.BestEpoch)."""

    def report_best(self, best, classes, folder, writer=None, step=0, pictures=True):
        """At the end of a run: the best epoch's files and pictures; returns the pictures' names."""
        return []

    def print_best(self, best, classes, folder):
        """The end summary's lines on the best epoch, after where its weights are."""

    # --- --eval-only ------------------------------------------------------------------------------
    def print_evaluation(self, result, classes):
        """What --eval-only prints of ``result``."""
        print(f"accuracy: {result.accuracy:.6f} ({result.correct}/{result.total})  loss: {result.loss:.6f}", flush=True)

    def write_evaluation(self, result, classes, folder, title):
        """What --eval-output DIR holds (overall_metrics.csv and the task's own)."""

    # --- predict.py and export.py -----------------------------------------------------------------
    def probabilities(self, logits):
        """What predict.py reports of a batch's logits: softmax over the classes."""
        return torch.softmax(logits, dim=1)

    def describe(self, probabilities, classes, top_k):
        """One image's line: the ``top_k`` classes with their probabilities."""
        top = torch.topk(probabilities, min(top_k, len(classes)))
        return ", ".join(f"{classes[int(i)]} {float(p):.3f}" for p, i in zip(top.values, top.indices))

    def prediction_table(self, rows, classes):
        """predict.py --output's rows from (path, probabilities): a header, then path,
        prediction, its probability and every class's."""
        table = [["path", "prediction", "probability", *classes]]
        for path, probabilities in rows:
            best = int(probabilities.argmax())
            table.append([path, classes[best], f"{float(probabilities[best]):.6f}",
                          *(f"{float(p):.6f}" for p in probabilities)])
        return table

    def read_run_files(self, run_dir, classes):
        """The task as the run in ``run_dir`` left it (a multi-label run: its thresholds.json)."""
        return self
