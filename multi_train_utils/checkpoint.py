"""The training state and its checkpoint: saved each epoch, found and loaded for --resume, restored.

``build_checkpoint`` is the one maker of the checkpoint's dict and ``load_checkpoint`` its one
reader (checked, and completed for checkpoints of earlier versions). The one before is kept as
checkpoint-prev.pth; restoring covers the optimizer's, the fp16 scaler's, the EMA's and the
random generators' states, the epoch and the best epoch so far."""
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from multi_train_utils.errors import UserError, one_line
from multi_train_utils.files import (MAPPING, MAPPING_OR_NULL, NUMBER, NUMBER_OR_NULL, ROWS, STATE_DICT, TENSOR_OR_NULL,
                                     TEXT, TEXT_LIST, TEXT_OR_NULL, WHOLE_NUMBER, check_fields, link_atomic, safe_load,
                                     save_atomic)
from multi_train_utils.loaders import EpochPosition


CHECKPOINT = "checkpoint.pth"
PREVIOUS_CHECKPOINT = "checkpoint-prev.pth"  # the one before, in case the newest is damaged
# What a resumed run reads from a checkpoint, and of which kind each must be.
CHECKPOINT_FIELDS = {"model": STATE_DICT, "optimizer": MAPPING, "epoch": WHOLE_NUMBER, "classes": TEXT_LIST,
                     "args": MAPPING, "metrics": ROWS, "best_accuracy": NUMBER, "best_epoch": WHOLE_NUMBER,
                     "best_confusion": TENSOR_OR_NULL, "log_dir": TEXT_OR_NULL, "world_size": WHOLE_NUMBER,
                     "scaler": MAPPING_OR_NULL, "rng": MAPPING, "model_ema": MAPPING_OR_NULL,
                     "best_value": NUMBER_OR_NULL, "best_source": TEXT, "stopped_early": TEXT_OR_NULL,
                     "best_report": MAPPING_OR_NULL, "position": MAPPING_OR_NULL, "run_seconds": NUMBER}
# Flags a resume must repeat, with the value a checkpoint without them was trained with:
# another optimizer or other parameter groups cannot take the saved optimizer state, and
# another --best-metric would compare the saved best with a different figure.
# What a checkpoint of an earlier version of this template lacks, as that version ran
# ("best_value" is then its best accuracy). An entry it has that is no longer read (its
# "lr_scheduler": the schedule is a function of the epoch) is left out when it is read.
EARLIER_CHECKPOINTS = {"best_accuracy": -1.0, "best_epoch": -1, "best_source": "model", "best_confusion": None,
                       "metrics": [], "log_dir": None, "scaler": None, "rng": {}, "model_ema": None,
                       "stopped_early": None, "file_list": None, "world_size": None, "best_report": None,
                       "position": None, "run_seconds": 0.0}
SAME_ON_RESUME = {"model": None, "freeze_layers": False, "opt": "sgd", "norm_bias_decay": True, "model_ema": False,
                  "best_metric": "accuracy", "task": "single-label"}


@dataclass
class BestEpoch:
    """The best epoch so far by --best-metric, of the model or of its EMA."""

    value: Optional[float] = None  # of --best-metric; None before the first epoch
    accuracy: float = -1.0
    epoch: int = -1
    source: str = "model"  # "model" or "ema": whose weights model-best.pth holds
    confusion: Optional[torch.Tensor] = None  # for the confusion matrix picture at the end
    report: Optional[dict] = None  # the task's own figures of the best epoch (Task.keep), for its end report

    @classmethod
    def from_checkpoint(cls, checkpoint):
        """The best epoch a checkpoint (as load_checkpoint reads it) recorded (none for None)."""
        if not checkpoint:
            return cls()
        return cls(checkpoint["best_value"], checkpoint["best_accuracy"], checkpoint["best_epoch"],
                   checkpoint["best_source"], checkpoint["best_confusion"], report=checkpoint["best_report"])


class RunClock:
    """The run's training time: the epochs' seconds (training, validation, saving) summed over
    its sessions; a session's start-up and the time between a stop and its resume not counted."""

    def __init__(self, earlier=0.0):
        self.earlier = earlier  # seconds of the sessions before this one
        self.started = None  # time.perf_counter() when this session's first epoch began

    def start(self):
        if self.started is None:
            self.started = time.perf_counter()

    def seconds(self):
        """The run's seconds so far."""
        return self.earlier + (time.perf_counter() - self.started if self.started is not None else 0.0)


