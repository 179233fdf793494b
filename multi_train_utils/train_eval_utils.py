"""The training and evaluation loops, and the learning-rate schedule."""
import math
import sys
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from tqdm import tqdm

from model import set_train_mode, unwrap_model
from multi_train_utils.distributed_utils import all_reduce_sum, is_main_process, reduce_value
from multi_train_utils.errors import UserError


class NonFiniteLossError(UserError):
    """The training loss became NaN or infinite; raised on every rank at the same step."""


@dataclass
class TrainStats:
    """What one training epoch did, summed over all ranks."""

    mean_loss: float  # mean over steps of the loss averaged across ranks
    images: int  # training images processed by all ranks
    seconds: float
    last_lr: float  # learning rate of the epoch's last step


@dataclass
class EvalResult:
    """Confusion matrix of a validation pass: rows are true classes, columns predictions."""

    confusion: torch.Tensor

    @property
    def correct(self):
        return int(self.confusion.diag().sum())

    @property
    def total(self):
        return int(self.confusion.sum())

    @property
    def accuracy(self):
        return self.correct / max(1, self.total)


def create_lr_scheduler(optimizer, steps_per_epoch, epochs, warmup_epochs=0, lrf=0.1, start_epoch=0):
    """Per-step schedule: linear warm-up over ``warmup_epochs``, then cosine from lr down to
    lr * lrf at the end of the last epoch. It is a function of the fraction of training
    done, so ``start_epoch`` > 0 starts it at that epoch's first
    step (resume): the rate is then what this schedule gives there, for the current number
    of steps per epoch (world size) and total of epochs."""
    total = max(1, epochs * steps_per_epoch)
    warmup = min(total, warmup_epochs * steps_per_epoch)

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return lrf + (1 - lrf) * (1 + math.cos(math.pi * min(1.0, progress))) / 2

    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
    return LambdaLR(optimizer, factor, last_epoch=start_epoch * steps_per_epoch - 1)


def train_one_epoch(model, optimizer, data_loader, device, epoch, lr_scheduler=None):
    """Train for one epoch; return TrainStats. Stops every rank together on a non-finite loss."""
    set_train_mode(model)
    loss_function = nn.CrossEntropyLoss()
    mean_loss = torch.zeros((), device=device)
    images_seen, last_lr = 0, optimizer.param_groups[0]["lr"]
    start = time.perf_counter()
    progress = tqdm(data_loader, desc=f"[train epoch {epoch}]", disable=not is_main_process(), file=sys.stdout)
    for step, (images, labels) in enumerate(progress):
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        loss = loss_function(model(images), labels)
        loss.backward()
        # The average over ranks is the same on every rank, so every rank stops together.
        loss = reduce_value(loss.detach(), average=True)
        if not torch.isfinite(loss):
            raise NonFiniteLossError(
                f"training loss became {loss.item()} at epoch {epoch}, step {step}; "
                "lower --lr, add --warmup-epochs, or check the data"
            )
        mean_loss += (loss - mean_loss) / (step + 1)
        last_lr = optimizer.param_groups[0]["lr"]  # the rate this step uses
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if lr_scheduler is not None:
            lr_scheduler.step()
        images_seen += len(labels)
        if is_main_process():
            progress.set_postfix(loss=f"{mean_loss.item():.3f}", refresh=False)
    images_seen = int(all_reduce_sum(torch.tensor(images_seen, device=device)))
    return TrainStats(
        mean_loss=mean_loss.item(),
        images=images_seen,
        seconds=time.perf_counter() - start,
        last_lr=last_lr,
    )


@torch.no_grad()
def evaluate(model, data_loader, device, num_classes):
    """Exact validation: each rank predicts its own shard, then counts are summed over ranks.

    Runs the plain module, not the DDP wrapper: ranks may have different numbers of batches,
    and DDP's forward may broadcast buffers, a collective the shorter rank would never join.
    """
    model = unwrap_model(model)
    model.eval()
    confusion = torch.zeros(num_classes * num_classes, dtype=torch.int64, device=device)
    for images, labels in tqdm(data_loader, desc="[valid]", disable=not is_main_process(), file=sys.stdout):
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        predictions = model(images).argmax(dim=1)
        confusion += torch.bincount(labels * num_classes + predictions, minlength=num_classes * num_classes)
    all_reduce_sum(confusion)
    return EvalResult(confusion.view(num_classes, num_classes).cpu())


def print_evaluation(result, classes):
    """Per-class accuracy lines, then ``top1 accuracy: 0.812500 (130/160)`` as the last line."""
    width = max(len(c) for c in classes)
    for i, name in enumerate(classes):
        row = result.confusion[i]
        total, correct = int(row.sum()), int(row[i])
        print(f"  {name:<{width}}  {correct / max(1, total):.6f} ({correct}/{total})")
    print(f"top1 accuracy: {result.accuracy:.6f} ({result.correct}/{result.total})", flush=True)
