"""Speed settings: mixed precision, channels_last, activation checkpointing, torch.compile.

Each is chosen per device so that the default is the fast one; the flags override it.
"""
import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from multi_train_utils.errors import UserError
from multi_train_utils.model_setup import AutocastModule
from multi_train_utils.process import is_main_process

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
