"""Files of a run: atomic saving and the guard against overwriting an earlier run."""
import glob
import json
import os
import tempfile

import torch

from multi_train_utils.errors import UserError

RUN_FILES = ("checkpoint.pth", "metrics.csv", "args.json", "class_indices.json")


def earlier_run_files(output_dir):
    """Files in ``output_dir`` that an earlier training run wrote (checkpoints and metrics)."""
    found = sorted(glob.glob(os.path.join(glob.escape(output_dir), "model-*.pth")))
    found += [os.path.join(output_dir, f) for f in RUN_FILES if os.path.isfile(os.path.join(output_dir, f))]
    return found


def check_output_dir(output_dir, overwrite):
    """Refuse to start over an earlier run's checkpoints unless --overwrite is given."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise UserError(f"--output-dir {output_dir}: is a file; give a folder")
    earlier = [f for f in earlier_run_files(output_dir) if f.endswith(".pth")]
    if earlier and not overwrite:
        names = ", ".join(os.path.basename(f) for f in earlier[:3]) + (", ..." if len(earlier) > 3 else "")
        raise UserError(
            f"--output-dir {output_dir}: holds checkpoints of an earlier run ({names}); "
            "pass --overwrite to replace them, or choose another --output-dir"
        )


def clear_earlier_run(output_dir):
    """Delete an earlier run's files (for --overwrite); other files are left alone."""
    for path in earlier_run_files(output_dir):
        os.remove(path)


def _atomic_write(path, write):
    """Write via a temporary file in the same folder, fsync, then rename over ``path``.

    A crash at any point leaves either the old file or the new one, never half of one.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save_atomic(obj, path):
    """``torch.save`` that never leaves a half-written file behind."""
    _atomic_write(path, lambda f: torch.save(obj, f))


def write_json_atomic(obj, path):
    """Write ``obj`` as indented JSON, atomically."""
    _atomic_write(path, lambda f: f.write(json.dumps(obj, indent=2).encode()))
