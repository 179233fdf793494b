"""Train an image classifier on one device (GPU if there is one, else CPU).

    python train_single.py --data-path data/flower_photos
    python train_single.py --demo                # generated data, no download needed
    python train_single.py --eval-only --weights weights/model-29.pth
"""
import time

import torch
from torch import nn
from torch.utils.data import BatchSampler

from model import AutocastModule, build_model
from multi_train_utils.balance import loss_class_weights, make_train_sampler
from multi_train_utils.checkpoint import restore_training_state, set_aside_damaged_checkpoint
from multi_train_utils.distributed_utils import configure_cpu_threads, default_workers, select_device
from multi_train_utils.ema import make_model_ema
from multi_train_utils.errors import run_cli
from multi_train_utils.inputs import file_list_fingerprint, read_inputs, resume_hint
from multi_train_utils.mixing import make_batch_mixer
from multi_train_utils.options import get_args_parser, parse_args
from multi_train_utils.performance import choose_precision, configure_backends, optimize_model
from multi_train_utils.recorder import RunRecorder
from multi_train_utils.run_files import clear_earlier_run
from multi_train_utils.run_log import RunLog
from multi_train_utils.signals import install_stop_handlers
from multi_train_utils.summary import print_start_summary, report_evaluation
from multi_train_utils.train_eval_utils import (LoopSettings, create_loss, create_lr_scheduler, create_optimizer,
                                                evaluate, optimizer_steps_per_epoch, train_one_epoch)
from my_dataset import EpochIndexSampler, SeededSamples, ShardSampler, build_datasets, seed_epoch
from utils import make_loaders


def main(argv=None):
    run_log = RunLog()  # what this process prints goes to train.log too, once the output dir is checked
    args = parse_args(get_args_parser(distributed=False), argv)
    device = select_device(args.device)
    configure_cpu_threads(device, threads=args.threads)
    configure_backends(device)  # cuDNN autotuner, TF32
    precision = choose_precision(args.amp, device)  # bf16 / fp16 / off (fp32)
    install_stop_handlers(resume_hint(args))  # Ctrl-C / SIGTERM: out within seconds

    # --output-dir locked for this run (a second run into it stops here); then the data
    # (my_dataset.build_datasets: edit it for your own), --weights, --resume and --output-dir,
    # all checked before anything is built or written.
    data, weights_state, resume_path, checkpoint, output_lock = read_inputs(args, build_datasets)
    num_classes = len(data.classes)
    train_set, val_set = SeededSamples(data.train, args.seed), data.val  # augmentation seeded per (epoch, image)

    # A seeded shuffle that changes with the epoch: the DDP script's order at world size 1,
    # and the same on every rerun (or resume) with this --seed.
    # (--sampler balanced: a class-balanced draw with replacement, seeded by (seed, epoch) alike.)
    train_sampler = make_train_sampler(args, train_set)
    train_batch_sampler = BatchSampler(EpochIndexSampler(train_sampler), args.batch_size, drop_last=True)
    val_batch_sampler = BatchSampler(ShardSampler(len(val_set)), args.batch_size, drop_last=False)
    workers = args.workers if args.workers is not None else default_workers()
    train_loader, val_loader = make_loaders(train_set, train_batch_sampler, val_set, val_batch_sampler, workers,
                                             device)

    torch.manual_seed(args.seed)
    model = build_model(args, num_classes, weights_state)
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])  # resume: the weights of the last finished epoch
    model.to(device)
    model, channels_last = optimize_model(model, args, device)  # channels_last, --grad-checkpoint, --compile
    if args.data_parallel:
        model = wrap_data_parallel(model, device, precision)
    settings = LoopSettings.from_args(args, precision, channels_last)

    if args.eval_only:
        report_evaluation(evaluate(model, val_loader, device, num_classes, settings), data, args)
        return

    optimizer = create_optimizer(model, args.lr, args)  # --opt sgd / adamw; edit create_optimizer for your own
    scaler = precision.grad_scaler()  # loss scaling for fp16; a no-op otherwise
    ema = make_model_ema(args, model)  # --model-ema
    start_epoch = restore_training_state(checkpoint, optimizer, args.lr, scaler, ema)  # 0 for a fresh start
    lr_scheduler = create_lr_scheduler(optimizer, optimizer_steps_per_epoch(len(train_loader), args.accum_steps),
                                       args.epochs, args.warmup_epochs, args.lrf, start_epoch,
                                       args.lr_scheduler, args.lr_step_size, args.lr_gamma)
    loss_function = create_loss(args.label_smoothing, loss_class_weights(args, train_set, num_classes))
    mixer = make_batch_mixer(args, num_classes)  # --mixup-alpha, --cutmix-alpha

    clear_earlier_run(args, checkpoint)  # leftover temporary files; with --overwrite, the earlier run
    set_aside_damaged_checkpoint(args.output_dir, resume_path)  # resumed from checkpoint-prev.pth
    recorder = RunRecorder(args=args, classes=data.classes, checkpoint=checkpoint, resume_path=resume_path,
                           run_log=run_log, file_list=file_list_fingerprint(data))
    print_start_summary(args, data, device, settings, model, args.lr, workers, recorder.log_dir)
    recorder.plot_data(data, train_set)  # class_distribution.png, batch_preview.png
    with recorder.explain_faults():  # disk full, out of memory: one line, with the checkpoint to resume from
        for epoch in range(start_epoch, args.epochs):
            if recorder.stop_reason:  # --patience ran out
                break
            start = time.perf_counter()
            seed_epoch(args.seed, epoch)  # dropout & co: the same on a rerun or resume
            train_sampler.set_epoch(epoch)
            train_stats = train_one_epoch(model, optimizer, train_loader, device, epoch, lr_scheduler, scaler,
                                          settings, loss_function, mixer, ema)
            result = evaluate(model, val_loader, device, num_classes, settings)
            ema_result = evaluate(ema.module, val_loader, device, num_classes, settings) if ema else None
            recorder.end_epoch(epoch, model, optimizer, lr_scheduler, scaler, train_stats, result,
                               time.perf_counter() - start, ema, ema_result)
        recorder.finish()  # curves, confusion matrix, end summary


def wrap_data_parallel(model, device, precision):
    """nn.DataParallel over all visible GPUs (one process); DDP is faster and scales further.
    Each replica runs its forward under ``precision``'s autocast itself (see AutocastModule)."""
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if count < 2:
        print(f"warning: --data-parallel needs 2 or more GPUs, {count} visible; training on {device} alone",
              flush=True)
        return model
    device_ids = list(range(device.index or 0, count))  # the model sits on the first of them
    print(f"DataParallel over GPUs {device_ids}; DistributedDataParallel (torchrun train_multi_gpu.py) is faster",
          flush=True)
    return nn.DataParallel(AutocastModule(model, precision.autocast), device_ids=device_ids)


if __name__ == "__main__":
    run_cli(main)
