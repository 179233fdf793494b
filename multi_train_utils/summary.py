"""What rank 0 prints: the start of a run (one screen), its end, and an evaluation's report."""
import os

import torch
import torch.distributed as dist

from multi_train_utils.balance import imbalance_warning, label_counts, training_labels
from multi_train_utils.distributed_utils import current_job
from multi_train_utils.example_data import DEMO_MARKER
from multi_train_utils.errors import printable
from multi_train_utils.files import csv_text, folder_bytes, format_bytes, write_text_atomic
from multi_train_utils.images import JPEG_DECODER
from multi_train_utils.model_setup import count_parameters
from multi_train_utils.multi_label import is_multi_hot, labels_per_image, positives_per_class
from multi_train_utils.multi_label_report import (MAX_CLASSES_LISTED, WORST_SHOWN, overall_rows, print_class_lines,
                                                  print_multi_label_evaluation, save_multi_label_report)
from multi_train_utils.pictures import PLOT_FILES, most_confused_pairs, save_confusion_matrix
from multi_train_utils.process import get_world_size, is_dist_avail_and_initialized, is_main_process
from multi_train_utils.run_files import METRICS_HEADER

RULE = "-" * 78
# What --eval-output writes besides the confusion matrix, in evaluation_metrics_csv's order.
EVALUATION_FILES = ("overall_metrics.csv", "per_class_metrics.csv")
# Beyond MAX_CLASSES_LISTED classes the summary and the evaluation report name only the extremes:
# WORST_SHOWN classes of lowest recall (multi-label: AP), and most-confused pairs.


def describe_device(device):
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        return f"cpu ({plural(torch.get_num_threads(), 'thread')})"
    return str(device)


def plural(count, word, many=None):
    """"1 worker", "2 workers" ("1 process", "2 processes" with ``many``)."""
    return f"{count} {word if count == 1 else many or word + 's'}"


def print_start_summary(args, data, state, settings, device, workers=0, log_dir="-", resumed=()):
    """Devices, data, model (``state.model``), batch, the learning-rate schedule (as the run
    was started, also when it resumes), where everything goes, then the ``resumed`` lines (where
    a resumed run goes on); rank 0 prints it."""
    if not is_main_process():
        return
    world_size, job = get_world_size(), current_job()
    launcher = "single process" if job is None else job.launcher
    backend = dist.get_backend() if is_dist_avail_and_initialized() else "-"
    group = state.optimizer.param_groups[0]
    model, lr = state.model, group.get("initial_lr", group["lr"])  # the schedule's start, not where it stands
    print(RULE)
    if world_size > 1 and device.type == "cuda":
        where = f"one GPU per process ({torch.cuda.get_device_name(device)})"
    else:
        where = describe_device(device) + (" per process" if world_size > 1 else "")
    print(f"world size: {world_size} ({launcher}, backend {backend}), device: {where}")
    print(f"amp: {settings.precision.describe()}, channels_last: {'on' if settings.channels_last else 'off'}"
          + (", compiled" if args.compile else "") + (", grad-checkpoint" if args.grad_checkpoint else ""))
    print_data_summary(args, data)
    trainable = count_parameters(model, trainable_only=True)
    total = count_parameters(model)
    print(f"model: {args.model} ({total:,} parameters"
          + (f", {trainable:,} trainable" if trainable != total else "") + ")")
    print(f"batch: {args.batch_size} per process x {plural(args.accum_steps, 'accumulation step')} x "
          f"{plural(world_size, 'process', 'processes')} = "
          f"{args.batch_size * args.accum_steps * world_size} per optimizer step; {plural(workers, 'loader worker')} "
          f"per process; {describe_decoders(data)}")
    scaled = f" ({args.lr:g} x {world_size} processes)" if lr != args.lr else ""
    warmup = f"{args.warmup_epochs} warm-up epochs, then " if args.warmup_epochs else ""
    schedule = (f"x {args.lr_gamma:g} every {args.lr_step_size} epochs" if args.lr_scheduler == "step" else
                f"cosine to {lr * args.lrf:g} at epoch {args.epochs - 1}")
    print(f"lr: {lr:g}{scaled}; {warmup}{schedule}")
    print("recipe: " + describe_recipe(args))
    print(f"outputs: {args.output_dir} (train.log, metrics.csv, model-best.pth, checkpoint.pth, plots)")
    print(f"TensorBoard: {log_dir}; view with: tensorboard --logdir {args.log_dir}")
    for line in resumed:
        print(line)
    print(RULE, flush=True)


SAMPLED_FILES = 10_000  # the image files whose names describe_decoders reads (evenly spread)


