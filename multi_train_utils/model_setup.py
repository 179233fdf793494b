"""The engine's side of the model: made ready to train, its weights, its EMA and its speed.

``build_model`` checks the input size, loads weights and freezes layers; also SyncBatchNorm,
and the wrappers (DDP, DataParallel, autocast, compile) and their removal. Weights files are
read safely; --model-ema keeps an average of the weights; --amp, channels_last,
--grad-checkpoint and --compile set how fast it runs.
"""
import contextlib
import copy
import functools
import math
import os
import re
from dataclasses import dataclass
from typing import Callable

import torch
import torchvision
from torch import nn
from torch.utils.checkpoint import checkpoint

from multi_train_utils.distributed_utils import get_world_size, is_main_process
from multi_train_utils.errors import UserError
from multi_train_utils.files import safe_load


# --- Weights files: read safely and loaded into a model ---------------------------------------
# A file of weights, or torchvision's pretrained weights by name; loaded by matching tensors by
# name and shape, or strictly.

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
    --freeze-layers, moved to ``device``; what it tells, rank 0 prints. ``batch_size``:
    the images of a process's step; each BatchNorm sees that many, times the world size where
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


# --- An exponential moving average (EMA) of the model's weights (--model-ema) -----------------
# After every optimizer step each averaged tensor moves towards the model's:
# ``ema = d * ema + (1 - d) * weight``, with the decay warmed up as
# ``d = min(--model-ema-decay, (1 + n) / (10 + n))`` after ``n`` updates, so that the first
# steps, whose weights are still random, are soon forgotten. Parameters and BatchNorm's running
# statistics are averaged (integer buffers, such as the count of batches seen, are copied).
#
# Under DDP the parameters are the same on every rank, so their average is too; running
# statistics differ per rank, and ``train_eval_utils.evaluate`` gives every rank rank 0's
# before each evaluation (so the evaluated, saved and resumed EMA is rank 0's, on every rank).

class ModelEma:
    """The EMA copy of ``model`` (its plain module, in eval mode, without gradients)."""

    def __init__(self, model, decay):
        self.module = copy.deepcopy(unwrap_model(model)).eval().requires_grad_(False)
        self.decay = decay
        self.updates = 0  # optimizer steps averaged so far
        self._averaged, self._copied = _split(self.module)

    def current_decay(self):
        """The decay of the next update: --model-ema-decay, lower during the warm-up."""
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self, model):
        """Move the average one step towards ``model``'s current weights."""
        decay = self.current_decay()
        current, current_copied = _split(unwrap_model(model))
        torch._foreach_lerp_(self._averaged, current, 1.0 - decay)
        for mine, theirs in zip(self._copied, current_copied):
            mine.copy_(theirs)
        self.updates += 1

    def state_dict(self):
        """What a checkpoint keeps: the averaged weights and the number of updates."""
        return {"weights": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state):
        self.module.load_state_dict(state["weights"])
        self.updates = int(state["updates"])


def _split(module):
    """(floating-point parameters and buffers, the other buffers) of ``module``, in a fixed order."""
    tensors = list(module.parameters()) + list(module.buffers())
    return [t for t in tensors if t.is_floating_point()], [t for t in tensors if not t.is_floating_point()]


def make_model_ema(model, recipe):
    """The ModelEma of ``recipe``'s --model-ema (with --model-ema-decay), or None without it."""
    return ModelEma(model, recipe.model_ema_decay) if recipe.model_ema else None


# --- Speed settings: mixed precision, channels_last, activation checkpointing, torch.compile ---
# Each is chosen per device so that the default is the fast one; the flags override it.

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """The autocast mode of a run: "bf16", "fp16" (with a GradScaler) or "off" (fp32)."""

    mode: str
    device_type: str
    reason: str = ""

    def autocast(self):
        """Context manager for forward passes (and the loss) in this precision."""
        if self.mode == "off":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=AMP_DTYPES[self.mode])

    def grad_scaler(self):
        """A GradScaler: active for fp16 only (bf16 has fp32's range and needs none)."""
        return torch.amp.GradScaler(self.device_type, enabled=self.mode == "fp16")

    def describe(self):
        return self.mode + (f" ({self.reason})" if self.reason else "")


