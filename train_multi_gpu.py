"""Train an image classifier with DistributedDataParallel: one process per GPU or CPU share.

NCCL on GPUs and gloo on CPUs; every way to launch it:

    torchrun --nproc_per_node=4 train_multi_gpu.py --data-path data/flower_photos
    python -m torch.distributed.launch --nproc_per_node=4 train_multi_gpu.py ...
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=4 --master_addr=HOST --master_port=29500 train_multi_gpu.py ...
    srun python train_multi_gpu.py ...          # SLURM, one task per GPU
    python train_multi_gpu.py --spawn 4 ...     # torch.multiprocessing.spawn, no launcher
    python train_multi_gpu.py ...               # a single process (world size 1)

This is train_single.py plus the numbered DDP steps: ``diff train_single.py train_multi_gpu.py``
shows them. What to edit for your own is the same: my_dataset.py and model.py.
"""
import os
import signal
import sys
import time

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler

from model import create_loss, create_lr_scheduler, create_model, create_optimizer
from multi_train_utils.checkpoint import TrainState, restore_training_state
from multi_train_utils.distributed_utils import (configure_cpu_threads, connect_store, init_distributed_mode,
                                                 leaves_process_group, meet_node_peers, processes_sharing_cores,
                                                 read_dist_env, select_device, start_local_processes)
from multi_train_utils.errors import die_with_launcher, install_stop_handlers, run_cli
from multi_train_utils.files import RunLog
from multi_train_utils.loaders import make_batch_mixer
from multi_train_utils.loaders import (EpochBatchSampler, SeededSamples, ShardSampler, loss_class_weights, make_loader,
                                       make_train_sampler, seed_epoch)
from multi_train_utils.model_setup import (ModelSpec, build_model, choose_precision, configure_backends, make_model_ema,
                                           optimize_model, use_sync_bn)
from multi_train_utils.options import config_of, get_args_parser, parse_args, task_of
from multi_train_utils.recorder import EpochDecider, RunRecorder, print_start_summary, report_evaluation
from multi_train_utils.run_files import load_data, read_inputs, resume_hint
from multi_train_utils.train_eval_utils import LoopSettings, evaluate, train_one_epoch
from my_dataset import build_datasets


