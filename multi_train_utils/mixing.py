"""MixUp and CutMix of training batches, seeded so that a rerun or a resume mixes alike.

torchvision's ``v2.MixUp`` and ``v2.CutMix`` draw from torch's global CPU generator and refuse
uint8 images, so they run here on the normalised float batch on the device, inside
``torch.random.fork_rng`` with the CPU generator seeded from (seed, epoch, step, rank): the
global generators are left as they were, and each batch's mixing depends on nothing else.
The targets become soft (one row of class probabilities per image, summing to 1), which
``nn.CrossEntropyLoss`` takes as they are. Multi-hot targets (a row of 0/1 per class) are mixed alike:
lam y + (1 - lam) y' of the two images mixed (each entry from 0 to 1, for the BCE).
"""
import torch
from torchvision.transforms import v2

from multi_train_utils.process import get_rank
from multi_train_utils.loaders import sample_seed

# Added to --seed so that the mixing is not the same stream as the model's or the augmentations'.
_MIX_SALT = 15_485_863


class BatchMixer:
    """``(images, labels) -> (mixed images, soft targets)`` with MixUp (``mixup_alpha`` > 0),
    CutMix (``cutmix_alpha`` > 0), or one of the two chosen at random for each batch (both)."""

    def __init__(self, num_classes, mixup_alpha=0.0, cutmix_alpha=0.0, seed=0, rank=0):
        if mixup_alpha <= 0 and cutmix_alpha <= 0:
            raise ValueError("BatchMixer needs mixup_alpha or cutmix_alpha above 0")
        self.alphas = (mixup_alpha, cutmix_alpha)
        self.mix = self._mixer(num_classes)
        self.seed, self.rank = seed, rank
        self._row_mixers = {}  # for multi-hot targets: by batch size

    def _mixer(self, num_classes):
        """torchvision's MixUp, CutMix, or a random choice of the two, for ``num_classes``."""
        mixup_alpha, cutmix_alpha = self.alphas
        choices = [v2.MixUp(alpha=mixup_alpha, num_classes=num_classes)] if mixup_alpha > 0 else []
        choices += [v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes)] if cutmix_alpha > 0 else []
        return choices[0] if len(choices) == 1 else v2.RandomChoice(choices)

    def _mix_rows(self, images, targets):
        """Multi-hot ``targets`` mixed as the images are: torchvision mixes labels 0..B-1 of a
        batch of B into a B x B matrix of how much of each image every mixed image holds (what
        it draws is the same as for class labels); that matrix times the targets."""
        size = len(images)
        mix = self._row_mixers.setdefault(size, self._mixer(size))
        images, weights = mix(images, torch.arange(size, device=images.device))
        return images, weights.to(targets.dtype) @ targets

    def __call__(self, images, labels, epoch, step):
        """The batch of ``step`` (counted from 0 in ``epoch``) mixed; the memory format of
        ``images`` is kept."""
        channels_last = images.dim() == 4 and images.is_contiguous(memory_format=torch.channels_last) \
            and not images.is_contiguous()
        with torch.random.fork_rng(devices=[]):  # the draws are on the CPU generator only
            # the CPU generator alone: torch.manual_seed would reseed every GPU's generator too
            torch.default_generator.manual_seed(sample_seed(sample_seed(self.seed + _MIX_SALT, epoch, step), self.rank, 0))
            images, targets = self._mix_rows(images, labels) if labels.ndim == 2 else self.mix(images, labels)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images, targets


def make_batch_mixer(recipe, num_classes, rank=None):
    """The BatchMixer of ``recipe``'s --mixup-alpha / --cutmix-alpha (seeded by --seed and the
    rank: this process's by default), or None when both are 0."""
    rank = get_rank() if rank is None else rank
    if recipe.mixup_alpha <= 0 and recipe.cutmix_alpha <= 0:
        return None
    return BatchMixer(num_classes, recipe.mixup_alpha, recipe.cutmix_alpha, recipe.seed, rank)
