"""Files of a run: atomic saving, the full checkpoint for --resume, and the guard against
overwriting an earlier run."""
import glob
import json
import os
import pickle
import random
import re
import shutil
import tempfile

import torch

from multi_train_utils.errors import UserError

CHECKPOINT = "checkpoint.pth"
PREVIOUS_CHECKPOINT = "checkpoint-prev.pth"  # the one before, in case the newest is damaged
RUN_FILES = (CHECKPOINT, PREVIOUS_CHECKPOINT, "model-best.pth", "metrics.csv", "args.json", "class_indices.json",
             "train.log", "confusion_matrix.csv", "class_distribution.png", "batch_preview.png", "curves.png",
             "confusion_matrix.png")


def earlier_run_files(output_dir):
    """Files in ``output_dir`` that an earlier training run wrote (checkpoints and metrics)."""
    found = sorted(glob.glob(os.path.join(glob.escape(output_dir), "model-*.pth")))
    found += [os.path.join(output_dir, f) for f in RUN_FILES
              if os.path.isfile(os.path.join(output_dir, f)) and os.path.join(output_dir, f) not in found]
    return found


def resumes_in(resume_path, output_dir):
    """True when the checkpoint resumed from lies in ``output_dir`` (the run continues there)."""
    return bool(resume_path) and os.path.dirname(os.path.abspath(resume_path)) == os.path.abspath(output_dir)


def check_output_dir(output_dir, overwrite, resume_path=None):
    """Refuse to start over an earlier run's checkpoints, unless --overwrite is given or this
    run resumes from the checkpoint in that very folder."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise UserError(f"--output-dir {output_dir}: is a file; give a folder")
    resuming_here = resumes_in(resume_path, output_dir)
    earlier = [f for f in earlier_run_files(output_dir) if f.endswith(".pth")]
    if earlier and not overwrite and not resuming_here:
        names = ", ".join(os.path.basename(f) for f in earlier[:3]) + (", ..." if len(earlier) > 3 else "")
        raise UserError(
            f"--output-dir {output_dir}: holds checkpoints of an earlier run ({names}); "
            "pass --resume auto to continue it, --overwrite to replace it, or choose another --output-dir"
        )


def clear_leftover_temporary_files(output_dir):
    """Remove temporary files of writes that a killed process never finished."""
    for path in glob.glob(os.path.join(glob.escape(output_dir), ".*.tmp")):
        os.remove(path)


def clear_earlier_run(output_dir):
    """Delete an earlier run's files (for --overwrite); other files are left alone."""
    for path in earlier_run_files(output_dir):
        os.remove(path)


def _atomic_write(path, write):
    """Write via a temporary file in the same folder, fsync, then rename over ``path``.

    A crash at any point leaves either the old file or the new one, never half of one.
    The temporary name is unique, so concurrent runs never collide.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes owner-only files; use the usual mode
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_atomic(obj, path):
    """``torch.save`` that never leaves a half-written file behind."""
    _atomic_write(path, lambda f: torch.save(obj, f))


def write_json_atomic(obj, path):
    """Write ``obj`` as indented JSON, atomically."""
    write_text_atomic(json.dumps(obj, indent=2), path)


def write_text_atomic(text, path):
    """Write a text file atomically."""
    write_bytes_atomic(text.encode(), path)


def write_bytes_atomic(data, path):
    """Write a file's bytes atomically."""
    _atomic_write(path, lambda f: f.write(data))


