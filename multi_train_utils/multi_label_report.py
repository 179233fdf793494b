"""What a multi-label run reports: per-class lines, per_class_metrics.csv and its pictures.

A report is ``MultiLabelResult.report()``'s dict (per class AP, support, threshold, precision,
recall, F1, and the precision-recall curves of the worst classes), kept for the best epoch."""
import math
import os

from multi_train_utils.files import csv_text, write_text_atomic
from multi_train_utils.pictures import PLOT_FILES, plot_per_class_ap, plot_pr_curves, save_figure

MAX_CLASSES_LISTED = 20  # beyond this many classes, the WORST_SHOWN of lowest AP are listed
WORST_SHOWN = 10
PER_CLASS_FILE = "per_class_metrics.csv"
PER_CLASS_HEADER = ["class", "ap", "support", "threshold", "precision", "recall", "f1"]


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
