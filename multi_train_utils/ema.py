"""An exponential moving average (EMA) of the model's weights (--model-ema).

After every optimizer step each averaged tensor moves towards the model's:
``ema = d * ema + (1 - d) * weight``, with the decay warmed up as
``d = min(--model-ema-decay, (1 + n) / (10 + n))`` after ``n`` updates, so that the first
steps, whose weights are still random, are soon forgotten. Parameters and BatchNorm's running
statistics are averaged (integer buffers, such as the count of batches seen, are copied).

Under DDP the parameters are the same on every rank, so their average is too; running
statistics differ per rank, and ``train_eval_utils.evaluate`` gives every rank rank 0's
before each evaluation (so the evaluated, saved and resumed EMA is rank 0's, on every rank).
"""
import copy

import torch

from multi_train_utils.model_setup import unwrap_model


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