def _keep_previous(path, previous):
    """Make ``previous`` a copy of ``path`` (a hard link where the file system has them)."""
    if not os.path.exists(path):
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(previous)}.", suffix=".tmp",
                               dir=os.path.dirname(os.path.abspath(previous)))
    os.close(fd)
    try:
        os.remove(tmp)
        try:
            os.link(path, tmp)
        except OSError:
            shutil.copyfile(path, tmp)
        os.replace(tmp, previous)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def rng_state():
    """Random number generator states, as tensors and plain types (weights_only loads them)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_checkpoint(output_dir, state):
    """Write ``checkpoint.pth`` atomically, keeping the previous one as ``checkpoint-prev.pth``."""
    path = os.path.join(output_dir, CHECKPOINT)
    _keep_previous(path, os.path.join(output_dir, PREVIOUS_CHECKPOINT))
    save_atomic(state, path)


def safe_load(path, flag, what):
    """``torch.load(path, weights_only=True)``: tensors and plain types only, so a file that
    would run code when unpickled is refused. Any failure is a UserError naming the file."""
    if not os.path.isfile(path):
        raise UserError(f"{flag} {path}: no such file; give the path of a {what}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UserError(f"{flag} {path}: refused to load: it holds more than tensors and plain types "
                        f"(loading it could run code). {first}") from None
    except Exception as e:  # truncated zip, not a torch file, ...
        raise UserError(f"{flag} {path}: cannot be read as a {what} ({type(e).__name__}); "
                        "it may be truncated or of another format") from None


def load_checkpoint(path, flag="--resume"):
    """Read a full checkpoint safely; a clear error names a bad file."""
    checkpoint = safe_load(path, flag, "checkpoint (checkpoint.pth)")
    needed = {"model", "optimizer", "epoch", "classes", "args"}
    if not isinstance(checkpoint, dict) or not needed <= set(checkpoint):
        raise UserError(f"{flag} {path}: not a full checkpoint (needs {sorted(needed)}); "
                        "to start from weights alone use --weights")
    return checkpoint


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


def check_resume_compatible(checkpoint, path, args, classes, epochs):
    """The checkpoint must be of the same classes, model and frozen layers."""
    if checkpoint["classes"] != classes:
        raise UserError(f"--resume {path}: trained on classes {checkpoint['classes']}, but --data-path has "
                        f"{classes}; resume with the same class folders or start a new --output-dir")
    for flag in ("model", "freeze_layers"):
        if checkpoint["args"].get(flag, getattr(args, flag)) != getattr(args, flag):
            value = checkpoint["args"].get(flag)
            raise UserError(f"--resume {path}: trained with --{flag.replace('_', '-')} {value}; resume with the same")
    if int(checkpoint["epoch"]) + 1 > epochs:
        raise UserError(f"--resume {path}: already trained {int(checkpoint['epoch']) + 1} epochs, more than "
                        f"--epochs {epochs}; raise --epochs to train more")


def restore_training_state(checkpoint, optimizer, base_lr, scaler=None):
    """Load the optimizer's, the fp16 GradScaler's and the RNG states; return the epoch to
    continue with.

    The learning rate is re-derived (``base_lr``, for the current world size) rather than
    taken from the checkpoint; the scheduler is then created at the checkpoint's epoch.
    """
    if checkpoint is None:
        return 0
    try:
        optimizer.load_state_dict(checkpoint["optimizer"])
    except (ValueError, KeyError) as e:
        raise UserError(f"--resume: the checkpoint's optimizer state does not fit this model ({e})") from None
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] = base_lr
    if scaler is not None and scaler.is_enabled() and checkpoint.get("scaler"):
        scaler.load_state_dict(checkpoint["scaler"])  # else (another --amp before) it starts afresh
    rng = checkpoint.get("rng") or {}
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "python" in rng:
        random.setstate(_as_tuple(rng["python"]))
    if "cuda" in rng and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return int(checkpoint["epoch"]) + 1


def _as_tuple(value):
    """random.setstate wants tuples all the way down (a round trip may give lists)."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def model_epoch_files(output_dir):
    """``{epoch: path}`` of the per-epoch weights in ``output_dir``."""
    files = {}
    for path in glob.glob(os.path.join(glob.escape(output_dir), "model-*.pth")):
        match = re.fullmatch(r"model-(\d+)\.pth", os.path.basename(path))
        if match:
            files[int(match.group(1))] = path
    return files