@leaves_process_group  # see 8. at the end
def main(argv=None):
    # ---- The process: flags, device, precision
    args = parse_args(get_args_parser(distributed=True), argv)
    if args.spawn and "RANK" not in os.environ:
        return spawn_processes(args, argv)
    config = config_of(args)  # the same flags in frozen sections: config.data, .recipe, .run, .speed, .distributed
    env = read_dist_env(args.local_rank)
    is_main = env.rank == 0
    run_log = RunLog() if is_main else None  # what rank 0 prints goes to train.log too
    install_stop_handlers(resume_hint(config.run) if is_main else None)  # Ctrl-C / SIGTERM: out within seconds
    if env.launcher == "torchrun":
        die_with_launcher()  # a torchrun killed with kill -9 takes its workers with it

    # 1. Process group. First the rendezvous store, through which the processes of a node learn
    #    which GPUs and cores each one sees (SLURM may give each its own GPU, or its own cores);
    #    then each takes its GPU and its share of the cores, and the group (none, and backend
    #    None, for a single process started without a launcher).
    store = connect_store(config.distributed, env)
    node_peers = meet_node_peers(store, env, wants_gpus=args.device != "cpu")
    device = select_device(args.device, env.local_rank, env.local_world_size, node_peers,
                           shared_gpu_ok=args.dist_backend == "gloo")
    workers = configure_cpu_threads(device, args.threads, args.workers,
                                    sharing=processes_sharing_cores(env, node_peers))
    configure_backends(device)  # cuDNN autotuner, TF32
    precision = choose_precision(args.amp, device)  # bf16 / fp16 / off (fp32)
    task = task_of(args)  # single-label, --multi-label or --task FILE.py:Class: labels, loss, metrics, reports
    init_distributed_mode(config.distributed, env, device, store)
    # ---- The data
    # --output-dir locked for this run (a second run into it stops here); then the data
    # (my_dataset.build_datasets: edit it for your own), --weights, --resume and --output-dir,
    # all checked before anything is built or written.
    # 2. Every rank checks the same input (rank 0 locks, reads and writes --output-dir); if any
    #    rank finds a problem, all stop here. Each rank trains on its own shard of the shuffle
    #    (the same on all ranks), and validates on its shard of the validation set, without
    #    padding, so that every image counts exactly once.
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
    # 3. SyncBatchNorm: batch statistics over all GPUs (--sync-bn; for small per-GPU batches).
    if use_sync_bn(args.sync_bn, device, env.distributed, compiled=args.compile, verbose=is_main):
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model, channels_last = optimize_model(model, config.speed, device, precision, model_name=config.recipe.model,
                                          data_parallel=config.distributed.data_parallel)  # channels_last, --compile
    settings = LoopSettings.from_config(config, precision, channels_last, data, task)  # data: its mean and std

    if args.eval_only:
        report_evaluation(lambda: evaluate(model, val_loader, device, num_classes, settings), data, config,
                          settings.task)  # the data, its evaluation (every rank), the report (rank 0)
        return

    # ---- How it learns (model.py: create_loss, create_optimizer, create_lr_scheduler)
    # 4. DDP: broadcasts rank 0's weights to every rank, then averages gradients in backward.
    #    (--scale-lr: create_optimizer multiplies --lr by the world size.)
    if env.distributed:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
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
            if state.stop_reason:  # --patience ran out (every rank sees the same metrics)
                break
            start = time.perf_counter()
            seed_epoch(args.seed, epoch)  # dropout & co: the same on a rerun or resume
            train_sampler.set_epoch(epoch)  # 5. a different shuffle every epoch, the same on all ranks
            # 6. train_one_epoch averages the loss over ranks with reduce_value (every --print-freq steps)
            # inside the epoch too: a checkpoint every --checkpoint-every minutes, and at a preemption notice
            train_stats = train_one_epoch(state, train_loader, device, epoch, settings, hook=recorder.checkpoints)
            result = evaluate(model, val_loader, device, num_classes, settings)
            ema_result = evaluate(state.ema.module, val_loader, device, num_classes, settings) if state.ema else None
            # 7. Rank 0 saves the checkpoint, the epoch's weights and metrics.csv (the others skip it).
            source = decider.end_epoch(epoch, result, ema_result)  # the best epoch (the model's or the EMA's)
            recorder.end_epoch(epoch, train_stats, result, ema_result, seconds=time.perf_counter() - start,
                               source=source)
        recorder.finish(decider)  # curves, confusion matrix, end summary
    # 8. On the way out, also on an error, @leaves_process_group's cleanup(): every process leaves
    #    the process group, without waiting long for peers that may be gone (NCCL's is aborted).


def spawn_processes(args, argv):
    """--spawn N: check the input, then start N local processes with torch.multiprocessing.spawn."""
    # bad input fails here, once, before any process starts
    load_data(config_of(args), lambda: build_datasets(args), world_size=args.spawn,
              several_labels=task_of(args).several_labels)
    argv = sys.argv[1:] if argv is None else argv
    context = start_local_processes(main, args.spawn, argv)
    try:
        while not context.join():
            pass
    except mp.ProcessExitedException as e:  # the process printed its own error
        sys.exit(e.exit_code if e.exit_code and e.exit_code > 0 else 1)
    except KeyboardInterrupt:  # Ctrl-C or SIGINT to this launcher: pass it on, then wait a little
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGINT)
        for process in context.processes:
            process.join(timeout=8)
            if process.is_alive():
                process.kill()
        sys.exit(128 + signal.SIGINT)


if __name__ == "__main__":
    run_cli(main)
