"""What rank 0 prints: the start of a run (one screen), its end, and an evaluation's report."""
import os

import torch
import torch.distributed as dist

from multi_train_utils.balance import (imbalance_warning, is_multi_hot, label_counts, labels_per_image,
                                      positives_per_class, training_labels)
from multi_train_utils.distributed_utils import current_job
from multi_train_utils.example_data import DEMO_MARKER
from multi_train_utils.errors import printable
from multi_train_utils.files import folder_bytes, format_bytes
from multi_train_utils.images import JPEG_DECODER
from multi_train_utils.model_setup import count_parameters
from multi_train_utils.pictures import PLOT_FILES
from multi_train_utils.process import get_world_size, is_dist_avail_and_initialized, is_main_process
from multi_train_utils.single_label import SingleLabel
from multi_train_utils.task import MAX_CLASSES_LISTED

RULE = "-" * 78


def describe_device(device):
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        return f"cpu ({plural(torch.get_num_threads(), 'thread')})"
    return str(device)


def plural(count, word, many=None):
    """"1 worker", "2 workers" ("1 process", "2 processes" with ``many``)."""
    return f"{count} {word if count == 1 else many or word + 's'}"


def print_start_summary(config, data, state, settings, device, workers=0, log_dir="-", resumed=()):
    """Devices, data, model (``state.model``), batch, the learning-rate schedule (as the run
    was started, also when it resumes), where everything goes, then the ``resumed`` lines (where
    a resumed run goes on), of ``config`` (options.Config); rank 0 prints it."""
    if not is_main_process():
        return
    recipe, speed, run = config.recipe, config.speed, config.run
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
          + (", compiled" if speed.compile else "") + (", grad-checkpoint" if speed.grad_checkpoint else ""))
    print_data_summary(config, data, settings.task)
    trainable = count_parameters(model, trainable_only=True)
    total = count_parameters(model)
    print(f"model: {recipe.model} ({total:,} parameters"
          + (f", {trainable:,} trainable" if trainable != total else "") + ")")
    print(f"batch: {recipe.batch_size} per process x {plural(speed.accum_steps, 'accumulation step')} x "
          f"{plural(world_size, 'process', 'processes')} = "
          f"{recipe.batch_size * speed.accum_steps * world_size} per optimizer step; {plural(workers, 'loader worker')} "
          f"per process; {describe_decoders(data)}")
    scaled = f" ({recipe.lr:g} x {world_size} processes)" if lr != recipe.lr else ""
    warmup = f"{recipe.warmup_epochs} warm-up epochs, then " if recipe.warmup_epochs else ""
    schedule = (f"x {recipe.lr_gamma:g} every {recipe.lr_step_size} epochs" if recipe.lr_scheduler == "step" else
                f"cosine to {lr * recipe.lrf:g} at epoch {recipe.epochs - 1}")
    print(f"lr: {lr:g}{scaled}; {warmup}{schedule}")
    print("recipe: " + describe_recipe(config))
    print(f"outputs: {run.output_dir} (train.log, metrics.csv, model-best.pth, checkpoint.pth, plots)")
    print(f"TensorBoard: {log_dir}; view with: tensorboard --logdir {run.log_dir}")
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


def describe_recipe(config):
    """One line: optimizer, augmentation, loss, sampling, EMA (``config.recipe``), best metric
    and patience (``config.run``)."""
    recipe, run = config.recipe, config.run
    decay = "" if recipe.norm_bias_decay else ", none on norm and bias"
    parts = [f"{recipe.opt} (weight decay {recipe.weight_decay:g}{decay})"]
    augment = ["crop+flip"] + ([recipe.auto_augment] if recipe.auto_augment != "none" else [])
    augment += [f"erase {recipe.random_erase:g}"] if recipe.random_erase else []
    augment += [f"mixup {recipe.mixup_alpha:g}"] if recipe.mixup_alpha else []
    augment += [f"cutmix {recipe.cutmix_alpha:g}"] if recipe.cutmix_alpha else []
    parts.append("augment " + " + ".join(augment))
    if recipe.label_smoothing:
        parts.append(f"label smoothing {recipe.label_smoothing:g}")
    if recipe.class_weights != "none":
        parts.append(f"{recipe.class_weights} class weights")
    parts.append(f"{recipe.sampler} sampler")
    if recipe.model_ema:
        parts.append(f"EMA (decay {recipe.model_ema_decay:g})")
    parts.append(f"best by val {run.best_metric}" + (f", patience {run.patience}" if run.patience else ""))
    return "; ".join(parts)


