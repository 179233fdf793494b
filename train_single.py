"""Train an image classifier on one device (GPU if there is one, else CPU).

    python train_single.py --data-path data/flower_photos
    python train_single.py --demo                # generated data, no download needed
    python train_single.py --eval-only --weights weights/model-29.pth

What to edit for your own: the data in my_dataset.py (build_datasets), the model, loss,
optimizer and schedule in model.py (create_model, create_loss, create_optimizer,
create_lr_scheduler). The package multi_train_utils/ is the engine.
"""
import time

import torch
from torch.utils.data import BatchSampler

from model import create_loss, create_lr_scheduler, create_model, create_optimizer
from multi_train_utils.checkpoint import TrainState, restore_training_state
from multi_train_utils.distributed_utils import configure_cpu_threads, select_device
from multi_train_utils.errors import install_stop_handlers, run_cli
from multi_train_utils.files import RunLog
from multi_train_utils.loaders import make_batch_mixer
from multi_train_utils.loaders import (EpochBatchSampler, SeededSamples, ShardSampler, loss_class_weights, make_loader,
                                       make_train_sampler, seed_epoch)
from multi_train_utils.model_setup import (ModelSpec, build_model, choose_precision, configure_backends, make_model_ema,
                                           optimize_model)
from multi_train_utils.options import config_of, get_args_parser, parse_args, task_of
from multi_train_utils.recorder import EpochDecider, RunRecorder, print_start_summary, report_evaluation
from multi_train_utils.run_files import read_inputs, resume_hint
from multi_train_utils.train_eval_utils import LoopSettings, evaluate, train_one_epoch
from my_dataset import build_datasets


def main(argv=None):
    # ---- The process: flags, device, precision
    args = parse_args(get_args_parser(distributed=False), argv)
    config = config_of(args)  # the same flags in frozen sections: config.data, .recipe, .run, .speed, .distributed
    run_log = RunLog()  # what this process prints goes to train.log too, once the output dir is checked
    install_stop_handlers(resume_hint(config.run))  # Ctrl-C / SIGTERM: out within seconds
    device = select_device(args.device)
    workers = configure_cpu_threads(device, args.threads, args.workers)  # torch's threads; the loader's workers
    configure_backends(device)  # cuDNN autotuner, TF32
    precision = choose_precision(args.amp, device)  # bf16 / fp16 / off (fp32)
    task = task_of(args)  # single-label, --multi-label or --task FILE.py:Class: labels, loss, metrics, reports

    # ---- The data
    # --output-dir locked for this run (a second run into it stops here); then the data
    # (my_dataset.build_datasets: edit it for your own), --weights, --resume and --output-dir,
    # all checked before anything is built or written.
    data, weights_state, resume_path, checkpoint, output_lock = read_inputs(config, lambda: build_datasets(args),
                                                                            device, task.several_labels)
    num_classes = len(data.classes)
    train_set, val_set = SeededSamples(data.train, args.seed), data.val  # augmentation seeded per (epoch, image)
    # A shuffle seeded by (--seed, epoch): the same on every rerun or resume. (--sampler
    # balanced: a class-balanced draw with replacement, seeded alike.)
    train_sampler = make_train_sampler(config.recipe, train_set)
    train_batch_sampler = EpochBatchSampler(train_sampler, args.batch_size)  # resumable inside an epoch
    val_batch_sampler = BatchSampler(ShardSampler(len(val_set)), args.batch_size, drop_last=False)
    train_loader = make_loader(train_set, train_batch_sampler, workers, device)
    val_loader = make_loader(val_set, val_batch_sampler, workers, device, validation=True)

    # ---- The model (model.py: create_model)
    torch.manual_seed(args.seed)
    spec = ModelSpec(create_model, args.model, num_classes, args.img_size, data.channels)
    model = build_model(spec, device, weights_state, weights_flag=args.weights, eval_only=args.eval_only,
                        freeze_layers=args.freeze_layers, batch_size=args.batch_size, sync_bn=args.sync_bn)
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])  # resume: the weights of the last finished epoch
    model, channels_last = optimize_model(model, config.speed, device, precision, model_name=config.recipe.model,
                                          data_parallel=config.distributed.data_parallel)  # channels_last, --compile
    settings = LoopSettings.from_config(config, precision, channels_last, data, task)  # data: its mean and std

    if args.eval_only:
        report_evaluation(lambda: evaluate(model, val_loader, device, num_classes, settings), data, config,
                          settings.task)  # the data, its evaluation (every rank), the report (rank 0)
        return

    # ---- How it learns (model.py: create_loss, create_optimizer, create_lr_scheduler)
    state = TrainState(model, create_optimizer(model, args), scaler=precision.grad_scaler(),
                       ema=make_model_ema(model, config.recipe))  # the scaler: fp16's loss scaling; --model-ema
    restore_training_state(state, checkpoint)  # resume: optimizer, scaler, EMA, generators, epoch (and step), best
    state.lr_scheduler = create_lr_scheduler(state.optimizer, args, len(train_loader), start_epoch=state.epoch)
    state.loss_function = create_loss(args, loss_class_weights(task, args.class_weights, train_set, num_classes))
    state.mixer = make_batch_mixer(config.recipe, num_classes)  # --mixup-alpha, --cutmix-alpha

    # ---- The epochs
    decider = EpochDecider(state, task, config.run, checkpoint)  # the best epoch, --patience: every rank alike
    recorder = RunRecorder(config, data, state, checkpoint=checkpoint, resume_path=resume_path, run_log=run_log,
                           task=task)  # the run's files: rank 0 writes what the decider decided
    print_start_summary(config, data, state, settings, device=device, workers=workers, log_dir=recorder.log_dir,
                        resumed=recorder.resume_lines)
    recorder.plot_data(data, train_set)  # class_distribution.png, batch_preview.png
    with recorder.explain_faults():  # disk full, out of memory: one line, with the checkpoint to resume from
        for epoch in range(state.epoch, args.epochs):
            if state.stop_reason:  # --patience ran out
                break
            start = time.perf_counter()
            seed_epoch(args.seed, epoch)  # dropout & co: the same on a rerun or resume
            train_sampler.set_epoch(epoch)
            # inside the epoch too: a checkpoint every --checkpoint-every minutes, and at a preemption notice
            train_stats = train_one_epoch(state, train_loader, device, epoch, settings, hook=recorder.checkpoints)
            result = evaluate(model, val_loader, device, num_classes, settings)
            ema_result = evaluate(state.ema.module, val_loader, device, num_classes, settings) if state.ema else None
            source = decider.end_epoch(epoch, result, ema_result)  # the best epoch (the model's or the EMA's)
            recorder.end_epoch(epoch, train_stats, result, ema_result, seconds=time.perf_counter() - start,
                               source=source)
        recorder.finish(decider)  # curves, confusion matrix, end summary


if __name__ == "__main__":
    run_cli(main)
