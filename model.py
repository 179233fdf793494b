"""The model and how it learns: a torchvision classifier, the loss, the optimizer and the schedule."""
import math

import torch
import torchvision
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from multi_train_utils.errors import UserError
from multi_train_utils.options import task_of
from multi_train_utils.distributed_utils import get_world_size


def create_model(name, num_classes, channels=3):
    """Any torchvision classification model by name (resnet34, resnet101, efficientnet_b0, ...),
    for images of ``channels`` channels (the data's, see my_dataset.py). Edit here for your own
    model: the engine calls it as ``create_model(--model, number of classes, channels)``."""
    available = torchvision.models.list_models(module=torchvision.models)
    if name not in available:
        resnets = ", ".join(n for n in available if n.startswith("resnet"))
        raise UserError(f"--model {name}: not a torchvision classification model; try {resnets}, or one of "
                        f"torchvision.models.list_models()")
    kwargs = {"num_classes": num_classes}
    if name in ("googlenet", "inception_v3"):
        kwargs.update(aux_logits=False, init_weights=True)
    model = torchvision.models.get_model(name, weights=None, **kwargs)
    return model if channels == 3 else with_input_channels(model, channels)


def with_input_channels(model, channels):
    """``model`` with its first convolution taking ``channels`` channels instead of 3 (gray
    X-rays: 1; satellite bands: 4 or more). Pretrained --weights then load everywhere but there."""
    for parent in model.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Conv2d) and child.in_channels == 3 and child.groups == 1:
                setattr(parent, child_name, nn.Conv2d(channels, child.out_channels, child.kernel_size,
                                                      stride=child.stride, padding=child.padding,
                                                      dilation=child.dilation, bias=child.bias is not None,
                                                      padding_mode=child.padding_mode))
                return model
    raise UserError(f"{type(model).__name__} has no convolution taking 3 channels to give {channels}; edit "
                    f"model.create_model for images of {channels} channels")


# ---------------------------------------------------------------------------------------------
# How it learns: the loss, the optimizer and the learning-rate schedule. Each takes the flags
# (``args``) and what it builds on; edit them for your own.


def create_loss(args, class_weights=None):
    """The training loss: the task's (--task; task.py). Single-label: cross-entropy, with
    --label-smoothing and --class-weights' weights (a tensor, one per class) where given; it
    takes class indices or, after MixUp/CutMix, soft targets (a row of class probabilities per
    image). With --multi-label: binary cross-entropy per class on multi-hot targets,
    ``class_weights`` then each class's positive weight, smoothing toward 0.5. Edit here for
    your own loss."""
    return task_of(args).loss(class_weights, args.label_smoothing)


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
    lr = args.lr * get_world_size() if args.scale_lr else args.lr
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