def format_duration(seconds):
    minutes, seconds = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


def print_end_summary(run, state, seconds, plots=(), classes=(), task=None, clock=None):
    """Best --best-metric (of ``run``, the flags' run section) and its epoch (``state.best``),
    whose weights model-best.pth holds (the model's or its EMA's), why the run stopped early if
    it did, the time taken (``seconds``), the run's ``clock`` (decider.EpochDecider's
    time_to_target), and where the weights and ``plots`` are; what ``task`` says of the best
    epoch (of ``classes``; multi-label: its per-class figures and thresholds)."""
    task = task or SingleLabel()
    output_dir, epoch = run.output_dir, state.best.epoch
    best = os.path.join(output_dir, "model-best.pth")
    print(RULE)
    if state.stop_reason:
        print(state.stop_reason)
    print(f"best val {run.best_metric.replace('_', ' ')}: {state.best.value:.4f} at epoch {epoch}; this session took "
          f"{format_duration(seconds)}")
    if clock:
        print(clock)
    source = "the EMA of the weights (--model-ema)" if state.best.source == "ema" else "the model's weights"
    print(f"best weights: {best} ({source}, epoch {epoch})")
    task.print_best(state.best, classes, output_dir)
    if plots:
        print("plots: " + ", ".join(os.path.join(output_dir, PLOT_FILES[p]) for p in plots))
    print(f"predict: python predict.py --weights {best} --image PATH")
    size, files = folder_bytes(output_dir)
    epoch_file = os.path.join(output_dir, f"model-{epoch}.pth")
    shared = os.path.isfile(epoch_file) and os.path.isfile(best) and os.path.samefile(best, epoch_file)
    print(f"disk: {output_dir} holds {format_bytes(size)} in {plural(files, 'file')}"
          + (f" (model-best.pth is model-{epoch}.pth, one file under two names)" if shared else ""))
    print(RULE, flush=True)


def print_data_summary(config, data, task=None):
    """Rank 0's description of the data: images per class and split sizes, skipped files;
    an imbalance warning names the flags that help ``task`` (``config``: options.Config)."""
    flags = config.data
    if not flags.demo and not flags.train_list and os.path.exists(os.path.join(flags.data_path, DEMO_MARKER)):
        print(f"note: {flags.data_path} holds generated demo images (written by --demo), not real photos")
    reasons = getattr(data, "skip_reasons", None) or {}
    for path in data.skipped:
        print(f"warning: skipping {path}: {reasons.get(path, 'not a readable image')}", flush=True)
    for note in getattr(data, "notes", ()):
        print(f"warning: {note}", flush=True)
    if flags.train_list:
        where = flags.train_list + (f" + {flags.val_list} (validation)" if flags.val_list else "")
    else:
        where = f"{flags.data_path}" + (f" + {flags.val_path} (validation)" if flags.val_path else "")
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
    remedy = (task or SingleLabel()).balance_flags
    warning = imbalance_warning(config.recipe, train, data.classes, remedy) if train is not None else None
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


def report_evaluation(result, data, config, task=None):
    """What --eval-only prints (data, then ``task``'s per-class and overall metrics) and, with
    --eval-output, writes (single-label: the confusion matrix as PNG and CSV,
    overall_metrics.csv, per_class_metrics.csv); ``config``: options.Config. Rank 0 only: the other ranks return at once."""
    if not is_main_process():
        return
    task = task or SingleLabel()
    print_data_summary(config, data, task)
    task.print_evaluation(result, data.classes)
    if config.run.eval_output:
        task.write_evaluation(result, data.classes, config.run.eval_output, printable(config.recipe.weights))
