"""Safe file reading and atomic writing.

A crash never leaves half a file, and a file that would run code when loaded is refused.
A user's file is replaced only when asked and an input never; names that are not UTF-8
print escaped; CSV files open safely in a spreadsheet."""
import csv
import io
import json
import os
import pickle
import re
import shutil
import tempfile

import torch

from multi_train_utils.errors import UserError, disk_full_error, printable
from multi_train_utils.signals import hold_stops


def _atomic_write(path, write, before_replace=None):
    """Write via a temporary file in the same folder, fsync, call ``before_replace()`` (if
    given), then rename over ``path``.

    A crash at any point leaves either the old file or the new one, never half of one, and
    no temporary file; a full disk is a ResourceError naming ``path``. The temporary name is
    unique, so concurrent runs never collide.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with hold_stops():  # Ctrl-C during the write: raised once the file is in place
            os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes owner-only files; use the usual mode
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            if before_replace is not None:
                before_replace()
            os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        full = disk_full_error(e, path) if isinstance(e, Exception) else None
        if full is not None:
            raise full from None
        raise


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_atomic(obj, path, before_replace=None):
    """``torch.save`` that never leaves a half-written file behind (``before_replace``: see _atomic_write).
    Every tensor is saved on the CPU (see ``cpu_tensors``)."""
    obj = cpu_tensors(obj)
    _atomic_write(path, lambda f: torch.save(obj, f), before_replace)


def link_atomic(path, target):
    """Make ``target`` the file ``path`` is, without writing its bytes again: a hard link
    (one file on disk under two names), or a copy where the file system has no hard links;
    atomically (``target`` is the old file or the new one, never a part)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp",
                               dir=os.path.dirname(os.path.abspath(target)))
    os.close(fd)
    try:
        os.remove(tmp)
        try:
            os.link(path, tmp)
        except OSError:
            shutil.copyfile(path, tmp)
        os.replace(tmp, target)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        full = disk_full_error(e, target) if isinstance(e, Exception) else None
        if full is not None:  # the copy (no hard links here) did not fit
            raise full from None
        raise


def folder_bytes(folder):
    """(bytes, files) that ``folder`` and its sub-folders hold on disk, a file with several
    names (hard links) counted once."""
    seen = {}
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                info = os.stat(os.path.join(root, name), follow_symlinks=False)
            except OSError:  # gone meanwhile
                continue
            seen[(info.st_dev, info.st_ino)] = info.st_size
    return sum(seen.values()), len(seen)


def format_bytes(count):
    """A byte count as people read it: 512 B, 43.6 MB, 1.2 GB."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def cpu_tensors(obj):
    """``obj`` with every tensor in it (nested in dicts, lists and tuples) on the CPU; anything
    else is left as it is. Saved CUDA tensors would load onto cuda:0 elsewhere, or not at all
    on a machine without a GPU."""
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        copy = type(obj)((key, cpu_tensors(value)) for key, value in obj.items())
        if hasattr(obj, "_metadata"):  # a state dict's layer versions, which loading reads
            copy._metadata = obj._metadata
        return copy
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(cpu_tensors(value) for value in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_tensors(value) for value in obj)
    return obj


def write_json_atomic(obj, path):
    """Write ``obj`` as indented JSON, atomically."""
    write_text_atomic(json.dumps(obj, indent=2), path)


def write_text_atomic(text, path):
    """Write a text file (UTF-8) atomically; a file or class name that is not UTF-8 keeps its own bytes."""
    write_bytes_atomic(text.encode("utf-8", "surrogateescape"), path)


def write_bytes_atomic(data, path):
    """Write a file's bytes atomically."""
    _atomic_write(path, lambda f: f.write(data))


def write_csv_atomic(rows, path):
    """Write rows (lists of cells) as a CSV file (see ``csv_text``), atomically."""
    write_text_atomic(csv_text(rows), path)


# --- Outputs that never replace a user's file -----------------------------------------------------

