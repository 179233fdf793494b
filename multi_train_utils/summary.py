"""What rank 0 prints at the start of a run (one screen) and at its end."""
import os

import torch

from model import count_parameters
from utils import PLOT_FILES, print_data_summary

RULE = "-" * 78


def describe_device(device):
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        return f"cpu ({torch.get_num_threads()} threads)"
    return str(device)


def print_start_summary(args, split, device, precision, model, lr, workers, log_dir, world_size=1,
                        launcher="single process", backend="-"):
    """Devices, data, model, batch, learning rate and where everything goes."""
    print(RULE)
    if world_size > 1 and device.type == "cuda":
        where = f"one GPU per process ({torch.cuda.get_device_name(device)})"
    else:
        where = describe_device(device) + (" per process" if world_size > 1 else "")
    print(f"world size: {world_size} ({launcher}, backend {backend}), device: {where}")
    print(f"amp: {precision.describe()}, channels_last: {'on' if args.channels_last else 'off'}"
          + (", compiled" if args.compile else "") + (", grad-checkpoint" if args.grad_checkpoint else ""))
    print_data_summary(args, split)
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
