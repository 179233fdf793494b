"""The engine's side of the model: the user's create_model made ready to train, and its wrappers.

``build_model`` checks the input size, loads weights and freezes layers; also SyncBatchNorm,
and the wrappers (DDP, DataParallel, autocast, compile) and their removal."""
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torchvision
from torch import nn

from multi_train_utils.errors import UserError
from multi_train_utils.process import get_world_size, is_main_process
from multi_train_utils.weights import load_exact_weights, load_matching_weights

HEAD_NAMES = ("fc", "classifier", "heads", "head")  # what torchvision calls a classifier head


@dataclass(frozen=True)
class ModelSpec:
    """Which model, for which images: the user's ``create_model`` (model.py) and what it is
    called with. The entry scripts make one; predict.py and export.py make one of a run."""

    create_model: Callable  # create_model(name, num_classes, channels) -> nn.Module
    name: str  # --model
    num_classes: int
    img_size: int  # --img-size: the square side the model sees
    channels: int = 3  # of the data's images (Datasets.channels)

    def build(self):
        """A new model with random weights."""
        return self.create_model(self.name, self.num_classes, self.channels)


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


def check_input_size(spec, batch_size=1, training=False, freeze_layers=False):
    """Refuse up front an image size that the model of ``spec`` (a ModelSpec) cannot take, and
    a training batch in which a BatchNorm would see one value per channel (``batch_size``: the
    images each BatchNorm sees in a step). A forward pass on the meta device: shapes only, no
    memory and no arithmetic, so it is exact and cheap."""
    name, img_size = spec.name, spec.img_size
    if img_size == _pretrained_size(name) and not (training and batch_size == 1):
        return  # the size the model was made for
    with torch.device("meta"):
        try:
            model = spec.build()
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
        model(torch.empty(batch_size, spec.channels, img_size, img_size, device="meta"))
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


def build_model(spec, device=None, weights=None, weights_flag=None, eval_only=False, freeze_layers=False,
                batch_size=1, sync_bn=False):
    """check_input_size, then ``spec.build()`` with its initial ``weights`` (a state dict read
    from ``weights_flag``, the --weights given; loaded strictly for ``eval_only``), then
    --freeze-layers, moved to ``device``; what it tells, rank 0 prints. ``batch_size``: the
    images of a process's step; each BatchNorm sees that many, times the world size where
    ``sync_bn`` (--sync-bn) makes SyncBatchNorm of it."""
    verbose = is_main_process()
    synced = use_sync_bn(sync_bn, device or torch.device("cpu"), get_world_size() > 1, verbose=False)
    norm_batch = batch_size * (get_world_size() if synced else 1)
    check_input_size(spec, norm_batch, training=not eval_only, freeze_layers=freeze_layers)
    model = spec.build()
    if weights is not None:
        if eval_only:
            load_exact_weights(model, weights, f"--weights {weights_flag}")
        else:
            skipped, not_loaded = load_matching_weights(model, weights, f"--weights {weights_flag}")
            if verbose:
                print(f"weights: loaded {len(weights) - len(skipped)} tensors from {weights_flag}; "
                      f"skipped {skipped or 'none'}; left at random init {not_loaded or 'none'}")
    if freeze_layers:
        head = freeze_all_but_head(model)
        if verbose:
            print(f"freeze-layers: training only '{head}' ({count_parameters(model, True):,} parameters)")
    return model if device is None else model.to(device)
