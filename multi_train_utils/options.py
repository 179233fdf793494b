"""Command-line flags of the scripts.

Those of train_single.py and train_multi_gpu.py, with --demo's defaults and --eval-only's
run settings, and the trained-model flags of predict.py and export.py."""
import argparse
import math
import os

from multi_train_utils.errors import UserError
from multi_train_utils.run_files import read_run_args

# What --demo changes, unless given on the command line: a small model and small images so
# that the demo trains in a few minutes on a laptop CPU.
DEMO_DEFAULTS = {"data_path": "data/demo", "model": "resnet18", "img_size": 96, "epochs": 3, "lr": 0.01}

# What --eval-only takes from the run that wrote the weights, unless given.
RUN_SETTINGS = ("model", "img_size", "val_resize_size", "val_rate", "seed")
# Where the data is: class folders or label files. --eval-only takes the run's, unless any of
# them is given on the command line (then none of the run's, so that the two never mix).
DATA_FLAGS = ("data_path", "val_path", "train_list", "val_list")


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse with a one-line error instead of the usage block."""

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to each flag's help unless the help already says its default."""

    def _get_help_string(self, action):
        if "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def finite_float(text):
    """argparse type of every float flag: a number, but not nan or inf (which would train on
    until the loss became nan, after the run's first files were written)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _demo_defaults_text():
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in DEMO_DEFAULTS.items())


def get_args_parser(distributed):
    """The parser of both scripts; ``distributed`` adds the DDP flags, else the single-process ones."""
    parser = OneLineErrorParser(
        description="Train an image classifier on a folder of class sub-folders"
        + (" with DistributedDataParallel (launch with torchrun)." if distributed else " on one device."),
        formatter_class=HelpFormatter,
    )
    data = parser.add_argument_group("data")
    data.add_argument("--data-path", default="data/flower_photos", help="folder with one sub-folder of images per class")
    data.add_argument("--val-path", default=None, help="already-split validation folder (same class folders); then --data-path is all training data (default: split --data-path)")
    data.add_argument("--train-list", default=None, metavar="CSV", help="instead of class folders: a CSV file with the header path,label (label: a class name; path: relative to the CSV); the classes are its labels (default: none, use --data-path)")
    data.add_argument("--val-list", default=None, metavar="CSV", help="with --train-list: the validation images, as a CSV like it (default: split --train-list by --val-rate)")
    data.add_argument("--val-rate", type=finite_float, default=0.2, help="share of each class held out for validation")
    data.add_argument("--num-classes", "--num_classes", type=int, default=None, help="number of classes (default: the number of classes in the data; any other value is an error)")
    data.add_argument("--img-size", type=int, default=224, help="training crop and validation image size in pixels")
    data.add_argument("--val-resize-size", type=int, default=None, metavar="N", help="validation (and predict.py) images: shorter side resized to N, then center-cropped to --img-size (default: round(img-size x 256/224), as torchvision's references)")
    data.add_argument("--workers", type=int, default=None, help="data loader processes per training process (default: this process's share of the cores)")
    data.add_argument("--download", action="store_true", help="download the tutorial's flower_photos (228 MB, checked by SHA-256) to --data-path first, unless it is there")
    data.add_argument("--demo", action="store_true", help=f"generate a small flower-like dataset (once) and train on it; sets {_demo_defaults_text()} unless given")

    model = parser.add_argument_group("model")
    model.add_argument("--model", default="resnet34", help="torchvision classification model name (resnet34, resnet101, efficientnet_b0, ...)")
    model.add_argument("--weights", default="", help="initial weights (default: none, random init): a .pth state dict (tensors whose shape fits are loaded, e.g. resnet34-333f7ec4.pth without its 1000-class head), or torchvision's weights name such as DEFAULT or IMAGENET1K_V1 (downloads)")
    model.add_argument("--freeze-layers", action=argparse.BooleanOptionalAction, default=False, help="train only the classifier head (fc / classifier / heads)")

    augment = parser.add_argument_group("augmentation and loss (each off unless given)")
    augment.add_argument("--auto-augment", default="none", choices=["none", "ta_wide", "randaugment", "autoaugment", "augmix"], help="an automatic augmentation policy after the random crop and flip (torchvision v2; ta_wide: TrivialAugmentWide)")
    augment.add_argument("--random-erase", type=finite_float, default=0.0, metavar="P", help="erase a random rectangle of each training image with probability P (to the mean colour)")
    augment.add_argument("--mixup-alpha", type=finite_float, default=0.0, metavar="A", help="MixUp of training batches with Beta(A, A) weights (0: off; 0.2 is usual)")
    augment.add_argument("--cutmix-alpha", type=finite_float, default=0.0, metavar="A", help="CutMix of training batches with Beta(A, A) areas (0: off; 1.0 is usual); with --mixup-alpha, each batch gets one of the two")
    augment.add_argument("--label-smoothing", type=finite_float, default=0.0, metavar="S", help="cross-entropy against 1 - S on the true class and S spread over all classes (0.1 is usual)")

    imbalance = parser.add_argument_group("imbalanced classes")
    imbalance.add_argument("--class-weights", default="none", choices=["none", "balanced"], help="balanced: weigh each class's loss by n_images / (n_classes x its training images)")
    imbalance.add_argument("--sampler", default="shuffle", choices=["shuffle", "balanced"], help="balanced: draw training images with replacement so that every class is equally likely (the same draws on every rank and on resume)")

    optim = parser.add_argument_group("optimisation")
    optim.add_argument("--epochs", type=int, default=30, help="number of epochs (counted from 0)")
    optim.add_argument("--batch-size", type=int, default=16, help="images per step per process")
    optim.add_argument("--lr", type=finite_float, default=0.001, help="initial learning rate" + (" for one process (multiplied by the world size unless --no-scale-lr)" if distributed else ""))
    optim.add_argument("--opt", default="sgd", choices=["sgd", "adamw"], help="optimizer: SGD with momentum, or AdamW")
    optim.add_argument("--lr-scheduler", default="cosine", choices=["cosine", "step"], help="after the warm-up: cosine from --lr to --lr x --lrf, or steps of x --lr-gamma every --lr-step-size epochs")
    optim.add_argument("--lrf", type=finite_float, default=0.1, help="final learning rate as a fraction of --lr (cosine schedule)")
    optim.add_argument("--lr-step-size", type=int, default=30, metavar="N", help="step schedule: multiply the rate by --lr-gamma every N epochs")
    optim.add_argument("--lr-gamma", type=finite_float, default=0.1, help="step schedule: the factor of each step")
    optim.add_argument("--warmup-epochs", type=int, default=0, help="epochs of linear learning-rate warm-up before the schedule")
    optim.add_argument("--momentum", type=finite_float, default=0.9, help="SGD momentum")
    optim.add_argument("--weight-decay", type=finite_float, default=None, help="weight decay (default: 0.005 for SGD, 0.05 for AdamW)")
    optim.add_argument("--norm-bias-decay", action=argparse.BooleanOptionalAction, default=True, help="weight decay on normalisation layers and biases too; --no-norm-bias-decay leaves them out, as for transformers and modern recipes")
    optim.add_argument("--model-ema", action="store_true", help="keep an exponential moving average of the weights, evaluate it every epoch; model-best.pth is the better of the two")
    optim.add_argument("--model-ema-decay", type=finite_float, default=0.9998, metavar="D", help="EMA decay per optimizer step (warmed up: min(D, (1 + n) / (10 + n)) after n updates)")
    optim.add_argument("--seed", type=int, default=0, help="seed of the split, the initial weights, the data order and the augmentations")
    if distributed:
        optim.add_argument("--scale-lr", action=argparse.BooleanOptionalAction, default=True, help="multiply --lr by the world size (linear scaling rule)")

    speed = parser.add_argument_group("speed")
    speed.add_argument("--amp", default="auto", choices=["auto", "bf16", "fp16", "off"], help="mixed precision: auto picks bf16 on GPUs and CPUs that run it natively (Ampere+, AMX/AVX512-BF16), fp16 with loss scaling on older GPUs, off (fp32) elsewhere")
    speed.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None, help="NHWC memory format for model and images (default: on for convolutional nets on CPU and CUDA)")
    speed.add_argument("--compile", action="store_true", help="torch.compile the model (the first steps take a while to compile; checkpoints stay plain)")
    speed.add_argument("--accum-steps", type=int, default=1, metavar="N", help="gradient accumulation: one optimizer step every N batches (effective batch = batch size x N x world size)")
    speed.add_argument("--clip-grad", type=finite_float, default=None, metavar="NORM", help="clip the gradient norm to NORM before each optimizer step (default: no clipping)")
    speed.add_argument("--grad-checkpoint", action="store_true", help="activation checkpointing over the model's stages: less memory, about a third more compute")
    speed.add_argument("--print-freq", type=int, default=20, metavar="N", help="update the progress bar's loss every N steps (reading the loss waits for the device)")

    run = parser.add_argument_group("run")
    run.add_argument("--threads", type=int, default=None, metavar="N", help="CPU threads per process for torch (default: this process's share of the cores); fewer leave room for others on a shared machine")
    run.add_argument("--device", default="auto", help="auto (cuda if available, else mps, else cpu), cpu, cuda, cuda:N or mps")
    run.add_argument("--output-dir", default="weights", help="where model-{epoch}.pth, metrics.csv, args.json and class_indices.json go")
    run.add_argument("--log-dir", default="runs", help="TensorBoard logs go into a sub-folder named after the output dir and the start time")
    run.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True, help="draw class_distribution.png, batch_preview.png, curves.png and confusion_matrix.png (and log them to TensorBoard)")
    run.add_argument("--overwrite", action="store_true", help="replace the files of an earlier run in --output-dir")
    run.add_argument("--resume", default=None, metavar="PATH|auto", help="continue from a checkpoint.pth; auto: from <output-dir>/checkpoint.pth if there is one, else start fresh (default: none)")
    run.add_argument("--keep-last", type=int, default=1, metavar="K", help="keep the last K model-{epoch}.pth files; 0 keeps every epoch's (model-best.pth and checkpoint.pth always stay; default: 1, the last epoch's)")
    run.add_argument("--best-metric", default="accuracy", choices=["accuracy", "balanced_accuracy", "macro_f1", "loss"], help="validation metric that picks model-best.pth (and --patience's improvement); loss: the lowest")
    run.add_argument("--patience", type=int, default=0, metavar="N", help="stop early after N epochs without a better --best-metric (0: never; the checkpoint records it, --resume auto then finds the run complete)")
    run.add_argument("--eval-only", action="store_true", help="only evaluate --weights (a model-*.pth or a checkpoint.pth) on the validation split and print per-class accuracy, precision, recall and F1, balanced accuracy, macro-F1, top-5 and top-1 accuracy; writes nothing unless --eval-output")
    run.add_argument("--eval-output", default=None, metavar="DIR", help="with --eval-only: write confusion_matrix.png, confusion_matrix.csv, overall_metrics.csv (top-1, top-5, balanced accuracy, macro-F1) and per_class_metrics.csv (precision, recall, F1) into DIR")

    if distributed:
        ddp = parser.add_argument_group("distributed")
        ddp.add_argument("--sync-bn", "--syncBN", action=argparse.BooleanOptionalAction, default=None, help="SyncBatchNorm: BatchNorm statistics over all GPUs, for small per-GPU batches (under ~16 images); each layer adds a collective to every forward (default: off; GPUs only)")
        ddp.add_argument("--dist-backend", default=None, choices=["nccl", "gloo", "mpi"], help="process group backend (default: nccl on GPUs, gloo on CPUs)")
        ddp.add_argument("--dist-url", default="env://", help="process group init method; env:// reads MASTER_ADDR/MASTER_PORT as set by torchrun")
        ddp.add_argument("--dist-timeout", type=int, default=1800, help="seconds a collective may wait for a missing rank before the job fails")
        ddp.add_argument("--local-rank", "--local_rank", type=int, default=None, help="set by torch.distributed.launch (default: none); the LOCAL_RANK variable wins")
        ddp.add_argument("--spawn", type=int, default=0, metavar="N", help="start N local processes with torch.multiprocessing.spawn instead of using torchrun (default: 0, off)")
    else:
        parser.add_argument_group("multi-GPU").add_argument("--data-parallel", action="store_true", help="nn.DataParallel over all visible GPUs (DDP via train_multi_gpu.py is faster)")
    return parser


def given_on_command_line(parser, argv):
    """Names (dests) of the flags the user actually typed."""
    saved = {action.dest: action.default for action in parser._actions}
    try:
        for action in parser._actions:
            action.default = argparse.SUPPRESS
        return set(vars(parser.parse_args(argv)))
    finally:
        for action in parser._actions:
            action.default = saved[action.dest]


def parse_args(parser, argv=None):
    """Parse flags and fill in --demo's defaults and --eval-only's run settings."""
    args = parser.parse_args(argv)
    given = given_on_command_line(parser, argv)
    if args.demo:
        for key, value in DEMO_DEFAULTS.items():
            if key not in given:
                setattr(args, key, value)
    if args.eval_only:
        if not args.weights:
            raise UserError("--eval-only needs --weights PATH (e.g. weights/model-best.pth)")
        take_run_settings(args, given)
    if args.weight_decay is None:  # each optimizer's usual value
        args.weight_decay = 0.05 if args.opt == "adamw" else 0.005
    check_numbers(args)
    check_recipe_numbers(args)
    check_data_flags(args, given)
    return args


def take_run_settings(args, given):
    """For --eval-only: model, image size, data and split of the run that wrote --weights
    (its args.json), unless given on the command line."""
    run_dir = os.path.dirname(os.path.abspath(args.weights))
    run_args = read_run_args(run_dir)
    if run_args is None:
        return
    taken = RUN_SETTINGS + (DATA_FLAGS if not given & set(DATA_FLAGS) else ())
    for key in taken:
        if key not in given and key in run_args:
            setattr(args, key, run_args[key])
    for key in DATA_FLAGS:
        path = getattr(args, key, None)
        if key not in given and path and not os.path.exists(path):
            raise UserError(f"--{key.replace('_', '-')} {path} (from {os.path.join(run_dir, 'args.json')}) is not "
                            f"there any more; give --{key.replace('_', '-')}")


def check_numbers(args):
    """Flags that must be positive."""
    for flag in ("epochs", "batch_size", "img_size"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    if getattr(args, "dist_timeout", 1) < 1:
        raise UserError(f"--dist-timeout {args.dist_timeout}: must be at least 1 second")
    if args.keep_last < 0:
        raise UserError(f"--keep-last {args.keep_last}: must be 0 (keep all) or more")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads {args.threads}: must be at least 1")
    if args.eval_output and not args.eval_only:
        raise UserError("--eval-output is for --eval-only; a training run writes its confusion matrix to --output-dir")
    if args.eval_output and os.path.exists(args.eval_output) and not os.path.isdir(args.eval_output):
        raise UserError(f"--eval-output {args.eval_output}: is a file; give a folder")
    if args.download and args.demo:
        raise UserError("--download and --demo do not go together: --demo generates its own data")
    if args.resume and args.eval_only:
        raise UserError("--resume and --eval-only do not go together; evaluate a checkpoint with --weights")
    if args.workers is not None and args.workers < 0:
        raise UserError(f"--workers {args.workers}: must be 0 (load in the main process) or more")
    for flag in ("accum_steps", "print_freq"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    if getattr(args, "data_parallel", False) and args.compile:
        raise UserError("--compile with --data-parallel: DataParallel's replicas would all run the GPU 0 copy; "
                        "use torchrun train_multi_gpu.py --compile (DDP) instead")
    if args.clip_grad is not None and args.clip_grad <= 0:
        raise UserError(f"--clip-grad {args.clip_grad}: must be positive (leave it out for no clipping)")
    if args.lr <= 0:
        raise UserError(f"--lr {args.lr}: must be positive")
    for flag in ("lrf", "momentum", "weight_decay", "warmup_epochs"):
        if getattr(args, flag) < 0:
            raise UserError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must not be negative")
    if args.momentum >= 1:
        raise UserError(f"--momentum {args.momentum}: must be below 1 (at 1 or more the updates grow without end)")


def check_recipe_numbers(args):
    """The augmentation, EMA, schedule and early-stopping flags: in their ranges."""
    for flag, low, high in (("random_erase", 0, 1), ("label_smoothing", 0, 1)):
        value = getattr(args, flag)
        if not low <= value <= high or (flag == "label_smoothing" and value == 1):
            raise UserError(f"--{flag.replace('_', '-')} {value}: must be from 0 to 1"
                            + (" (below 1)" if flag == "label_smoothing" else ""))
    for flag in ("mixup_alpha", "cutmix_alpha"):
        if getattr(args, flag) < 0:
            raise UserError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must not be negative (0: off)")
    if not 0 < args.model_ema_decay < 1:
        raise UserError(f"--model-ema-decay {args.model_ema_decay}: must be above 0 and below 1 (e.g. 0.9998)")
    if args.val_resize_size is not None and args.val_resize_size < args.img_size:
        raise UserError(f"--val-resize-size {args.val_resize_size}: must be at least --img-size {args.img_size} "
                        "(the center crop is taken from the resized image)")
    if args.lr_step_size < 1:
        raise UserError(f"--lr-step-size {args.lr_step_size}: must be at least 1 epoch")
    if args.lr_gamma <= 0:
        raise UserError(f"--lr-gamma {args.lr_gamma}: must be positive")
    if args.patience < 0:
        raise UserError(f"--patience {args.patience}: must be 0 (never stop early) or more")


def check_data_flags(args, given=()):
    """Class folders (--data-path, --val-path) or label files (--train-list, --val-list): not both."""
    if args.train_list and "data_path" in given:
        raise UserError("--data-path with --train-list: the label file says where the images are; drop --data-path")
    if args.val_list and not args.train_list:
        raise UserError("--val-list needs --train-list (the training images and their classes)")
    if args.train_list and args.val_path:
        raise UserError("--val-path is for class folders; with --train-list give the validation images as --val-list")
    if args.train_list and (args.demo or args.download):
        raise UserError(f"--train-list with --{'demo' if args.demo else 'download'}: those make class folders; "
                        "drop one of them")


def add_trained_model_flags(parser):
    """--weights, --model, --img-size, --class-indices: the flags of predict.py and export.py."""
    parser.add_argument("--weights", required=True, help="model-best.pth, model-{epoch}.pth or checkpoint.pth of a run")
    parser.add_argument("--model", default=None, help="model name (default: from args.json beside the weights)")
    parser.add_argument("--img-size", type=int, default=None, help="image size (default: from args.json beside the weights)")
    parser.add_argument("--val-resize-size", type=int, default=None, metavar="N", help="shorter side resized to N before the center crop (default: from args.json beside the weights, else round(img-size x 256/224))")
    parser.add_argument("--class-indices", default=None, help="class_indices.json (default: the one beside the weights)")
