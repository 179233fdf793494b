"""Train an image classifier with DistributedDataParallel: one process per GPU or CPU share.

NCCL on GPUs and gloo on CPUs; every way to launch it:

    torchrun --nproc_per_node=4 train_multi_gpu.py --data-path data/flower_photos
    python -m torch.distributed.launch --nproc_per_node=4 train_multi_gpu.py ...
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=4 --master_addr=HOST --master_port=29500 train_multi_gpu.py ...
    srun python train_multi_gpu.py ...          # SLURM, one task per GPU
    python train_multi_gpu.py --spawn 4 ...     # torch.multiprocessing.spawn, no launcher
    python train_multi_gpu.py ...               # a single process (world size 1)
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

from model import build_model
from multi_train_utils.balance import loss_class_weights, make_train_sampler
from multi_train_utils.checkpoint import restore_training_state, set_aside_damaged_checkpoint
from multi_train_utils.distributed_utils import (check_on_every_rank, check_same_on_every_rank, cleanup,
                                                 configure_cpu_threads, connect_store, default_workers,
                                                 init_distributed_mode, meet_node_peers, processes_sharing_cores,
                                                 read_dist_env, select_device, start_local_processes,
                                                 use_sync_bn)
from multi_train_utils.ema import make_model_ema
from multi_train_utils.errors import run_cli
from multi_train_utils.inputs import file_list_fingerprint, load_data, read_inputs, resume_hint
from multi_train_utils.mixing import make_batch_mixer
from multi_train_utils.options import get_args_parser, parse_args
from multi_train_utils.performance import choose_precision, configure_backends, optimize_model
from multi_train_utils.recorder import RunRecorder
from multi_train_utils.run_files import clear_earlier_run
from multi_train_utils.run_log import RunLog
from multi_train_utils.signals import die_with_launcher, install_stop_handlers
from multi_train_utils.summary import print_start_summary, report_evaluation
from multi_train_utils.train_eval_utils import (LoopSettings, create_loss, create_lr_scheduler, create_optimizer,
                                                evaluate, optimizer_steps_per_epoch, train_one_epoch)
from my_dataset import EpochIndexSampler, SeededSamples, ShardSampler, build_datasets, seed_epoch
from utils import make_loaders


def main(argv=None):
    args = parse_args(get_args_parser(distributed=True), argv)
    if args.spawn and "RANK" not in os.environ:
        return spawn_processes(args, argv)
    env = read_dist_env(args.local_rank)
    is_main = env.rank == 0
    run_log = RunLog() if is_main else None  # what rank 0 prints goes to train.log too
    install_stop_handlers(resume_hint(args) if is_main else None)  # Ctrl-C / SIGTERM: out within seconds
    if env.launcher == "torchrun":
        die_with_launcher()  # a torchrun killed with kill -9 takes its workers with it

    # 1. Process group. First the rendezvous store, through which the processes of a node learn
    #    which GPUs and cores each one sees (SLURM may give each its own GPU, or its own cores);
    #    then each takes its GPU, and the group (none, and backend None, for a single process
    #    started without a launcher).
    store = connect_store(args, env)
    node_peers = meet_node_peers(store, env, wants_gpus=args.device != "cpu")
    device = select_device(args.device, env.local_rank, env.local_world_size, node_peers,
                           shared_gpu_ok=args.dist_backend == "gloo")
    sharing = processes_sharing_cores(env, node_peers)  # processes of this node on this one's cores
    configure_cpu_threads(device, sharing, args.threads)
    configure_backends(device)  # cuDNN autotuner, TF32
    precision = choose_precision(args.amp, device)  # bf16 / fp16 / off (fp32)
    backend = init_distributed_mode(args, env, device, store)
    try:
        # --output-dir locked by rank 0, the one that writes there (a second run into it stops
        # here); then the data (my_dataset.build_datasets: edit it for your own), --weights,
        # --resume, --output-dir: every rank checks the same input; if any rank finds a problem,
        # all stop here, before anything is built or written.
        data, weights_state, resume_path, checkpoint, output_lock = check_on_every_rank(
            lambda: read_inputs(args, build_datasets, env.local_rank, env.world_size, verbose=is_main,
                                writer=is_main), device)
        check_same_on_every_rank(-1 if checkpoint is None else int(checkpoint["epoch"]), device,
                                 "the checkpoint to resume from")
        num_classes = len(data.classes)
        train_set, val_set = SeededSamples(data.train, args.seed), data.val  # augmentation seeded per (epoch, image)

        # 2. Samplers: each rank trains on its own shard of a shuffle seeded by (seed, epoch)
        #    (--sampler balanced: of one class-balanced draw with replacement per (seed, epoch));
        #    validation is sharded without padding so every image counts exactly once.
        train_sampler = make_train_sampler(args, train_set, num_replicas=env.world_size, rank=env.rank)
        train_batch_sampler = BatchSampler(EpochIndexSampler(train_sampler), args.batch_size, drop_last=True)
        val_batch_sampler = BatchSampler(ShardSampler(len(val_set), env.rank, env.world_size), args.batch_size,
                                         drop_last=False)
        workers = args.workers if args.workers is not None else default_workers(sharing)
        train_loader, val_loader = make_loaders(train_set, train_batch_sampler, val_set, val_batch_sampler, workers,
                                                 device)

        # 3. SyncBatchNorm: batch statistics over all GPUs (--sync-bn; for small per-GPU batches).
        sync_bn = use_sync_bn(args.sync_bn, device, env.distributed, compiled=args.compile, verbose=is_main)
        torch.manual_seed(args.seed)
        model = build_model(args, num_classes, weights_state, verbose=is_main,  # freezes before the DDP wrap
                            norm_batch=args.batch_size * (env.world_size if sync_bn else 1))
        if checkpoint is not None:
            model.load_state_dict(checkpoint["model"])  # resume: the weights of the last finished epoch
        if sync_bn:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model.to(device)
        model, channels_last = optimize_model(model, args, device, verbose=is_main)  # --grad-checkpoint, --compile
        settings = LoopSettings.from_args(args, precision, channels_last)

        if args.eval_only:
            result = evaluate(model, val_loader, device, num_classes, settings)
            if is_main:
                report_evaluation(result, data, args)  # and --eval-output's files
            return

        # 4. DDP: broadcasts rank 0's weights to every rank, then averages gradients in backward.
        if env.distributed:
            model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

        lr = args.lr * env.world_size if args.scale_lr else args.lr
        optimizer = create_optimizer(model, lr, args)  # --opt sgd / adamw; edit create_optimizer for your own
        scaler = precision.grad_scaler()  # loss scaling for fp16; a no-op otherwise
        ema = make_model_ema(args, model)  # --model-ema: the same on every rank (see ema.py)
        start_epoch = restore_training_state(checkpoint, optimizer, lr, scaler, ema)  # 0 for a fresh start
        lr_scheduler = create_lr_scheduler(optimizer, optimizer_steps_per_epoch(len(train_loader), args.accum_steps),
                                           args.epochs, args.warmup_epochs, args.lrf, start_epoch,
                                           args.lr_scheduler, args.lr_step_size, args.lr_gamma)
        loss_function = create_loss(args.label_smoothing, loss_class_weights(args, train_set, num_classes))
        mixer = make_batch_mixer(args, num_classes, env.rank)  # --mixup-alpha, --cutmix-alpha: seeded per rank

        if is_main:  # only rank 0 writes (see 7.)
            clear_earlier_run(args, checkpoint)  # leftover temporary files; with --overwrite, the earlier run
            set_aside_damaged_checkpoint(args.output_dir, resume_path)  # resumed from checkpoint-prev.pth
        recorder = RunRecorder(args=args, classes=data.classes, world_size=env.world_size, enabled=is_main,
                               checkpoint=checkpoint, resume_path=resume_path, run_log=run_log,
                               file_list=file_list_fingerprint(data) if is_main else None)
        if is_main:
            print_start_summary(args, data, device, settings, model, lr, workers, recorder.log_dir,
                                env.world_size, env.launcher, backend or "-")
            recorder.plot_data(data, train_set)
        with recorder.explain_faults():  # disk full, out of memory: one line, with the checkpoint to resume from
            for epoch in range(start_epoch, args.epochs):
                if recorder.stop_reason:  # --patience ran out (every rank sees the same metrics)
                    break
                start = time.perf_counter()
                seed_epoch(args.seed, epoch, env.rank)  # dropout & co: the same on a rerun or resume
                train_sampler.set_epoch(epoch)  # 5. a different shuffle every epoch, the same on all ranks
                # 6. train_one_epoch averages the loss over ranks with reduce_value (every --print-freq steps)
                train_stats = train_one_epoch(model, optimizer, train_loader, device, epoch, lr_scheduler, scaler,
                                              settings, loss_function, mixer, ema)
                result = evaluate(model, val_loader, device, num_classes, settings)
                ema_result = evaluate(ema.module, val_loader, device, num_classes, settings) if ema else None
                # 7. Rank 0 saves the checkpoint, the epoch's weights and metrics.csv (the others skip it).
                recorder.end_epoch(epoch, model, optimizer, lr_scheduler, scaler, train_stats, result,
                                   time.perf_counter() - start, ema, ema_result)
            recorder.finish()  # curves, confusion matrix, end summary
    finally:
        # 8. Every process leaves the process group; on an error without waiting long for peers
        #    that may be gone (an NCCL group is aborted).
        cleanup(failed=sys.exc_info()[0] is not None)


def spawn_processes(args, argv):
    """--spawn N: check the input, then start N local processes with torch.multiprocessing.spawn."""
    load_data(args, build_datasets, world_size=args.spawn)  # bad input fails here, once, before any process starts
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