def check_new_output(path, inputs, overwrite, flag="--output"):
    """Refuse to write ``path`` over one of ``inputs`` ((what, path) pairs), even with
    --overwrite; over a folder; or over an existing file unless ``overwrite``. Files are
    compared by device and inode, so a symbolic link, a hard link or another spelling of an
    input (./, ..) is recognised."""
    if os.path.isdir(path):
        raise UserError(f"{flag} {printable(path)}: is a folder; give the name of a file to write")
    if not os.path.lexists(path):
        return  # a new name cannot be an input
    target = _file_identity(path)
    for what, source in inputs:
        if target is not None and _file_identity(source) == target:
            raise UserError(f"{flag} {printable(path)}: is {what} ({printable(source)}), which this command reads; "
                            "choose another path (even --overwrite never writes over an input)")
    if not overwrite:
        raise UserError(f"{flag} {printable(path)}: exists; pass --overwrite to replace it, or choose another path")


def _file_identity(path):
    """(device, inode) of the file ``path`` leads to, or None if it leads to none."""
    try:
        info = os.stat(path)
    except (OSError, ValueError):  # missing, a dangling link or a loop: no file to protect
        return None
    return info.st_dev, info.st_ino


# --- Names and cells that are safe to print and to open -------------------------------------------

# A cell starting with one of these is a formula in Excel, LibreOffice and Google Sheets (OWASP
# "CSV injection"); a number such as -0.5 (or -inf) is not text and stays as it is.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
NUMBER_TEXT = re.compile(r"[-+]?((\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|inf|nan)", re.IGNORECASE)


def spreadsheet_safe(cell):
    """A CSV cell that a spreadsheet shows as it is: text starting with =, +, -, @, a tab or a
    carriage return gets a leading ' (so it is never run as a formula) and is made printable."""
    if not isinstance(cell, str):
        return cell
    cell = printable(cell)
    return "'" + cell if cell.startswith(FORMULA_STARTS) and not NUMBER_TEXT.fullmatch(cell) else cell


def csv_text(rows):
    """Rows (lists of cells) as CSV text by the csv module, which quotes a cell holding a comma,
    quote or line break; every cell passes through ``spreadsheet_safe``."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)  # lines end in \r\n (RFC 4180), so a cell with a lone \r is quoted too
    writer.writerows([spreadsheet_safe(cell) for cell in row] for row in rows)
    return buffer.getvalue()


# --- Reading ----------------------------------------------------------------------------------------

def read_json(path, hint="fix or delete it"):
    """The JSON in ``path``; a UserError naming the file (and saying ``hint``) if it cannot be read."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot be read as JSON ({e}); {hint}") from None


def _is_whole(value):
    return isinstance(value, int) and not isinstance(value, bool)


# Kinds of values in a run's files: (test, how an error message names the kind).
WHOLE_NUMBER = (_is_whole, "a whole number")
WHOLE_NUMBER_OR_NULL = (lambda v: v is None or _is_whole(v), "a whole number or null")
FLAG = (lambda v: isinstance(v, bool), "true or false")
NUMBER = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number")
NUMBER_OR_NULL = (lambda v: v is None or NUMBER[0](v), "a number or null")
TEXT = (lambda v: isinstance(v, str), "a string")
TEXT_OR_NULL = (lambda v: v is None or isinstance(v, str), "a string or null")
MAPPING = (lambda v: isinstance(v, dict), "a dict")
MAPPING_OR_NULL = (lambda v: v is None or isinstance(v, dict), "a dict or null")
TEXT_LIST = (lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v), "a list of strings")
ROWS = (lambda v: isinstance(v, (list, tuple)) and all(isinstance(r, (list, tuple)) for r in v), "a list of rows")
TENSOR_OR_NULL = (lambda v: v is None or torch.is_tensor(v), "a tensor or null")
STATE_DICT = (lambda v: isinstance(v, dict) and all(isinstance(k, str) and torch.is_tensor(t) for k, t in v.items()),
              "a dict of parameter names to tensors")


def check_fields(values, kinds, where, hint):
    """Every field of ``values`` named in ``kinds`` ({field: kind}) that is there must be of
    that kind; else a UserError naming ``where`` and the field, and saying ``hint``."""
    for field, (test, description) in kinds.items():
        if field in values and not test(values[field]):
            shown = repr(values[field])
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            raise UserError(f'{where}: its "{field}" is {shown} ({type(values[field]).__name__}), not '
                            f"{description}; {hint}")


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