@dataclass
class TrainState:
    """What training changes step by step, as one object: the model and how it learns, and
    where the run stands. A checkpoint holds all of it but the loss and the batch mixer,
    which are made anew from the flags; ``restore_training_state`` puts it back."""

    model: Any
    optimizer: Any = None
    lr_scheduler: Any = None
    scaler: Any = None  # torch.amp.GradScaler: fp16's loss scaling (a no-op otherwise)
    ema: Any = None  # ema.ModelEma (--model-ema)
    loss_function: Any = None  # model.create_loss's
    mixer: Any = None  # loaders.BatchMixer (--mixup-alpha, --cutmix-alpha)
    epoch: int = 0  # the next epoch to train: the epochs finished so far
    best: BestEpoch = field(default_factory=BestEpoch)
    stop_reason: Optional[str] = None  # why the run ends before --epochs (--patience), or None
    clock: RunClock = field(default_factory=RunClock)
    position: Any = None  # loaders.EpochPosition inside the epoch the run resumes in, or None


def build_checkpoint(state, weights, ema_state=None, *, metrics, flags, classes, file_list, world_size, log_dir,
                     position=None):
    """The checkpoint's dict (its one maker): ``state`` (a TrainState; its "epoch" is the last
    one finished; ``position``: inside the next, an EpochPosition, or None), the model's
    ``weights`` and the EMA's ``ema_state`` already copied to the CPU, the random generators'
    states, and the run's record: metrics.csv's rows, the ``flags`` (as args.json has them,
    under "args"), the classes, the data's files (``file_list``), the
    world size and the TensorBoard folder."""
    scaler, best = state.scaler, state.best
    return {"model": weights, "model_ema": ema_state, "optimizer": state.optimizer.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
            "epoch": state.epoch - 1, "best_accuracy": best.accuracy, "best_value": best.value,
            "best_epoch": best.epoch, "best_source": best.source, "best_confusion": best.confusion,
            "best_report": best.report,
            "stopped_early": state.stop_reason, "rng": rng_state(), "metrics": metrics, "args": flags,
            "classes": list(classes), "file_list": file_list, "world_size": world_size, "log_dir": log_dir,
            "position": position.to_dict() if position is not None else None,
            "run_seconds": position.run_seconds if position is not None else state.clock.seconds()}


def resumes_in(resume_path, output_dir):
    """True when the checkpoint resumed from lies in ``output_dir`` (the run continues there)."""
    return bool(resume_path) and os.path.dirname(os.path.abspath(resume_path)) == os.path.abspath(output_dir)


