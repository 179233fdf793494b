"""Checkpoints inside the epoch: every --checkpoint-every minutes, and at a preemption notice.

Every rank decides alike, on the steps where the training loop already reads the loss
(every --print-freq steps, and every step of a single process for a notice): the decision
travels in the same all-reduce. The save comes at the end of the accumulation group (an
optimizer step), so no partial gradient is ever lost. At a notice (SIGTERM, SIGUSR1; see
``signals``) every rank then exits with signals.PREEMPTED_EXIT_CODE, after rank 0 asked SLURM to
requeue the job (--requeue).
"""
import math
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from multi_train_utils.checkpoint import rng_state
from multi_train_utils.errors import MidRunError
from multi_train_utils.distributed_utils import all_gather_rows, all_reduce_sum
from multi_train_utils.process import get_world_size, is_main_process
from multi_train_utils.signals import Preempted, notice_received

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
    the training state at an ``epoch_position.EpochPosition``; ``hint``: how to continue;
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


def gather_objects(obj):
    """``obj`` of every rank, in rank order (pickled)."""
    if get_world_size() < 2:
        return [obj]
    parts = [None] * get_world_size()
    dist.all_gather_object(parts, obj)
    return parts
