"""What rank 0 prints: the start of a run (one screen), its end, and an evaluation's report."""
import os

import torch

from model import count_parameters
from multi_train_utils.example_data import DEMO_MARKER
from multi_train_utils.pictures import PLOT_FILES, save_confusion_matrix

RULE = "-" * 78


def describe_device(device):
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        return f"cpu ({torch.get_num_threads()} threads)"
    return str(device)


def print_start_summary(args, data, device, settings, model, lr, workers, log_dir, world_size=1,
                        launcher="single process", backend="-"):
    """Devices, data, model, batch, learning rate and where everything goes."""
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
    print(f"lr: {lr:g}{scaled}; {warmup}cosine to {lr * args.lrf:g} at epoch {args.epochs - 1}")
    print(f"outputs: {args.output_dir} (train.log, metrics.csv, model-best.pth, checkpoint.pth, plots)")
    print(f"TensorBoard: {log_dir}; view with: tensorboard --logdir {args.log_dir}")
    print(RULE, flush=True)


def format_duration(seconds):
    minutes, seconds = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


def print_end_summary(output_dir, best_accuracy, best_epoch, seconds, plots):
    """Best accuracy and its epoch, the time taken, and where the weights and pictures are."""
    best = os.path.join(output_dir, "model-best.pth")
    print(RULE)
    print(f"best val accuracy: {best_accuracy:.4f} at epoch {best_epoch}; this session took "
          f"{format_duration(seconds)}")
    print(f"best weights: {best}")
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


def class_counts(dataset, classes):
    """Images per class from ``dataset.targets``, or None if the dataset has none."""
    targets = getattr(dataset, "targets", None)
    if targets is None:
        return None
    counts = [0] * len(classes)
    for label in targets:
        counts[int(label)] += 1
    return counts


def print_evaluation(result, classes):
    """Per-class accuracy lines, then ``top1 accuracy: 0.812500 (130/160)`` as the last line."""
    width = max(len(c) for c in classes)
    for i, name in enumerate(classes):
        row = result.confusion[i]
        total, correct = int(row.sum()), int(row[i])
        print(f"  {name:<{width}}  {correct / max(1, total):.6f} ({correct}/{total})")
    print(f"top1 accuracy: {result.accuracy:.6f} ({result.correct}/{result.total})", flush=True)


def report_evaluation(result, data, args):
    """What --eval-only prints (data, per-class and top-1 accuracy) and, with --eval-output,
    writes (the confusion matrix as PNG and CSV). Rank 0 only."""
    print_data_summary(args, data)
    print_evaluation(result, data.classes)
    if args.eval_output:
        save_confusion_matrix(result.confusion, data.classes, args.eval_output, args.weights)
