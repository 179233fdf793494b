"""The training and evaluation loops: train_one_epoch, evaluate, and the hook around the steps.

The loop does the step and reads the loss every few steps; ``StepHook`` is what it calls
after each step, the run's being ``MidEpochCheckpoints``: a checkpoint inside the epoch every
--checkpoint-every minutes, and a save and stop at a preemption notice.
"""
import contextlib
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from multi_train_utils.checkpoint import restore_rng, rng_state
from multi_train_utils.datasets import images_info
from multi_train_utils.distributed_utils import (all_gather_rows, all_reduce_sum, broadcast_buffers, gather_objects,
                                                 get_rank, get_world_size, is_main_process, reduce_value)
from multi_train_utils.errors import MidRunError, Preempted, UserError, notice_received
from multi_train_utils.images import DeviceNormalizer, IMAGENET_MEAN, IMAGENET_STD
from multi_train_utils.loaders import MIN_IMAGES_PER_RANK
from multi_train_utils.model_setup import Precision, set_train_mode
from multi_train_utils.single_label import SingleLabel
from multi_train_utils.task import Task


# Steps at the start of an epoch left out of its images/s: worker start-up, first kernels.
WARMUP_STEPS = 2


class NonFiniteLossError(UserError):
    """The training loss became NaN or infinite; raised on every rank at the same step."""


@dataclass
class TrainStats:
    """What one training epoch did, summed over all ranks."""

    mean_loss: float  # mean over steps of the loss averaged across ranks
    images: int  # training images processed by all ranks
    seconds: float
    last_lr: float  # learning rate of the epoch's last optimizer step
    images_per_second: float  # all ranks together, after the first WARMUP_STEPS steps
    earlier_seconds: float = 0.0  # of this epoch, before a resume inside it


@dataclass
class LoopSettings:
    """How batches go through the model; the same for training and evaluation."""

    precision: Precision = field(default_factory=lambda: Precision("off", "cpu"))
    channels_last: bool = False
    accum_steps: int = 1  # micro-batches per optimizer step
    clip_grad: Optional[float] = None  # max gradient norm
    print_freq: int = 20  # steps between loss updates of the progress bar (each is a host sync)
    mean: Optional[Sequence[float]] = IMAGENET_MEAN  # the data's, per channel (None: images used as they come)
    std: Optional[Sequence[float]] = IMAGENET_STD
    task: Task = field(default_factory=SingleLabel)  # what evaluation counts (task.py)

    @classmethod
    def from_config(cls, config, precision, channels_last, data=None, task=None):
        """``config``'s (options.Config) speed settings, with the precision and memory format
        chosen for the device, the normalisation of ``data`` (a Datasets; default ImageNet's)
        and ``task`` (default single-label). --eval-only evaluates as the run that wrote
        --weights left the task (a multi-label run: at its thresholds.json, as predict.py does)."""
        _, mean, std = images_info(data) if data is not None else (3, IMAGENET_MEAN, IMAGENET_STD)
        task, speed = task or SingleLabel(), config.speed
        if config.run.eval_only and data is not None:
            task = task.read_run_files(os.path.dirname(os.path.abspath(config.recipe.weights)), data.classes)
        return cls(precision, channels_last, speed.accum_steps, speed.clip_grad, speed.print_freq, mean=mean, std=std,
                   task=task)

    def normalizer(self, device):
        """What moves a batch to ``device`` as normalised floats, in this memory format."""
        return DeviceNormalizer(device, self.channels_last, self.mean, self.std)


