"""Pictures of a run, as PNG files and in TensorBoard, and the command that redraws its curves.

The class distribution, a batch preview, the training curves and the confusion matrix.

    python -m multi_train_utils.pictures RUN_DIR     # curves.png from RUN_DIR/metrics.csv

matplotlib Figures are drawn straight into PNG files by its Agg renderer: never a window,
no display needed, and pyplot's global state is left alone.
"""
import argparse
import io
import os

import torch

from multi_train_utils.errors import UserError, printable, run_cli
from multi_train_utils.files import csv_text, write_bytes_atomic, write_text_atomic
from multi_train_utils.run_files import read_metrics


PLOT_FILES = {"class_distribution": "class_distribution.png", "batch_preview": "batch_preview.png",
              "curves": "curves.png", "confusion_matrix": "confusion_matrix.png", "most_confused": "most_confused.png",
              "per_class_ap": "per_class_ap.png", "pr_curves": "pr_curves.png"}
MAX_INCHES = 20  # figures grow with the number of classes up to this size
MAX_LABELLED_CLASSES = 50  # beyond this, class names are left off the axes
MAX_BARS = 30  # beyond this many classes, the class distribution is a sorted curve, and no count is written in a cell
MOST_CONFUSED = 20  # pairs of classes in most_confused.png


def _figure(width, height):
    """A Figure laid out by matplotlib's constrained layout: the margins grow to fit the tick
    labels (long class names included), so no label overlaps the plot or is cut off the
    picture, also in TensorBoard, which draws the whole figure without trimming it."""
    from matplotlib.figure import Figure

    return Figure(figsize=(min(width, MAX_INCHES), min(height, MAX_INCHES)), layout="constrained")