def rng_state():
    """Random number generator states, as tensors and plain types (weights_only loads them):
    the CPU's, Python's, and the one of the GPU this process uses ("cuda_device"), which a
    resume puts back on the GPU it uses, whatever GPUs are visible then."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_device"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def save_checkpoint(output_dir, state):
    """Write ``checkpoint.pth`` atomically, keeping the previous one as ``checkpoint-prev.pth``.

    The new checkpoint is written in full first; only then is the old one kept as previous
    and replaced. A write that fails (a full disk, a crash) leaves both files as they were."""
    path, previous = os.path.join(output_dir, CHECKPOINT), os.path.join(output_dir, PREVIOUS_CHECKPOINT)
    save_atomic(state, path, before_replace=lambda: os.path.exists(path) and link_atomic(path, previous))


def load_checkpoint(path, flag="--resume"):
    """Read a full checkpoint safely; a clear error names a bad file."""
    checkpoint = safe_load(path, flag, "checkpoint (checkpoint.pth)")
    needed = {"model", "optimizer", "epoch", "classes", "args"}
    if not isinstance(checkpoint, dict) or not needed <= set(checkpoint):
        raise UserError(f"{flag} {path}: not a full checkpoint (needs {sorted(needed)}); "
                        "to start from weights alone use --weights")
    check_fields(checkpoint, CHECKPOINT_FIELDS, f"{flag} {path}",
                 "not a checkpoint as this template writes it: resume from another, or start over with --overwrite")
    return complete_checkpoint(checkpoint)


def complete_checkpoint(checkpoint):
    """A checkpoint as this version reads it: what an earlier version's lacks filled in as that
    version ran (EARLIER_CHECKPOINTS), what is no longer read left out."""
    earlier = {**EARLIER_CHECKPOINTS, "best_value": checkpoint.get("best_accuracy", -1.0)}
    return {**earlier, **{k: v for k, v in checkpoint.items() if k != "lr_scheduler"}}


def find_resume_checkpoint(resume, output_dir, verbose=True):
    """The checkpoint to resume from, as ``(path, checkpoint)``, or ``(None, None)``.

    ``auto``: ``<output-dir>/checkpoint.pth``; if it cannot be read, ``checkpoint-prev.pth``
    with a warning; if neither exists, a fresh start. Checkpoint files that exist but none of
    which loads are an error (never a silent fresh start over finished epochs). A path: that
    file, or an error.
    """
    if not resume:
        return None, None
    if resume != "auto":
        return resume, load_checkpoint(resume)
    errors = []
    for name in (CHECKPOINT, PREVIOUS_CHECKPOINT):
        path = os.path.join(output_dir, name)
        if not os.path.exists(path):
            continue
        try:
            return path, load_checkpoint(path, flag="--resume auto:")
        except UserError as e:
            errors.append(str(e))
            if verbose:
                print(f"warning: {e}; trying the previous checkpoint", flush=True)
    if errors:
        raise UserError(f"--resume auto: no checkpoint in {output_dir} can be read ({errors[-1]}); "
                        "resume from a good copy with --resume PATH, or start over with --overwrite")
    return None, None


def set_aside_damaged_checkpoint(output_dir, resume_path):
    """After resuming from checkpoint-prev.pth (checkpoint.pth could not be read), rename the
    damaged checkpoint.pth to checkpoint.pth.damaged: it must never become "previous"."""
    if resume_path and resume_path.endswith(PREVIOUS_CHECKPOINT) and resumes_in(resume_path, output_dir):
        damaged = os.path.join(output_dir, CHECKPOINT)
        if os.path.exists(damaged):
            os.replace(damaged, damaged + ".damaged")


def check_resume_compatible(checkpoint, path, flags, classes, epochs):
    """The checkpoint must be of the same classes, and of the same ``flags`` (options.Config's,
    as args.json keeps them) of SAME_ON_RESUME (model, frozen layers, optimizer and its
    parameter groups, EMA, --best-metric)."""
    if list(checkpoint["classes"]) != list(classes):
        raise UserError(f"--resume {path}: trained on classes {checkpoint['classes']}, but --data-path has "
                        f"{classes}; resume with the same class folders or start a new --output-dir")
    current = flags
    for flag, old_default in SAME_ON_RESUME.items():
        value = checkpoint["args"].get(flag, current[flag] if old_default is None else old_default)
        if value != current[flag]:
            raise UserError(f"--resume {path}: trained with {describe_flag(flag, value)}, this run has "
                            f"{describe_flag(flag, current[flag])}; resume with the same, or start a new "
                            "--output-dir")
    if int(checkpoint["epoch"]) + 1 > epochs:
        raise UserError(f"--resume {path}: already trained {int(checkpoint['epoch']) + 1} epochs, more than "
                        f"--epochs {epochs}; raise --epochs to train more")


def describe_flag(flag, value):
    """How a flag and its value are typed: --opt sgd, --model-ema, --no-model-ema."""
    name = flag.replace("_", "-")
    if isinstance(value, bool):
        return f"--{name}" if value else f"--no-{name}" if flag in ("norm_bias_decay", "freeze_layers") else \
            f"no --{name}"
    return f"--{name} {value}"


def restore_training_state(state, checkpoint):
    """Load the optimizer's, the fp16 GradScaler's, the EMA's and the RNG states of
    ``checkpoint`` (None: a fresh start) into ``state``, with the epoch to continue with and
    the best epoch so far; return that epoch.

    The learning rate is this run's (--lr, for the current world size) rather than the
    checkpoint's, and so is the weight decay of each group; the scheduler is then created at
    the checkpoint's epoch.
    """
    if checkpoint is None:
        return state.epoch
    optimizer, scaler, ema = state.optimizer, state.scaler, state.ema
    base_lrs = [group["lr"] for group in optimizer.param_groups]
    weight_decays = [group["weight_decay"] for group in optimizer.param_groups]
    try:
        optimizer.load_state_dict(checkpoint["optimizer"])
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"--resume: the checkpoint's optimizer state does not fit this model ({e})") from None
    for group, base_lr, weight_decay in zip(optimizer.param_groups, base_lrs, weight_decays):
        group["lr"] = group["initial_lr"] = base_lr
        group["weight_decay"] = weight_decay
    if ema is not None:
        try:
            ema.load_state_dict(checkpoint["model_ema"])
        except (KeyError, TypeError, RuntimeError) as e:
            raise UserError(f"--resume: the checkpoint's EMA weights do not fit this model ({one_line(e)}); "
                            "resume from another checkpoint, or start over with --overwrite") from None
    if scaler is not None and scaler.is_enabled() and checkpoint["scaler"]:
        scaler.load_state_dict(checkpoint["scaler"])  # else (another --amp before) it starts afresh
    try:
        restore_rng(checkpoint["rng"] or {})
    except (TypeError, ValueError, RuntimeError) as e:
        raise UserError(f"--resume: the checkpoint's random generator states cannot be restored ({e}); "
                        "resume from another checkpoint, or start over with --overwrite") from None
    state.epoch, state.best = int(checkpoint["epoch"]) + 1, BestEpoch.from_checkpoint(checkpoint)
    state.position = EpochPosition.from_dict(checkpoint["position"])  # saved inside the epoch: goes on there
    state.clock = RunClock(float(checkpoint["run_seconds"]))
    return state.epoch


def restore_rng(rng):
    """The random generators' states as rng_state saved them."""
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "python" in rng:
        random.setstate(_as_tuple(rng["python"]))
    if "cuda_device" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda_device"], torch.cuda.current_device())
    elif "cuda" in rng and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng["cuda"])  # a checkpoint of an earlier version: every visible GPU's


def _as_tuple(value):
    """random.setstate wants tuples all the way down (a round trip may give lists)."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value
