"""Checkpoints inside the epoch: every --checkpoint-every minutes, and at a preemption notice.

Every rank decides alike, on the steps where the training loop already reads the loss
(every --print-freq steps, and every step of a single process for a notice): the decision
travels in the same all-reduce. The save comes at the end of the accumulation group (an
optimizer step), so no partial gradient is ever lost. At a notice (SIGTERM, SIGUSR1; see
``signals``) every rank then exits with signals.PREEMPTED_EXIT_CODE, after rank 0 asked SLURM to
requeue the job (--requeue).
"""
import os
import signal
import subprocess
import time

import torch
import torch.distributed as dist

from multi_train_utils.checkpoint import rng_state
from multi_train_utils.errors import MidRunError
from multi_train_utils.process import get_world_size, is_dist_avail_and_initialized, is_main_process
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


class MidEpochCheckpoints:
    """When training saves inside an epoch, and the save itself.

    ``minutes``: --checkpoint-every (0: never on time); ``write(position)``: rank 0's save of
    the training state at an ``epoch_position.EpochPosition``; ``hint``: how to continue;
    ``requeue``: --requeue.
    """

    def __init__(self, minutes, write, hint="", requeue=False):
        self.seconds = minutes * 60.0
        self.write, self.hint, self.requeue = write, hint, requeue
        self.last_save = time.monotonic()

    def flags(self):
        """This rank's wishes, for the all-reduce of the loss: [time to save, a notice came]."""
        due = self.seconds > 0 and time.monotonic() - self.last_save >= self.seconds
        return [float(due), float(notice_received() is not None)]

    def saved(self):
        """A checkpoint was written (inside the epoch or at its end): the clock starts again."""
        self.last_save = time.monotonic()

    def save(self, state, position, loss_sum, notice):
        """Every rank: gather each rank's loss sum and generator states into ``position``, let
        rank 0 write the checkpoint, and wait for it; at a ``notice``, requeue (rank 0,
        --requeue) and raise Preempted."""
        position.loss_sums = [float(v) for v in gather_values(loss_sum)]
        if not all(torch.isfinite(torch.tensor(position.loss_sums))):
            return False  # the loss check that follows stops every rank
        position.rng = gather_objects(rng_state())
        error = None
        if is_main_process():
            try:
                self.write(position)
            except Exception as e:  # noqa: BLE001 - the others must learn of it, then it is raised
                error = e
        if not agree(error is None):
            if error is not None:
                raise error
            raise MidRunError("rank 0 could not write the checkpoint inside the epoch (its error says why)")
        self.saved()
        if notice:
            lines = [f"stopped at epoch {position.epoch}, step {position.step} on a preemption notice "
                     f"({notice_name()}), and saved the checkpoint; {self.hint}"]
            if self.requeue and is_main_process():
                lines.insert(0, requeue_job())
            raise Preempted("\n".join(lines) if is_main_process() else None)
        return True

    def stop_if_noticed(self):
        """After an epoch's checkpoint: every rank stops (Preempted) if any received a notice
        (one all-reduce an epoch)."""
        if agree(notice_received() is None):
            return
        lines = [f"stopped after an epoch's checkpoint on a preemption notice ({notice_name()}); {self.hint}"]
        if self.requeue and is_main_process():
            lines.insert(0, requeue_job())
        raise Preempted("\n".join(lines) if is_main_process() else None)


def notice_name():
    """The notice's signal as this process received it, or that another process did."""
    signum = notice_received()
    return signal.Signals(signum).name if signum else "received by another process"


def _device():
    backend = dist.get_backend() if is_dist_avail_and_initialized() else "gloo"
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def agree(ok):
    """True on every rank when ``ok`` is true on every rank."""
    if get_world_size() < 2:
        return bool(ok)
    flag = torch.tensor([0.0 if ok else 1.0], device=_device())
    dist.all_reduce(flag)
    return float(flag) == 0.0


def gather_values(value):
    """A scalar tensor of every rank, in rank order, as a CPU float tensor (float64: exact)."""
    value = value.detach().reshape(1).double()
    if get_world_size() < 2:
        return value.cpu()
    parts = [torch.zeros_like(value) for _ in range(get_world_size())]
    dist.all_gather(parts, value)
    return torch.cat(parts).cpu()


def gather_objects(obj):
    """``obj`` of every rank, in rank order (pickled)."""
    if get_world_size() < 2:
        return [obj]
    parts = [None] * get_world_size()
    dist.all_gather_object(parts, obj)
    return parts