def save_figure(fig, path, writer=None, tag=None, step=0):
    """Write ``fig`` as a PNG (atomically), and log it to TensorBoard if given a writer."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    write_bytes_atomic(buffer.getvalue(), path)
    if writer is not None:
        writer.add_figure(tag, fig, step, close=False)
    return path


def drawable(names):
    """Names matplotlib can draw: bytes of a name that are not UTF-8 shown as escapes."""
    return [printable(name) for name in names]


def _class_ticks(axis, classes, rotate=False):
    """Class names as the tick labels of ``axis`` (ax.xaxis or ax.yaxis), unless there are too many.
    On the x axis, rotated names end at their tick; on the y axis names end left of the plot."""
    if len(classes) > MAX_LABELLED_CLASSES:
        return
    axis.set_ticks(range(len(classes)))
    if axis.axis_name == "y":
        axis.set_ticklabels(classes)  # right-aligned at the tick, left of the axes (matplotlib's default)
    else:
        axis.set_ticklabels(classes, rotation=45 if rotate else 0, ha="right" if rotate else "center",
                            rotation_mode="anchor" if rotate else "default")


def plot_class_distribution(classes, train, val):
    """Bar chart of the images per class (``train``, ``val``: counts in class order); beyond
    MAX_BARS classes, the counts sorted from the largest class to the smallest, as curves."""
    classes = drawable(classes)
    if len(classes) > MAX_BARS:
        return _plot_sorted_counts(classes, train, val)
    fig = _figure(max(6, 0.8 * len(classes)), 4)
    ax = fig.subplots()
    x = range(len(classes))
    for offset, counts, name in ((-0.2, train, "train"), (0.2, val, "val")):
        bars = ax.bar([i + offset for i in x], counts, width=0.4, label=f"{name} ({sum(counts)})")
        if len(classes) <= MAX_LABELLED_CLASSES:
            ax.bar_label(bars, fontsize=8)
    _class_ticks(ax.xaxis, classes, rotate=len(classes) > 6 or max(map(len, classes)) > 10)
    ax.set_ylabel("images")
    ax.set_title("images per class")
    ax.legend()
    return fig


def _plot_sorted_counts(classes, train, val):
    """Images per class, classes sorted by their training images: one curve per split, the
    largest and the smallest class named."""
    order = sorted(range(len(classes)), key=lambda c: (-train[c], c))
    fig = _figure(10, 4)
    ax = fig.subplots()
    ranks = range(1, len(classes) + 1)
    for counts, name in ((train, "train"), (val, "val")):
        ax.plot(ranks, [counts[c] for c in order], label=f"{name} ({sum(counts)})")
    for rank, c in ((1, order[0]), (len(order), order[-1])):
        ax.annotate(f"{classes[c]} ({train[c]})", (rank, train[c]), textcoords="offset points", xytext=(0, 6),
                    ha="left" if rank == 1 else "right", fontsize=8)
    ax.set_xlabel(f"class, from the largest to the smallest ({len(classes)} classes)")
    ax.set_ylabel("images")
    ax.set_ylim(bottom=0)
    ax.set_title("images per class, sorted")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def plot_label_distribution(classes, train, val, labels_per_image):
    """Multi-label data: images per class (``train``, ``val``: images carrying each class) and,
    beside it, how many images carry 0, 1, 2, ... labels (``labels_per_image``: training)."""
    classes = drawable(classes)
    fig = _figure(max(10, 0.8 * len(classes) + 4), 4)
    counts_ax, labels_ax = fig.subplots(1, 2, width_ratios=[3, 1])
    order = sorted(range(len(classes)), key=lambda c: (-train[c], c))
    x = range(len(classes))
    for offset, counts, name in ((-0.2, train, "train"), (0.2, val, "val")):
        counts_ax.bar([i + offset for i in x], [counts[c] for c in order], width=0.4, label=name)
    _class_ticks(counts_ax.xaxis, [classes[c] for c in order], rotate=True)
    counts_ax.set_ylabel("images with the class")
    counts_ax.set_title("images per class, sorted")
    counts_ax.legend()
    histogram = torch.bincount(torch.as_tensor(labels_per_image, dtype=torch.int64)).tolist()
    labels_ax.bar(range(len(histogram)), histogram)
    labels_ax.set_xlabel("labels of an image")
    labels_ax.set_ylabel("training images")
    labels_ax.set_title(f"labels per image (mean {sum(i * n for i, n in enumerate(histogram)) / max(1, sum(histogram)):.2f})")
    return fig


def plot_per_class_ap(classes, ap, title="average precision per class"):
    """Horizontal bars of each class's AP (classes without positives left out), the lowest at
    the top; beyond MAX_LABELLED_CLASSES a sorted curve."""
    measured = sorted((value, name) for name, value in zip(drawable(classes), ap) if value == value)
    fig = _figure(8, max(3, 0.25 * min(len(measured), MAX_LABELLED_CLASSES) + 1.5))
    ax = fig.subplots()
    if len(measured) > MAX_LABELLED_CLASSES:
        ax.plot(range(1, len(measured) + 1), [value for value, _ in measured])
        ax.set_xlabel(f"class, from the lowest AP to the highest ({len(measured)} classes)")
        ax.set_ylabel("AP")
    else:
        ax.barh(range(len(measured)), [value for value, _ in measured])
        ax.set_yticks(range(len(measured)), [name for _, name in measured], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("AP")
        ax.set_xlim(0, 1)
    mean = sum(value for value, _ in measured) / max(1, len(measured))
    ax.set_title(printable(f"{title} (mAP {mean:.4f})"))
    return fig


def plot_pr_curves(curves, classes, ap, title="precision-recall, the classes of lowest AP"):
    """Precision against recall of the classes in ``curves`` ({class index: {"precision",
    "recall"}}), each labelled with its AP."""
    names = drawable(classes)
    fig = _figure(6, 5)
    ax = fig.subplots()
    for key, curve in curves.items():
        c = int(key)
        ax.step(curve["recall"], curve["precision"], where="post", label=f"{names[c]} (AP {ap[c]:.3f})")
    ax.set_xlabel("recall")
    ax.set_ylabel("precision")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    if curves:
        ax.legend(fontsize=8)
    ax.set_title(printable(title))
    return fig


def label_title(label, classes, longest=24):
    """A batch preview title: the class of a label, or the classes of a multi-hot row (or none)."""
    if torch.is_tensor(label) and label.ndim == 1:
        names = [classes[c] for c in torch.nonzero(label > 0.5).flatten().tolist()]
        text = " ".join(names) or "(none)"
        return text if len(text) <= longest else text[:longest - 3] + "..."
    return classes[int(label)]


def displayable(image):
    """A CHW image as matplotlib draws it: the first three channels as RGB (4-band data: its
    fourth not shown), or the first as gray (1 or 2 channels), in [0, 1]; uint8 over 255, and
    floats outside [0, 1] (data used as it comes) stretched from their lowest to their highest."""
    image = image.detach().cpu().float() / (255.0 if image.dtype == torch.uint8 else 1.0)
    image = image[:3] if image.shape[0] >= 3 else image[:1]
    low, high = float(image.min()), float(image.max())
    if low < 0 or high > 1:
        image = (image - low) / max(high - low, 1e-12)
    return image.permute(1, 2, 0).numpy() if image.shape[0] == 3 else image[0].numpy()


def plot_batch_preview(images, labels, classes):
    """A grid of augmented training images (uint8, or float, as the loader gives them; any
    channels, see ``displayable``) with class names."""
    classes = drawable(classes)
    n = len(images)
    cols = min(8, n)
    rows = (n + cols - 1) // cols
    fig = _figure(1.6 * cols, 1.8 * rows)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, image, label in zip(axes.flat, images, labels):
        ax.imshow(displayable(image), cmap="gray", vmin=0, vmax=1)  # the colour map for gray images only
        ax.set_title(label_title(label, classes), fontsize=8)
    fig.suptitle("a training batch after augmentation")
    return fig


def plot_training_curves(rows, headline=None):
    """Loss, the validation ``headline`` (metric, in words: the task's; by default mAP where
    every row has one, else accuracy; and the EMA's, where metrics.csv has it) and learning
    rate per epoch, from metrics.csv's rows."""
    from matplotlib.ticker import MaxNLocator

    epochs = [int(r["epoch"]) for r in rows]
    if headline is None:
        headline = ("map", "mAP") if rows and all(r.get("val_map") for r in rows) else ("accuracy", "accuracy")
    metric, ema_metric = f"val_{headline[0]}", f"ema_val_{headline[0]}"
    fig = _figure(12, 3.4)
    for ax, key, title in zip(fig.subplots(1, 3), ("train_loss", metric, "lr"),
                              ("training loss", f"validation {headline[1]}", "learning rate")):
        ax.plot(epochs, [float(r[key]) for r in rows], marker="o", markersize=3)
        if key == metric and rows and all(r.get(ema_metric) for r in rows):
            ax.plot(epochs, [float(r[ema_metric]) for r in rows], marker="o", markersize=3)
            ax.legend(["model", "EMA"])
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    return fig


def plot_confusion_matrix(confusion, classes, title="confusion matrix"):
    """Counts of true class (rows) against predicted class (columns); confusion_matrix.csv
    holds the exact numbers when there are too many classes to write them in."""
    classes = drawable(classes)
    size = max(4, 0.6 * len(classes) + 2)
    fig = _figure(size, size)
    ax = fig.subplots()
    ax.imshow(confusion.numpy(), cmap="Blues")
    _class_ticks(ax.xaxis, classes, rotate=True)
    _class_ticks(ax.yaxis, classes)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    peak = int(confusion.max()) if confusion.numel() else 0
    if len(classes) <= MAX_BARS:
        for i in range(len(classes)):
            for j in range(len(classes)):
                value = int(confusion[i, j])
                ax.text(j, i, value, ha="center", va="center", fontsize=8,
                        color="white" if value > peak / 2 else "black")
    accuracy = confusion.diag().sum() / max(1, int(confusion.sum()))
    ax.set_title(printable(f"{title} (accuracy {accuracy:.4f})"))
    return fig


def most_confused_pairs(confusion, count=MOST_CONFUSED):
    """The ``count`` largest off-diagonal cells as (true class, predicted class, images), largest
    first (ties: in row, then column order); cells of 0 are left out."""
    off = confusion.clone().long()
    off.fill_diagonal_(0)
    counts, cells = torch.sort(off.flatten(), descending=True, stable=True)  # stable: ties in cell order
    n = confusion.shape[0]
    return [(cell // n, cell % n, value) for value, cell in zip(counts[:count].tolist(), cells[:count].tolist())
            if value > 0]


def plot_most_confused(confusion, classes, title="most confused"):
    """Horizontal bars of the most-confused pairs of classes (``true -> predicted``), largest on top."""
    classes = drawable(classes)
    pairs = most_confused_pairs(confusion)
    fig = _figure(8, max(2.5, 0.3 * len(pairs) + 1))
    ax = fig.subplots()
    ax.barh(range(len(pairs)), [count for _, _, count in pairs])
    ax.set_yticks(range(len(pairs)), [f"{classes[t]} -> {classes[p]}" for t, p, _ in pairs], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("validation images (true -> predicted)")
    ax.set_title(printable(f"{title}: the {len(pairs)} most-confused pairs of classes"))
    return fig


def confusion_matrix_csv(confusion, classes):
    """The confusion matrix as CSV text: a header of predicted classes, a row per true class
    (class names quoted and neutralised by ``files.csv_text``, whatever they hold)."""
    rows = [["true/predicted", *classes]]
    rows += [[name, *(int(v) for v in confusion[i])] for i, name in enumerate(classes)]
    return csv_text(rows)


def save_confusion_matrix(confusion, classes, folder, title, writer=None, step=0):
    """confusion_matrix.png, confusion_matrix.csv and, where the model confused any classes,
    most_confused.png in ``folder`` (and the pictures in TensorBoard); the names drawn, as in PLOT_FILES."""
    os.makedirs(folder, exist_ok=True)
    save_figure(plot_confusion_matrix(confusion, classes, title), os.path.join(folder, PLOT_FILES["confusion_matrix"]),
                writer, "summary/confusion_matrix", step)
    write_text_atomic(confusion_matrix_csv(confusion, classes), os.path.join(folder, "confusion_matrix.csv"))
    if not most_confused_pairs(confusion, 1):
        return ["confusion_matrix"]
    save_figure(plot_most_confused(confusion, classes, title), os.path.join(folder, PLOT_FILES["most_confused"]),
                writer, "summary/most_confused", step)
    return ["confusion_matrix", "most_confused"]


def main(argv=None):
    """``python -m multi_train_utils.pictures RUN_DIR``: draw curves.png of a finished (or running) run."""
    parser = argparse.ArgumentParser(prog="python -m multi_train_utils.pictures", description="Draw curves.png (loss, accuracy, lr per epoch) of a run from its "
                                     "metrics.csv, finished or not.")
    parser.add_argument("run_dir", help="the run's --output-dir (default weights)", nargs="?", default="weights")
    args = parser.parse_args(argv)
    rows = read_metrics(args.run_dir)
    if not rows:
        raise UserError(f"{args.run_dir}/metrics.csv has no epochs yet")
    path = save_figure(plot_training_curves(rows), os.path.join(args.run_dir, PLOT_FILES["curves"]))
    print(f"wrote {path} ({len(rows)} epochs)")


if __name__ == "__main__":
    run_cli(main)
