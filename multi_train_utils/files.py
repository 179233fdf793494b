"""Safe file reading and atomic writing.

A crash never leaves half a file, and a file that would run code when loaded is refused."""
import json
import os
import pickle
import tempfile

import torch

from multi_train_utils.errors import UserError


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
    """Write a text file (UTF-8) atomically; a file or class name that is not UTF-8 keeps its own bytes."""
    write_bytes_atomic(text.encode("utf-8", "surrogateescape"), path)


def write_bytes_atomic(data, path):
    """Write a file's bytes atomically."""
    _atomic_write(path, lambda f: f.write(data))


def read_json(path, hint="fix or delete it"):
    """The JSON in ``path``; a UserError naming the file (and saying ``hint``) if it cannot be read."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot be read as JSON ({e}); {hint}") from None


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