def train_one_epoch(state, data_loader, device, epoch, settings=None, hook=None):
    """Train ``state``'s model (a ``checkpoint.TrainState``: model, optimizer, schedule, fp16
    scaler, EMA, loss, batch mixer, clock, and where a resumed epoch goes on) for one epoch;
    return TrainStats. With ``settings.accum_steps`` = k, k micro-batches' gradients make one
    optimizer step (DDP averages them only on the k-th, under ``no_sync`` before). The loss is
    read every ``print_freq`` steps, the one host sync, with the NaN check that stops every
    rank at once and the wishes of ``hook`` (a ``StepHook``; the run's is
    ``MidEpochCheckpoints``: a save inside the epoch, a stop at a preemption notice), which it
    acts on after the step.
    """
    settings = settings or LoopSettings()
    model, optimizer, mixer = state.model, state.optimizer, state.mixer
    scaler = state.scaler or settings.precision.grad_scaler()
    set_train_mode(model)
    loss_function = (state.loss_function or nn.CrossEntropyLoss()).to(device)  # class weights on the device
    to_device = settings.normalizer(device)
    batches, world_size = data_loader.batch_sampler, get_world_size()
    first_step, loss_sum, shown, clock = start_epoch(state, data_loader, epoch, settings, device)
    steps = first_step + len(data_loader)
    first_bad_step = torch.full((), -1, dtype=torch.int64, device=device)
    last_lr = optimizer.param_groups[0]["lr"]
    progress = tqdm(total=steps * batches.batch_size * world_size, initial=first_step * batches.batch_size * world_size,
                    unit="img", desc=f"[train epoch {epoch}]", disable=not is_main_process(), file=sys.stdout)
    hook = hook or StepHook()  # checkpoints inside the epoch and preemption notices (mid_epoch)
    hook.start_epoch()
    for step, (images, labels) in enumerate(data_loader, start=first_step):
        images, targets = to_device(images, labels)
        if mixer is not None:
            images, targets = mixer(images, targets, epoch, step)  # soft targets
        group_start = max(first_step, step - step % settings.accum_steps)
        group_size = min(settings.accum_steps, steps - group_start)
        updates_now = step == group_start + group_size - 1
        # Between optimizer steps, DDP need not average gradients: only the last backward syncs.
        no_sync = model.no_sync() if not updates_now and hasattr(model, "no_sync") else contextlib.nullcontext()
        with no_sync:
            with settings.precision.autocast():
                loss = loss_function(model(images), targets)
            scaler.scale(loss / group_size).backward()
        loss = loss.detach().float()
        loss_sum += loss
        first_bad_step = torch.where((first_bad_step < 0) & ~torch.isfinite(loss), step, first_bad_step)
        if updates_now:
            last_lr = optimizer.param_groups[0]["lr"]  # the rate this step uses
            optimizer_step(state, scaler, settings.clip_grad)
        progress.update(len(images) * world_size)
        clock.step_done(step - first_step)
        # The hook's wishes travel in the loss's all-reduce: agreed where the loss is read (a
        # single process has no other rank to agree with: at every step).
        wishes = hook.wishes()
        agreed = wishes if world_size == 1 else None
        if (step + 1) % settings.print_freq == 0 or step + 1 == steps:
            agreed = shown.update(loss_sum, step + 1, first_bad_step, wishes)  # the one host sync, every rank's
            progress.set_postfix(loss=f"{shown.mean_loss:.3f}", refresh=False)
        hook.after_step(step, agreed, group_end=group_start + group_size - 1, last_step=steps - 1, loss_sum=loss_sum,
                        position=lambda s=step + 1: batches.position_after(
                            s, first_step, loss_count=shown.losses_summed(s), run_seconds=state.clock.seconds(),
                            epoch_seconds=clock.seconds()))
    progress.close()
    state.position = None  # the next epochs are whole
    return clock.stats(shown.mean_loss, last_lr)