def describe_decoders(data):
    """Which decoder reads the formats present among the training files (their endings, from
    up to SAMPLED_FILES of them): JPEGs TorchCodec where installed (RGB data), the rest PIL."""
    paths = getattr(data.train, "images_path", None)
    if paths is None:
        return "images read by your dataset"
    if getattr(data.train, "channels", 3) != 3:  # gray and RGBA files are read through PIL's modes
        return "images decoded by PIL"
    step = max(1, len(paths) // SAMPLED_FILES)
    endings = {os.path.splitext(paths[i])[1].lower() for i in range(0, len(paths), step)}
    jpeg = bool(endings & {".jpg", ".jpeg"})
    others = sorted(e.lstrip(".").upper() for e in endings - {".jpg", ".jpeg"})
    parts = ([f"JPEG decoded by {JPEG_DECODER}"] if jpeg else []) + ([f"{', '.join(others)} by PIL"] if others else [])
    return "; ".join(parts) or "images decoded by PIL"


def describe_recipe(args):
    """One line: optimizer, augmentation, loss, sampling, EMA, best metric and patience."""
    decay = "" if args.norm_bias_decay else ", none on norm and bias"
    parts = [f"{args.opt} (weight decay {args.weight_decay:g}{decay})"]
    augment = ["crop+flip"] + ([args.auto_augment] if args.auto_augment != "none" else [])
    augment += [f"erase {args.random_erase:g}"] if args.random_erase else []
    augment += [f"mixup {args.mixup_alpha:g}"] if args.mixup_alpha else []
    augment += [f"cutmix {args.cutmix_alpha:g}"] if args.cutmix_alpha else []
    parts.append("augment " + " + ".join(augment))
    if args.label_smoothing:
        parts.append(f"label smoothing {args.label_smoothing:g}")
    if args.class_weights != "none":
        parts.append(f"{args.class_weights} class weights")
    parts.append(f"{args.sampler} sampler")
    if args.model_ema:
        parts.append(f"EMA (decay {args.model_ema_decay:g})")
    parts.append(f"best by val {args.best_metric}" + (f", patience {args.patience}" if args.patience else ""))
    return "; ".join(parts)


def format_duration(seconds):
    minutes, seconds = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


def time_to_target(args, rows, best_epoch):
    """The end summary's line on the run's clock (metrics.csv's run_seconds): the time to the
    best epoch and, with --target-accuracy, when val accuracy (multi-label: mAP), of the model
    or its EMA, first reached it."""
    rows = [dict(zip(METRICS_HEADER, row)) for row in rows]
    seconds = {int(r["epoch"]): float(r["run_seconds"]) for r in rows if r.get("run_seconds") not in (None, "")}
    parts = []
    if best_epoch in seconds:
        parts.append(f"the best epoch ({best_epoch}) after {format_duration(seconds[best_epoch])} of training")
    target = args.target_accuracy
    if target is not None:
        name = "map" if args.multi_label else "accuracy"
        reached = [int(r["epoch"]) for r in rows
                   if max(float(r[f"val_{name}"] or "nan"), float(r[f"ema_val_{name}"] or "nan")) >= target]
        label = "mAP" if args.multi_label else "accuracy"
        if reached and reached[0] in seconds:
            parts.append(f"val {label} {target:g} first reached at epoch {reached[0]}, after "
                         f"{format_duration(seconds[reached[0]])}")
        else:
            parts.append(f"val {label} never reached --target-accuracy {target:g}")
    return "run clock: " + "; ".join(parts) if parts else None


def print_end_summary(args, state, seconds, plots=(), classes=(), rows=()):
    """Best --best-metric and its epoch (``state.best``), whose weights model-best.pth holds
    (the model's or its EMA's), why the run stopped early if it did, the time taken (``seconds``),
    the run's clock (``time_to_target`` of metrics.csv's ``rows``), and where the weights and
    ``plots`` are; a multi-label run's per-class figures of the best epoch (of ``classes``) and
    its thresholds."""
    output_dir, epoch = args.output_dir, state.best.epoch
    best = os.path.join(output_dir, "model-best.pth")
    print(RULE)
    if state.stop_reason:
        print(state.stop_reason)
    print(f"best val {args.best_metric.replace('_', ' ')}: {state.best.value:.4f} at epoch {epoch}; this session took "
          f"{format_duration(seconds)}")
    clock = time_to_target(args, rows, epoch)
    if clock:
        print(clock)
    source = "the EMA of the weights (--model-ema)" if state.best.source == "ema" else "the model's weights"
    print(f"best weights: {best} ({source}, epoch {epoch})")
    report = state.best.report
    if report is not None:  # multi-label: the best epoch's classes, and its thresholds
        print_class_lines(report, classes)
        tuned = "tuned for each class's best F1 on validation (--tune-thresholds)" if args.tune_thresholds else \
            "0.5 each (--tune-thresholds picks each class's)"
        print(f"thresholds: {tuned}; in {os.path.join(output_dir, 'thresholds.json')}")
    if plots:
        print("plots: " + ", ".join(os.path.join(output_dir, PLOT_FILES[p]) for p in plots))
    print(f"predict: python predict.py --weights {best} --image PATH")
    size, files = folder_bytes(output_dir)
    epoch_file = os.path.join(output_dir, f"model-{epoch}.pth")
    shared = os.path.isfile(epoch_file) and os.path.isfile(best) and os.path.samefile(best, epoch_file)
    print(f"disk: {output_dir} holds {format_bytes(size)} in {plural(files, 'file')}"
          + (f" (model-best.pth is model-{epoch}.pth, one file under two names)" if shared else ""))
    print(RULE, flush=True)


def print_data_summary(args, data):
    """Rank 0's description of the data: images per class and split sizes, skipped files."""
    if not args.demo and not args.train_list and os.path.exists(os.path.join(args.data_path, DEMO_MARKER)):
        print(f"note: {args.data_path} holds generated demo images (written by --demo), not real photos")
    reasons = getattr(data, "skip_reasons", None) or {}
    for path in data.skipped:
        print(f"warning: skipping {path}: {reasons.get(path, 'not a readable image')}", flush=True)
    for note in getattr(data, "notes", ()):
        print(f"warning: {note}", flush=True)
    if args.train_list:
        where = args.train_list + (f" + {args.val_list} (validation)" if args.val_list else "")
    else:
        where = f"{args.data_path}" + (f" + {args.val_path} (validation)" if args.val_path else "")
    train, val = class_counts(data.train, data.classes), class_counts(data.val, data.classes)
    labels = training_labels(data.train)
    if labels is not None and is_multi_hot(labels):
        per_image = labels_per_image(labels)
        print(f"labels: {per_image.mean():.2f} per training image on average, at most {per_image.max()}; "
              f"{plural(int((per_image == 0).sum()), 'training image')} with none (counts below: images with the class)")
    if train is not None and val is not None and len(data.classes) > MAX_CLASSES_LISTED:
        counts, balance = describe_many_classes(data.classes, [t + v for t, v in zip(train, val)])
        print(f"data: {where}: {counts}\n{balance}")
    elif train is not None and val is not None:
        print(f"data: {where}: " + ", ".join(f"{t + v} {c}" for c, t, v in zip(data.classes, train, val)))
    else:
        print(f"data: {where}: {len(data.classes)} classes (images per class: give the datasets .targets)")
    print(f"split: {len(data.train)} train, {len(data.val)} val images", flush=True)
    warning = imbalance_warning(args, train, data.classes) if train is not None else None
    if warning:
        print(f"warning: {warning}", flush=True)


def describe_many_classes(classes, counts, shown=3):
    """Two lines on the images per class of a dataset with many classes: how many classes and
    images, the ``shown`` smallest and largest classes, the median; and how imbalanced."""
    order = sorted(range(len(classes)), key=lambda c: (counts[c], c))
    biggest = sorted(range(len(classes)), key=lambda c: (-counts[c], c))  # ties in label order, as for the smallest
    named = [", ".join(f"{classes[c]} ({counts[c]})" for c in picked) for picked in (order[:shown], biggest[:shown])]
    median = sorted(counts)[len(counts) // 2]
    smallest, largest = counts[order[0]], counts[biggest[0]]
    if smallest == largest:
        balance = f"every class has {largest} images"
    elif smallest == 0:
        balance = f"{sum(1 for n in counts if n == 0)} class(es) have no images"
    else:
        balance = (f"the largest class has {largest / smallest:.1f}x the images of the smallest; "
                   f"{sum(1 for n in counts if n < median / 2)} class(es) have less than half the median")
    return [f"{len(classes)} classes, {sum(counts)} images; smallest {named[0]}; largest {named[1]}; "
            f"median {median} images a class", f"imbalance: {balance}"]


def class_counts(dataset, classes):
    """Images per class from ``dataset.targets`` (multi-label: the images that carry each
    class), or None if the dataset has none."""
    labels = training_labels(dataset)
    if labels is None:
        return None
    return positives_per_class(labels) if is_multi_hot(labels) else label_counts(labels, len(classes))


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


def report_evaluation(result, data, args):
    """What --eval-only prints (data, per-class and overall metrics) and, with --eval-output,
    writes (the confusion matrix as PNG and CSV, overall_metrics.csv, per_class_metrics.csv).
    Rank 0 only: the other ranks return at once."""
    if not is_main_process():
        return
    print_data_summary(args, data)
    if args.multi_label:
        print_multi_label_evaluation(result, data.classes)
        if args.eval_output:
            save_multi_label_report(result.report(), data.classes, args.eval_output, printable(args.weights))
            write_text_atomic(csv_text(overall_rows(result)), os.path.join(args.eval_output, EVALUATION_FILES[0]))
        return
    print_evaluation(result, data.classes)
    if args.eval_output:
        save_confusion_matrix(result.confusion, data.classes, args.eval_output, args.weights)
        for text, name in zip(evaluation_metrics_csv(result, data.classes), EVALUATION_FILES):
            write_text_atomic(text, os.path.join(args.eval_output, name))
