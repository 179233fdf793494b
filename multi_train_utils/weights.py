"""Weights files: read safely and loaded into a model.

A file of weights, or torchvision's pretrained weights by name; loaded by matching tensors by
name and shape, or strictly."""
import os
import re

import torch
import torchvision

from multi_train_utils.errors import UserError
from multi_train_utils.files import safe_load


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