def start_epoch(state, data_loader, epoch, settings, device):
    """(first step, this rank's loss sum, LossDisplay, EpochClock) of ``epoch``, the run's clock
    started: 0 and nothing yet, or where a resumed run goes on (``resume_epoch``). The saved loss sums go back to their
    ranks at the checkpoint's world size; at another, rank 0 takes their total."""
    batches, world_size = data_loader.batch_sampler, get_world_size()
    state.clock.start()  # the run's clock: from its first epoch on
    resumed = resume_epoch(state, batches, epoch, settings.accum_steps)
    first_step = batches.first_step() if resumed else 0
    loss_sum = torch.zeros((), device=device)  # this rank's, over the epoch's micro-batches
    if resumed:
        same_world = len(resumed.loss_sums) == world_size and resumed.order_world_size == world_size
        loss_sum += resumed.loss_sums[get_rank()] if same_world else (sum(resumed.loss_sums) if get_rank() == 0 else 0)
    shown = LossDisplay(epoch, earlier_losses=resumed.loss_count if resumed else 0, first_step=first_step)
    clock = EpochClock(device, images_per_step=batches.batch_size * world_size, steps=len(data_loader),
                       earlier_seconds=resumed.epoch_seconds if resumed else 0.0)
    return first_step, loss_sum, shown, clock


def resume_epoch(state, batches, epoch, accum_steps=1):
    """The EpochPosition this epoch resumes from (state.position, from the checkpoint), or
    None: the batch sampler then gives the rest of the epoch; the scheduler is moved to that
    step and, at the checkpoint's world size, this rank's generators put back as they were."""
    position = state.position
    if position is None or position.epoch != epoch:
        return None
    if position.train_images != batches.dataset_length():
        if is_main_process():
            print(f"warning: the checkpoint stopped inside epoch {epoch} of {position.train_images} training images, "
                  f"the data now has {batches.dataset_length()}: epoch {epoch} starts again from its first step",
                  flush=True)
        return None
    batches.resume_at(position)
    if len(batches) == 0 and is_main_process():
        print(f"warning: epoch {epoch}: the last {position.end - position.done} images of the interrupted epoch are "
              f"fewer than {MIN_IMAGES_PER_RANK} per process; they are left out", flush=True)
    same_world = position.order_world_size == get_world_size() and len(position.rng) == get_world_size()
    if same_world:
        restore_rng(position.rng[get_rank()])
    scheduler_steps = math.ceil(batches.first_step() / accum_steps)  # the optimizer steps done
    if state.lr_scheduler is not None:
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": moved, not trained
            warnings.simplefilter("ignore")
            for _ in range(scheduler_steps):
                state.lr_scheduler.step()
    return position


def optimizer_step(state, scaler, clip_grad=None):
    """One optimizer step on the summed gradients (clipped to ``clip_grad``, unscaled first
    under fp16), then the EMA update and the schedule's step."""
    optimizer = state.optimizer
    if clip_grad:
        scaler.unscale_(optimizer)  # clip the true gradients, not the fp16-scaled ones
        nn.utils.clip_grad_norm_([p for p in state.model.parameters() if p.requires_grad], clip_grad)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if state.ema is not None:
        state.ema.update(state.model)
    if state.lr_scheduler is not None:
        state.lr_scheduler.step()


class EpochClock:
    """An epoch's time and images/s, leaving out the first WARMUP_STEPS steps (worker start-up,
    first kernels) when the epoch is longer than that; ``earlier_seconds``: of the same epoch,
    before a resume."""

    def __init__(self, device, images_per_step, steps, earlier_seconds=0.0):
        self.device, self.images_per_step, self.steps = device, images_per_step, steps
        self.images = steps * images_per_step  # full batches on every rank
        self.start = self.warm_start = time.perf_counter()
        self.warm_images = 0
        self.earlier_seconds = earlier_seconds

    def step_done(self, step):
        if step + 1 == WARMUP_STEPS and self.steps > WARMUP_STEPS:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # once an epoch: start the clock when the warm-up is done
            self.warm_start, self.warm_images = time.perf_counter(), (step + 1) * self.images_per_step

    def seconds(self):
        """The epoch's seconds so far."""
        return self.earlier_seconds + time.perf_counter() - self.start

    def stats(self, mean_loss, last_lr):
        """The epoch's TrainStats."""
        now = time.perf_counter()
        return TrainStats(mean_loss=mean_loss, images=self.images, seconds=self.seconds(), last_lr=last_lr,
                          images_per_second=(self.images - self.warm_images) / max(now - self.warm_start, 1e-9),
                          earlier_seconds=self.earlier_seconds)


