"""The model and how it learns: a torchvision classifier, the loss, the optimizer and the schedule."""
import math
import os
import re

import torch
import torchvision
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from multi_train_utils.errors import UserError
from multi_train_utils.files import safe_load
from multi_train_utils.process import get_world_size, is_main_process

HEAD_NAMES = ("fc", "classifier", "heads", "head")  # what torchvision calls a classifier head


def create_model(name="resnet34", num_classes=5):
    """Any torchvision classification model by name (resnet34, resnet101, efficientnet_b0, ...)."""
    available = torchvision.models.list_models(module=torchvision.models)
    if name not in available:
        resnets = ", ".join(n for n in available if n.startswith("resnet"))
        raise UserError(f"--model {name}: not a torchvision classification model; try {resnets}, or one of "
                        f"torchvision.models.list_models()")
    kwargs = {"num_classes": num_classes}
    if name in ("googlenet", "inception_v3"):
        kwargs.update(aux_logits=False, init_weights=True)
    return torchvision.models.get_model(name, weights=None, **kwargs)


# ---------------------------------------------------------------------------------------------
# How it learns: the loss, the optimizer and the learning-rate schedule. Each takes the flags
# (``args``) and what it builds on; edit them for your own.


def create_loss(args, class_weights=None):
    """The training loss: cross-entropy, with --label-smoothing and --class-weights' weights
    (a tensor, one per class) where given. It takes class indices or, after MixUp/CutMix,
    soft targets (a row of class probabilities per image). Edit here for your own loss."""
    return nn.CrossEntropyLoss(weight=class_weights, label_smoothing=args.label_smoothing)


