"""What rank 0 prints: the start of a run (one screen), its end, and an evaluation's report."""
import os

import torch
import torch.distributed as dist

from model import count_parameters
from multi_train_utils.distributed_utils import current_job
from multi_train_utils.balance import imbalance_warning, label_counts, training_labels
from multi_train_utils.example_data import DEMO_MARKER
from multi_train_utils.files import csv_text, write_text_atomic
from multi_train_utils.pictures import PLOT_FILES, save_confusion_matrix
from multi_train_utils.process import get_world_size, is_dist_avail_and_initialized, is_main_process

RULE = "-" * 78
# What --eval-output writes besides the confusion matrix, in evaluation_metrics_csv's order.
EVALUATION_FILES = ("overall_metrics.csv", "per_class_metrics.csv")


def describe_device(device):
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        return f"cpu ({torch.get_num_threads()} threads)"
    return str(device)


def print_start_summary(args, data, state, settings, device, workers=0, log_dir="-"):
    """Devices, data, model (``state.model``), batch, learning rate and where everything goes;
    rank 0 prints it."""
    if not is_main_process():
        return
    world_size, job = get_world_size(), current_job()
    launcher = "single process" if job is None else job.launcher
    backend = dist.get_backend() if is_dist_avail_and_initialized() else "-"
    model, lr = state.model, state.optimizer.param_groups[0]["lr"]
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
    print(f"batch: {args.batch_size} per process x {args.accum_steps} accumulation steps x {world_size} processes "
          f"= {args.batch_size * args.accum_steps * world_size} per optimizer step; {workers} loader workers "
          "per process")
    scaled = f" ({args.lr:g} x {world_size} processes)" if lr != args.lr else ""
    warmup = f"{args.warmup_epochs} warm-up epochs, then " if args.warmup_epochs else ""
    schedule = (f"x {args.lr_gamma:g} every {args.lr_step_size} epochs" if args.lr_scheduler == "step" else
                f"cosine to {lr * args.lrf:g} at epoch {args.epochs - 1}")
    print(f"lr: {lr:g}{scaled}; {warmup}{schedule}")
    print("recipe: " + describe_recipe(args))
    print(f"outputs: {args.output_dir} (train.log, metrics.csv, model-best.pth, checkpoint.pth, plots)")
    print(f"TensorBoard: {log_dir}; view with: tensorboard --logdir {args.log_dir}")
    print(RULE, flush=True)


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


def print_end_summary(args, state, seconds, plots=()):
    """Best --best-metric and its epoch (``state.best``), whose weights model-best.pth holds
    (the model's or its EMA's), why the run stopped early if it did, the time taken (``seconds``),
    and where the weights and ``plots`` are."""
    output_dir, epoch = args.output_dir, state.best.epoch
    best = os.path.join(output_dir, "model-best.pth")
    print(RULE)
    if state.stop_reason:
        print(state.stop_reason)
    print(f"best val {args.best_metric.replace('_', ' ')}: {state.best.value:.4f} at epoch {epoch}; this session took "
          f"{format_duration(seconds)}")
    source = "the EMA of the weights (--model-ema)" if state.best.source == "ema" else "the model's weights"
    print(f"best weights: {best} ({source}, epoch {epoch})")
    if plots:
        print("plots: " + ", ".join(os.path.join(output_dir, PLOT_FILES[p]) for p in plots))
    print(f"predict: python predict.py --weights {best} --image PATH")
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
    if train is not None and val is not None:
        print(f"data: {where}: " + ", ".join(f"{t + v} {c}" for c, t, v in zip(data.classes, train, val)))
    else:
        print(f"data: {where}: {len(data.classes)} classes (images per class: give the datasets .targets)")
    print(f"split: {len(data.train)} train, {len(data.val)} val images", flush=True)
    warning = imbalance_warning(args, train, data.classes) if train is not None else None
    if warning:
        print(f"warning: {warning}", flush=True)


def class_counts(dataset, classes):
    """Images per class from ``dataset.targets``, or None if the dataset has none."""
    labels = training_labels(dataset)
    return None if labels is None else label_counts(labels, len(classes))


def print_evaluation(result, classes):
    """Per-class accuracy lines, per-class precision, recall and F1, balanced accuracy and
    macro-F1, top-5 (more than 5 classes), then ``top1 accuracy: 0.812500 (130/160)`` as the
    last line."""
    width = max(len(c) for c in classes)
    for i, name in enumerate(classes):
        row = result.confusion[i]
        total, correct = int(row.sum()), int(row[i])
        print(f"  {name:<{width}}  {correct / max(1, total):.6f} ({correct}/{total})")
    # nan where undefined (EvalResult says when): a made-up 0 would read as a measured one
    print("per-class precision, recall, F1 (nan: never predicted / no images / neither):")
    for name, values in zip(classes, zip(result.precision, result.recall, result.f1)):
        print(f"  {name:<{width}}  " + "  ".join(f"{v:.6f}" for v in values))
    print(f"balanced accuracy: {result.balanced_accuracy:.6f}  macro-F1: {result.macro_f1:.6f}")
    if result.top5_accuracy is not None:
        print(f"top5 accuracy: {result.top5_accuracy:.6f} ({result.top5_correct}/{result.total})")
    print(f"top1 accuracy: {result.accuracy:.6f} ({result.correct}/{result.total})", flush=True)


def evaluation_metrics_csv(result, classes):
    """(overall_metrics.csv, per_class_metrics.csv) as CSV text: ``metric,value`` rows (top-5
    only with more than 5 classes), and a row per class with its counts, precision, recall
    and F1 (nan where undefined, as EvalResult defines)."""
    overall = [["metric", "value"], ["top1_accuracy", result.accuracy]]
    if result.top5_accuracy is not None:
        overall.append(["top5_accuracy", result.top5_accuracy])
    overall += [["balanced_accuracy", result.balanced_accuracy], ["macro_f1", result.macro_f1],
                ["images", result.total]]
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
    print_evaluation(result, data.classes)
    if args.eval_output:
        save_confusion_matrix(result.confusion, data.classes, args.eval_output, args.weights)
        for text, name in zip(evaluation_metrics_csv(result, data.classes), EVALUATION_FILES):
            write_text_atomic(text, os.path.join(args.eval_output, name))