class LossDisplay:
    """The epoch's mean loss over all ranks, read every few steps; raises on a NaN/inf loss.
    ``earlier_losses``: the (rank, step) losses summed before ``first_step`` (a resumed epoch)."""

    def __init__(self, epoch, earlier_losses=0, first_step=0):
        self.epoch = epoch
        self.mean_loss = float("nan")
        self.earlier_losses, self.first_step = earlier_losses, first_step

    def losses_summed(self, steps_done):
        """The (rank, step) losses summed after ``steps_done`` steps of the epoch."""
        return self.earlier_losses + (steps_done - self.first_step) * get_world_size()

    def update(self, loss_sum, steps_done, first_bad_step, wishes=(0.0, 0.0)):
        """Reads the mean loss and sums ``wishes`` (StepHook.wishes) over
        ranks, in one all-reduce; returns the summed wishes."""
        bad = (first_bad_step >= 0).to(loss_sum.dtype)
        # One collective and one read of the device for all the numbers.
        wishes = torch.tensor(wishes, dtype=loss_sum.dtype, device=loss_sum.device)
        loss_total, bad_ranks, *wishes = reduce_value(torch.cat([torch.stack([loss_sum, bad]), wishes]),
                                                      average=False).tolist()
        world_size = get_world_size()
        # As many losses as steps x ranks, unless a resume changed the world size inside the epoch.
        mean_loss = loss_total / (self.earlier_losses / world_size + steps_done - self.first_step) / world_size
        if bad_ranks > 0:
            # The same on every rank, so every rank stops here together.
            step = first_bad_step.clone() if bad else torch.full_like(first_bad_step, 2**62)
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(step, op=dist.ReduceOp.MIN)
            raise NonFiniteLossError(
                f"training loss became {mean_loss:g} at epoch {self.epoch}, step {int(step)}; "
                "lower --lr, add --warmup-epochs or --clip-grad, or check the data"
            )
        self.mean_loss = mean_loss
        return wishes


@torch.no_grad()
def evaluate(model, data_loader, device, num_classes, settings=None):
    """Exact validation: each rank passes its own shard through ``settings.task``'s tally,
    which combines every rank's counts (or scores) at the end, each image once.

    Every rank first takes rank 0's BatchNorm statistics, so the figure is that of the
    weights rank 0 saves. Runs the module inside DDP, not the wrapper: ranks may have
    different numbers of batches, and DDP's forward may broadcast buffers, a collective the
    shorter rank would never join. The tally stays on the device until the end (no host sync
    per batch), and a short last batch is padded to the batch size (``pad_batch``). An image
    labelled LEFT_OUT (-1: the dataset could not read it) is not counted but in ``left_out``.
    """
    settings = settings or LoopSettings()
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    broadcast_buffers(model)
    model.eval()
    tally = settings.task.evaluation(num_classes, device)
    for images, labels, weights in validation_batches(data_loader, device, settings):
        with settings.precision.autocast():
            logits = model(images)
        tally.add(logits, labels, weights)
    result = tally.result()
    if result.left_out and not result.total:
        raise MidRunError(f"none of the {result.left_out} validation images could be read: is the data still there "
                          "(a folder moved, a network file system gone)?")
    return result


def validation_batches(data_loader, device, settings):
    """(images, labels, weights) of each validation batch: on the device, normalised, a short
    last batch padded to the loader's batch size (``pad_batch``: weight 0 for its padding)."""
    to_device = settings.normalizer(device)
    batch_size = getattr(getattr(data_loader, "batch_sampler", None), "batch_size", None)
    for images, labels in tqdm(data_loader, desc="[valid]", disable=not is_main_process(), file=sys.stdout):
        images, labels = to_device(images, labels)
        batch_size = batch_size or len(labels)
        yield pad_batch(images, labels, batch_size, settings.channels_last)