def parameter_groups(model, decay_norm_and_bias=True):
    """The trainable parameters as optimizer groups: one, or with ``decay_norm_and_bias``
    False two, the second (biases and normalisation layers' weights: every tensor of one
    dimension) without weight decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    if decay_norm_and_bias:
        return [{"params": params}]
    groups = [{"params": [p for p in params if p.ndim > 1]},
              {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def create_optimizer(model, args):
    """--opt sgd (momentum, weight decay) or adamw over the trainable parameters, with no
    weight decay on norm layers and biases under --no-norm-bias-decay, at --lr (times the
    world size under DDP's --scale-lr). Edit here for your own optimizer."""
    lr = args.lr * get_world_size() if getattr(args, "scale_lr", False) else args.lr
    groups = parameter_groups(model, args.norm_bias_decay)
    if args.opt == "adamw":
        return torch.optim.AdamW(groups, lr=lr, weight_decay=args.weight_decay)
    return torch.optim.SGD(groups, lr=lr, momentum=args.momentum, weight_decay=args.weight_decay)


def create_lr_scheduler(optimizer, args, batches_per_epoch, start_epoch=0):
    """Per-optimizer-step schedule (one step per --accum-steps batches): linear warm-up over --warmup-epochs, then --lr-scheduler: cosine
    from lr down to lr * --lrf at the end of the last epoch, or step: lr * --lr-gamma ** k in
    the k-th period of --lr-step-size epochs after the warm-up. It is a function of the step
    alone, so ``start_epoch`` > 0 starts it at that epoch's first step (resume): the rate is
    then what this schedule gives there, for the current number of steps per epoch (world
    size) and --epochs. Edit here for your own schedule."""
    epochs, warmup_epochs, lrf = args.epochs, args.warmup_epochs, args.lrf
    schedule, step_size, gamma = args.lr_scheduler, args.lr_step_size, args.lr_gamma
    steps_per_epoch = optimizer_steps_per_epoch(batches_per_epoch, args.accum_steps)
    total = max(1, epochs * steps_per_epoch)
    warmup = min(total, warmup_epochs * steps_per_epoch)

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "step":
            return gamma ** ((step - warmup) // (step_size * steps_per_epoch))
        progress = (step - warmup) / max(1, total - warmup)
        return lrf + (1 - lrf) * (1 + math.cos(math.pi * min(1.0, progress))) / 2

    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
    return LambdaLR(optimizer, factor, last_epoch=start_epoch * steps_per_epoch - 1)


def optimizer_steps_per_epoch(batches, accum_steps):
    """Optimizer steps in an epoch of ``batches`` micro-batches (a short last group counts)."""
    return math.ceil(batches / accum_steps)


# ---------------------------------------------------------------------------------------------
# The engine's side of the model: autocast, weights, frozen layers, checks.


class AutocastModule(nn.Module):
    """Runs ``module``'s forward under ``autocast()`` (a Precision's) in whichever thread calls
    it. DataParallel runs each replica in a thread of its own, where autocast (thread-local)
    would otherwise be re-entered with the device's default dtype: fp16 on CUDA, even for bf16."""

    def __init__(self, module, autocast):
        super().__init__()
        self.module = module
        self.autocast = autocast

    def forward(self, *args, **kwargs):
        with self.autocast():
            return self.module(*args, **kwargs)


def unwrap_model(model):
    """The plain module inside DDP / DataParallel / AutocastModule / torch.compile wrappers."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel, AutocastModule)):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def plain_state_dict(model):
    """The model's weights without ``module.`` or ``_orig_mod.`` prefixes."""
    return unwrap_model(model).state_dict()


def _strip_prefixes(state_dict):
    pattern = re.compile(r"^(module\.|_orig_mod\.)+")
    return {pattern.sub("", k): v for k, v in state_dict.items()}


def _is_state_dict(obj):
    return isinstance(obj, dict) and obj and all(isinstance(k, str) and torch.is_tensor(v) for k, v in obj.items())


def load_state_dict_file(path, flag="--weights"):
    """Read a weights file safely (``weights_only=True``: a file that would run code is refused).

    Accepts a plain state dict or a checkpoint with a ``model`` entry. Returns a state dict
    with any ``module.``/``_orig_mod.`` prefixes removed.
    """
    obj = safe_load(path, flag, ".pth weights file (state dict)")
    if isinstance(obj, dict) and _is_state_dict(obj.get("model")):
        obj = obj["model"]
    if not _is_state_dict(obj):
        raise UserError(f"{flag} {path}: not a state dict (a dict of parameter names to tensors); "
                        "save weights with torch.save(model.state_dict(), path)")
    return _strip_prefixes(obj)


def download_torchvision_weights(model_name, weights_name, progress=True):
    """State dict of torchvision's pretrained weights ``weights_name`` (DEFAULT, IMAGENET1K_V1...)."""
    try:
        enum = torchvision.models.get_model_weights(model_name)
        weights = enum[weights_name] if weights_name != "DEFAULT" else enum.DEFAULT
    except (KeyError, ValueError):
        raise UserError(f"--weights {weights_name}: no such file, nor torchvision weights for {model_name}") from None
    try:
        return weights.get_state_dict(progress=progress)
    except Exception as e:  # URLError, timeouts, HTTP errors
        raise UserError(f"--weights {weights_name}: could not download {weights.url} ({type(e).__name__}); "
                        "offline? Download that file by hand and pass its path to --weights") from None


def read_weights(weights, model_name, progress=True):
    """Weights given by path, or by torchvision's name for the model's pretrained weights."""
    if not os.path.exists(weights) and re.fullmatch(r"[A-Z][A-Z0-9_]*", weights):
        return download_torchvision_weights(model_name, weights, progress)
    return load_state_dict_file(weights)


def load_matching_weights(model, state_dict, source="--weights"):
    """Load the tensors whose name and shape match; return the names skipped.

    This is how a 1000-class ImageNet checkpoint starts a 5-class model: everything but the
    head loads.
    """
    own = model.state_dict()
    matching = {k: v for k, v in state_dict.items() if k in own and own[k].shape == v.shape}
    if not matching:
        raise UserError(f"{source}: none of its tensors fit this model; pass the --model it was trained as")
    model.load_state_dict(matching, strict=False)
    skipped_from_file = sorted(set(state_dict) - set(matching))
    not_loaded = sorted(set(own) - set(matching))
    return skipped_from_file, not_loaded


def load_exact_weights(model, state_dict, source="--weights"):
    """Load strictly: every tensor must be there with the right shape (for evaluation)."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    wrong = sorted(k for k in set(own) & set(state_dict) if own[k].shape != state_dict[k].shape)
    if missing or unexpected or wrong:
        details = []
        if wrong:
            k = wrong[0]
            details.append(f"{k} is {tuple(state_dict[k].shape)} in the file but {tuple(own[k].shape)} in the model")
        if missing:
            details.append(f"{len(missing)} missing (e.g. {missing[0]})")
        if unexpected:
            details.append(f"{len(unexpected)} unexpected (e.g. {unexpected[0]})")
        raise UserError(f"{source} does not match this model exactly: {'; '.join(details)}; "
                        "pass the --model and --num-classes it was trained with")
    model.load_state_dict(state_dict, strict=True)


def head_name(model):
    """Name of the classifier head: the last top-level child called fc, classifier, heads or head."""
    names = [n for n, _ in model.named_children() if n in HEAD_NAMES]
    if not names:
        raise UserError("--freeze-layers: this model has no child named fc, classifier, heads or head")
    return names[-1]


def freeze_all_but_head(model):
    """Train only the classifier head; return its name. Frozen BatchNorm stays in eval mode
    (see ``set_train_mode``)."""
    head = head_name(model)
    for name, param in model.named_parameters():
        param.requires_grad_(name.split(".")[0] == head)
    return head


def set_train_mode(model):
    """``model.train()``, except normalisation layers whose weights are frozen stay in eval
    mode, so their running statistics are not updated by the new data."""
    model.train()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            params = list(module.parameters(recurse=False))
            if params and not any(p.requires_grad for p in params):
                module.eval()


def count_parameters(model, trainable_only=False):
    """Number of (trainable) parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def _pretrained_size(name):
    """The image size of torchvision's pretrained weights for model ``name`` (224 for most), or None."""
    try:
        return int(torchvision.models.get_model_weights(name).DEFAULT.transforms().crop_size[0])
    except Exception:  # no pretrained weights, or transforms of another kind
        return None


def check_input_size(name, img_size, batch_size=1, training=False, freeze_layers=False):
    """Refuse up front an image size that model ``name`` cannot take, and a training batch in
    which a BatchNorm would see one value per channel (``batch_size``: the images each
    BatchNorm sees in a step). A forward pass on the meta device: shapes only, no memory and
    no arithmetic, so it is exact and cheap."""
    if img_size == _pretrained_size(name) and not (training and batch_size == 1):
        return  # the size the model was made for
    with torch.device("meta"):
        try:
            model = create_model(name, 2)
        except NotImplementedError:  # a model whose construction computes on tensors: cannot check
            return
    fixed = getattr(model, "image_size", None)  # torchvision's ViTs: position embeddings of one size
    if isinstance(fixed, int) and fixed != img_size:
        raise UserError(f"--img-size {img_size}: {name} takes only {fixed} px images; use --img-size {fixed}")
    if freeze_layers:
        freeze_all_but_head(model)  # frozen BatchNorm stays in eval mode in training
    if training:
        set_train_mode(model)
    else:
        model.eval()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.forward = _batch_norm_shape_check(module)
    try:
        model(torch.empty(batch_size, 3, img_size, img_size, device="meta"))
    except Exception as e:
        _explain_forward_error(e, name, img_size, batch_size)


def _batch_norm_shape_check(module):
    """A BatchNorm's forward for the meta device: only the check that torch's batch_norm makes
    in training (its statistics would be computed step by step in Python there: slow)."""
    def forward(x):
        if (module.training or module.running_mean is None) and x.shape[0] * math.prod(x.shape[2:]) == 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {x.shape}")
        return x

    return forward


def _explain_forward_error(error, name, img_size, batch_size):
    """Raise a UserError for what check_input_size's forward pass met, unless it is a limit of
    the meta device (then the check is skipped)."""
    text = str(error).strip()
    if isinstance(error, NotImplementedError) or "meta" in text or not isinstance(
            error, (RuntimeError, ValueError, AssertionError, IndexError)):
        return
    if "Expected more than 1 value per channel" in text:
        raise UserError(f"--batch-size {batch_size} at --img-size {img_size}: in training, {name}'s normalisation "
                        "layers would see a single value per channel (its feature maps shrink to 1x1); use "
                        "--batch-size 2 or more, or a larger --img-size") from None
    native = _pretrained_size(name)
    hint = f"use --img-size {native} (the size of its pretrained weights)" if native else "use a larger --img-size"
    first = text.splitlines()[0] if text else type(error).__name__
    raise UserError(f"--img-size {img_size}: {name} cannot take {img_size} px images ({first}); {hint}") from None


def use_sync_bn(requested, device, distributed, compiled=False, verbose=True):
    """``--sync-bn`` resolved: off unless asked for. SyncBatchNorm computes the batch statistics
    over all GPUs, which helps when each GPU's batch is small (under ~16 images), but each of
    its layers adds a collective and a host sync to every forward. torch has it for GPUs only:
    on CPUs it stays off (with a warning)."""
    if not requested or not distributed:
        return False
    if device.type != "cuda":
        if verbose:
            print("warning: --sync-bn needs GPUs; keeping plain BatchNorm on CPU", flush=True)
        return False
    if compiled and verbose:
        print("warning: --sync-bn with --compile: the compiled graph breaks at every SyncBatchNorm layer, "
              "which costs much of what compiling gains", flush=True)
    return True


def build_model(args, num_classes, weights_state=None, device=None, norm_batch=None):
    """check_input_size + create_model + initial weights (strict for --eval-only) +
    --freeze-layers, moved to ``device``; what it tells, rank 0 prints. ``norm_batch``: the
    images each BatchNorm sees in a training step (default --batch-size, times the world size
    where --sync-bn makes SyncBatchNorm of it)."""
    verbose = is_main_process()
    if norm_batch is None:
        synced = use_sync_bn(getattr(args, "sync_bn", None), device or torch.device("cpu"), get_world_size() > 1,
                             verbose=False)
        norm_batch = args.batch_size * (get_world_size() if synced else 1)
    check_input_size(args.model, args.img_size, norm_batch, training=not args.eval_only,
                     freeze_layers=args.freeze_layers)
    model = create_model(args.model, num_classes)
    if weights_state is not None:
        if args.eval_only:
            load_exact_weights(model, weights_state, f"--weights {args.weights}")
        else:
            skipped, not_loaded = load_matching_weights(model, weights_state, f"--weights {args.weights}")
            if verbose:
                print(f"weights: loaded {len(weights_state) - len(skipped)} tensors from {args.weights}; "
                      f"skipped {skipped or 'none'}; left at random init {not_loaded or 'none'}")
    if args.freeze_layers:
        head = freeze_all_but_head(model)
        if verbose:
            print(f"freeze-layers: training only '{head}' ({count_parameters(model, True):,} parameters)")
    return model if device is None else model.to(device)