def cpu_runs_bf16_natively():
    """True on CPUs with AMX or AVX512-BF16 instructions, where oneDNN runs bf16 convolutions
    and matmuls 2-3x faster than fp32; elsewhere bf16 is emulated and slower."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks)


def cuda_runs_bf16_natively(device):
    """True on GPUs with bf16 tensor cores (compute capability 8.0, Ampere, and newer)."""
    return torch.cuda.get_device_capability(device)[0] >= 8


def choose_precision(requested, device):
    """Turn ``--amp`` (auto, bf16, fp16, off) into a Precision for ``device``.

    auto: bf16 where the device runs it natively (Ampere+ GPUs; CPUs with AMX or
    AVX512-BF16), fp16 with loss scaling on older GPUs, fp32 elsewhere (other CPUs, MPS).
    """
    kind = device.type
    if requested == "auto":
        if kind == "cuda":
            if cuda_runs_bf16_natively(device):
                return Precision("bf16", kind, "auto: GPU with bf16 tensor cores")
            return Precision("fp16", kind, "auto: GPU without bf16, fp16 with loss scaling")
        if kind == "cpu" and cpu_runs_bf16_natively():
            return Precision("bf16", kind, "auto: CPU with AMX/AVX512-BF16")
        return Precision("off", kind, f"auto: no fast half precision on this {kind.upper()}")
    if requested == "off":
        return Precision("off", kind)
    if requested == "bf16" and kind == "cuda" and not cuda_runs_bf16_natively(device):
        raise UserError(f"--amp bf16: {torch.cuda.get_device_name(device)} has no bf16 support; "
                        "use --amp fp16 or --amp auto")
    if requested == "fp16" and kind == "cpu":
        raise UserError("--amp fp16 on a CPU: CPUs have no fast fp16; use --amp bf16, off or auto")
    return Precision(requested, kind)


def configure_backends(device):
    """Fast kernels on CUDA: cuDNN picks the best convolution for each input shape (the shapes
    are fixed here), and fp32 matmuls/convolutions may use TF32 tensor cores."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def is_conv_net(model):
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def wants_channels_last(requested, model, device):
    """``--channels-last`` as given, else on for convolutional nets on CPUs and CUDA GPUs."""
    if requested is not None:
        return requested
    return device.type in ("cpu", "cuda") and is_conv_net(model)


# --- Activation checkpointing ---------------------------------------------------------------

def model_stages(model):
    """The blocks to checkpoint: ResNet's layer1-4, the blocks inside ``features`` (DenseNet,
    MobileNet, EfficientNet, ConvNeXt, Swin), RegNet's trunk, ViT's encoder layers.

    Only blocks (modules with sub-modules and parameters) count: checkpointing single layers
    saves no memory, and an in-place ReLU on its own cannot be recomputed.
    """
    if all(hasattr(model, f"layer{i}") for i in range(1, 5)):
        return [(f"layer{i}", getattr(model, f"layer{i}")) for i in range(1, 5)]
    for path in ("features", "trunk_output", "encoder.layers"):
        container = model
        for name in path.split("."):
            container = getattr(container, name, None)
        if isinstance(container, nn.Sequential):
            return [(f"{path}.{name}", child) for name, child in container.named_children()
                    if any(True for _ in child.children()) and any(True for _ in child.parameters())]
    return []


@contextlib.contextmanager
def _batch_norm_statistics_kept(module):
    """While a checkpointed block is recomputed in backward, its BatchNorms update their
    running statistics a second time; put back what the first forward left."""
    norms = [m for m in module.modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats]
    saved = [[buffer.clone() for buffer in m.buffers(recurse=False)] for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, buffers in zip(norms, saved):
                for buffer, value in zip(m.buffers(recurse=False), buffers):
                    buffer.copy_(value)


@functools.lru_cache(maxsize=None)
def _checkpointed_class(cls):
    """A subclass of ``cls`` whose forward saves only its input and recomputes the rest in
    backward. Swapping the class (not wrapping the module) keeps the state_dict keys."""

    def forward(self, *inputs):
        if not torch.is_grad_enabled():  # evaluation: nothing to save anyway
            return cls.forward(self, *inputs)
        if torch.compiler.is_compiling():  # the compiler recomputes without mutating buffers again
            return checkpoint(cls.forward, self, *inputs, use_reentrant=False)
        return checkpoint(cls.forward, self, *inputs, use_reentrant=False,
                          context_fn=lambda: (contextlib.nullcontext(), _batch_norm_statistics_kept(self)))

    return type(f"Checkpointed{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__})


def enable_grad_checkpoint(model, model_name="the model"):
    """Activation checkpointing over the model's stages: less memory, one more forward pass.
    Returns the names of the checkpointed stages."""
    stages = model_stages(model)
    if not stages:
        raise UserError(f"--grad-checkpoint: no blocks to checkpoint in {model_name}; "
                        "use a ResNet, DenseNet, MobileNet, EfficientNet, ConvNeXt, RegNet, Swin or ViT")
    for _, stage in stages:
        stage.__class__ = _checkpointed_class(type(stage))
    return [name for name, _ in stages]


def optimize_model(model, speed, device, precision=None, *, model_name="the model", data_parallel=False):
    """``speed``'s channels_last, --grad-checkpoint and --compile (and train_single.py's
    ``data_parallel``) on a model already on ``device``; what it tells, rank 0 prints.
    ``model_name``: --model, for --grad-checkpoint's stages.

    Returns ``(model, channels_last)``: the model to train, and whether it (and so its input)
    is in channels_last. Compile comes last, on the plain module (as in nanoGPT); checkpoints
    are still saved from the plain module, without prefixes.
    """
    verbose = is_main_process()
    channels_last = wants_channels_last(speed.channels_last, model, device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if speed.grad_checkpoint:
        stages = enable_grad_checkpoint(model, model_name)
        if verbose:
            print(f"grad-checkpoint: recomputing {', '.join(stages)} in backward", flush=True)
    if speed.compile:
        model = torch.compile(model)
    if data_parallel:
        model = wrap_data_parallel(model, device, precision)
    return model, channels_last


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