def pad_batch(images, labels, batch_size, channels_last=False):
    """A short last batch padded with copies of its first image up to ``batch_size``, and the
    weight of each row in the counts (0 for padding): a compiled model then sees one shape
    and compiles once. In eval mode each image's output is independent of the others."""
    count = len(labels)
    weights = torch.ones(max(count, batch_size), dtype=torch.int64, device=labels.device)
    if count >= batch_size:
        return images, labels, weights[:count]
    weights[count:] = 0
    images = torch.cat([images, images[:1].expand(batch_size - count, *images.shape[1:])])
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    return images, torch.cat([labels, labels[:1].expand(batch_size - count, *labels.shape[1:])]), weights


# --- Checkpoints inside the epoch: every --checkpoint-every minutes, and at a preemption notice ---
# Every rank decides alike, on the steps where the training loop already reads the loss
# (every --print-freq steps, and every step of a single process for a notice): the decision
# travels in the same all-reduce. The save comes at the end of the accumulation group (an
# optimizer step), so no partial gradient is ever lost. At a notice (SIGTERM, SIGUSR1; see
# ``errors``) every rank then exits with errors.PREEMPTED_EXIT_CODE, after rank 0 asked SLURM to
# requeue the job (--requeue).

def requeue_job():
    """``scontrol requeue $SLURM_JOB_ID``: SLURM runs the job again; returns a line saying so."""
    job = os.environ.get("SLURM_JOB_ID", "")
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"warning: scontrol requeue {job} failed ({e}); requeue the job by hand"
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        return f"warning: scontrol requeue {job} failed ({reason[0]}); requeue the job by hand"
    return f"requeued SLURM job {job} (scontrol requeue): it continues with --resume auto"


class StepHook:
    """What train_one_epoch calls around its steps; this one does nothing.

    ``wishes()``: this rank's numbers, summed over ranks in the all-reduce that reads the
    loss (no collective of their own); ``after_step``: the step done, with the summed wishes
    where they were agreed (None elsewhere), so that every rank acts alike."""

    def wishes(self):
        return [0.0, 0.0]

    def start_epoch(self):
        """A new epoch (or the rest of a resumed one) begins."""

    def after_step(self, step, agreed, *, group_end, last_step, loss_sum, position):
        """After ``step`` (its accumulation group ends at ``group_end``; the epoch at
        ``last_step``); ``loss_sum``: this rank's; ``position()``: the EpochPosition after it."""


@dataclass
class SavePlan:
    """When to save inside the epoch: after step ``at``, the end of the accumulation group in
    which every rank decided to (never the epoch's last step: its end saves anyway), and
    whether to stop then (``notice``)."""

    at: Optional[int] = None
    notice: bool = False

    def decide(self, time_due, noticed, group_end, last_step):
        """The summed wishes of this step (agreed by every rank)."""
        if self.at is None and (time_due or noticed) and group_end < last_step:
            self.at = group_end
        self.notice = self.notice or bool(noticed)


class MidEpochCheckpoints(StepHook):
    """When training saves inside an epoch, and the save itself: the run's StepHook.

    ``minutes``: --checkpoint-every (0: never on time); ``write(position)``: rank 0's save of
    the training state at a ``loaders.EpochPosition``; ``hint``: how to continue;
    ``requeue``: --requeue.
    """

    def __init__(self, minutes, write, hint="", requeue=False):
        self.seconds = minutes * 60.0
        self.write, self.hint, self.requeue = write, hint, requeue
        self.last_save = time.monotonic()
        self.plan = SavePlan()

    def wishes(self):
        """This rank's wishes, for the all-reduce of the loss: [time to save, a notice came]."""
        due = self.seconds > 0 and time.monotonic() - self.last_save >= self.seconds
        return [float(due), float(notice_received() is not None)]

    def start_epoch(self):
        self.plan = SavePlan()

    def after_step(self, step, agreed, *, group_end, last_step, loss_sum, position):
        """Decide on the agreed wishes; at the planned step, save (and at a notice, stop)."""
        if agreed is not None:
            self.plan.decide(*agreed, group_end=group_end, last_step=last_step)
        if step == self.plan.at:
            self.save(position(), loss_sum, self.plan.notice)  # at a notice: raises Preempted after it
            self.plan.at = None

    def saved(self):
        """A checkpoint was written (inside the epoch or at its end): the clock starts again."""
        self.last_save = time.monotonic()

    def save(self, position, loss_sum, notice):
        """Every rank: gather each rank's loss sum and generator states into ``position``, let
        rank 0 write the checkpoint, and wait for it; at a ``notice``, stop (``_stop``)."""
        position.loss_sums = all_gather_rows(loss_sum.detach().double().reshape(1, 1)).flatten().tolist()
        if not all(math.isfinite(v) for v in position.loss_sums):
            return False  # the loss check that follows stops every rank
        position.rng = gather_objects(rng_state())
        error = None
        if is_main_process():
            try:
                self.write(position)
            except Exception as e:  # noqa: BLE001 - the others must learn of it, then it is raised
                error = e
        raise_if_failed(not agree(error is None, loss_sum.device), error, "the checkpoint inside the epoch")
        self.saved()
        if notice:
            self._stop(f"stopped at epoch {position.epoch}, step {position.step} on a preemption notice "
                       f"({notice_name()}), and saved the checkpoint", loss_sum.device)
        return True

    def after_epoch_save(self, error=None, model=None, notices=True):
        """After an epoch's checkpoint, every rank, in one all-reduce (on the device of
        ``model``): if rank 0's save failed (``error``), every rank raises (rank 0 its
        ``error``); else, with ``notices``, every rank stops if any received a notice."""
        device = device_of(model)
        wishes = [float(error is not None), float(notices and notice_received() is not None)]
        failed, noticed = all_reduce_sum(torch.tensor(wishes, device=device)).tolist()
        raise_if_failed(failed, error, "the epoch's checkpoint")
        if noticed:
            self._stop(f"stopped after an epoch's checkpoint on a preemption notice ({notice_name()})", device)

    def _stop(self, what, device):
        """Rank 0 requeues the job (--requeue), then every rank raises Preempted (rank 0 with
        ``what`` and how to continue). No rank exits before the requeue is done: under
        ``srun --kill-on-bad-exit`` the first exit ends every task, scontrol with it."""
        requeued = requeue_job() if self.requeue and is_main_process() else None
        agree(True, device)  # every rank waits here for rank 0's scontrol
        if not is_main_process():
            raise Preempted(None)
        raise Preempted("\n".join(line for line in (requeued, f"{what}; {self.hint}") if line))


def device_of(model):
    """The device of ``model``'s weights (the CPU for None): where its collectives run."""
    return next(model.parameters()).device if model is not None else torch.device("cpu")


def agree_on_write(error, model, what):
    """Every rank, after rank 0 wrote ``what`` (``error``: what it raised, or None): one
    all-reduce, then every rank raises if rank 0 failed (rank 0 its ``error``), so that no
    rank goes on into a collective that rank 0 never joins."""
    failed = all_reduce_sum(torch.tensor([float(error is not None)], device=device_of(model)))
    raise_if_failed(float(failed), error, what)


def raise_if_failed(failed, error, what):
    """Raise ``error`` (this rank's), or that rank 0 could not write ``what``, if ``failed``."""
    if failed:
        if error is not None:
            raise error
        raise MidRunError(f"rank 0 could not write {what} (its error says why)")


def notice_name():
    """The notice's signal as this process received it, or that another process did."""
    signum = notice_received()
    return signal.Signals(signum).name if signum else "received by another process"


def agree(ok, device):
    """True on every rank when ``ok`` is true on every rank (one all-reduce on ``device``)."""
    return float(all_reduce_sum(torch.tensor([0.0 if ok else 1.0], device=device))) == 0.0
