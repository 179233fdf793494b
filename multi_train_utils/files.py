"""Safe file reading and atomic writing; the lock on --output-dir; train.log.

A crash never leaves half a file, and a file that would run code when loaded is refused.
A user's file is replaced only when asked and an input never; names that are not UTF-8
print escaped; CSV files open safely in a spreadsheet. One run writes into an --output-dir
at a time (an OS lock), and train.log keeps what rank 0 printed.
"""
import atexit
import csv
import datetime
import errno
import io
import json
import os
import pickle
import re
import shutil
import socket
import sys
import tempfile

import torch

from multi_train_utils.errors import UserError, disk_full_error, hold_stops, printable


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


# --- One writer per --output-dir: an OS lock on a file in it, held from the first write to exit ---
# The kernel drops the lock when the process ends, however it ends, so a crash never leaves a
# stale lock. It is a POSIX record lock (``fcntl.lockf``): such locks belong to the process
# that took them, so forked DataLoader workers do not hold it and cannot keep it alive after
# the run. On shared file systems it is as good as their locking: NFS mounted with ``nolock``
# or ``local_lock``, Lustre without ``-o flock`` and BeeGFS (by default) keep locks node-local,
# so two runs on two nodes are not kept apart there.

LOCK_FILE = "run.lock"
# The file system does not do locks at all (as opposed to: someone else holds it).
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}

try:
    import fcntl
except ImportError:  # Windows: no POSIX locks
    fcntl = None


class RunLock:
    """The lock on one output folder (where the file system has locks), held until the
    process ends."""

    def __init__(self, fd, path, made_folder, made_file, names_before):
        self.fd = fd
        self.path = path
        self.made = (made_folder, made_file)  # what taking the lock created
        self.names_before = names_before  # the folder's files when the lock was taken
        atexit.register(self.discard)  # a run stopped by bad input leaves no trace

    def discard(self):
        """Let the lock go; if the run wrote no new file into the folder, also remove the lock
        file and the folder, where taking the lock created them."""
        if self.fd is None:
            return
        made_folder, made_file = self.made
        folder = os.path.dirname(self.path)
        if made_file and _listing(folder) == sorted(self.names_before + [LOCK_FILE]):
            _remove_quietly(os.remove, self.path)
        if made_folder and _listing(folder) == []:
            _remove_quietly(os.rmdir, folder)
        os.close(self.fd)
        self.fd = None


def _listing(folder):
    try:
        return sorted(os.listdir(folder))
    except OSError:
        return None


def _remove_quietly(remove, path):
    try:
        remove(path)
    except OSError:
        pass


def lock_output_dir(output_dir):
    """Create ``output_dir`` if needed, check that files can be written there, and take its
    lock: a UserError if it cannot be written or another run holds it. Returns a RunLock;
    where the file system has no locks, one that holds none (with a warning), which still
    removes at exit what taking it created if the run wrote nothing."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise UserError(f"--output-dir {output_dir}: is a file; give a folder")
    made_folder = not os.path.exists(output_dir)
    path = os.path.join(output_dir, LOCK_FILE)
    for _ in range(3):
        made_file = not os.path.exists(path)
        fd = _open_lock_file(output_dir, path)
        names_before = [name for name in _listing(output_dir) or [] if name != LOCK_FILE]
        if fcntl is None:
            _warn_no_locks(path, output_dir, "cannot lock files on this system")
            return RunLock(fd, path, made_folder, made_file, names_before)  # no lock, the same clean-up
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in _NO_LOCKS:
                _warn_no_locks(path, output_dir, f"this file system does not lock files ({e.strerror})")
                return RunLock(fd, path, made_folder, made_file, names_before)  # no lock, the same clean-up
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno in (errno.EACCES, errno.EAGAIN):
                raise UserError(f"--output-dir {output_dir}: another run is writing there ({holder}); wait for it "
                                "to finish, stop it, or choose another --output-dir") from None
            raise UserError(f"--output-dir {output_dir}: cannot lock {LOCK_FILE} ({e.strerror})") from None
        if _same_file(fd, path):  # not removed by a run that gave up on bad input meanwhile
            _write_holder(fd)
            return RunLock(fd, path, made_folder, made_file, names_before)
        os.close(fd)
    raise UserError(f"--output-dir {output_dir}: {LOCK_FILE} keeps being replaced; is another run starting there?")


def _warn_no_locks(path, output_dir, why):
    print(f"warning: {path}: {why}; make sure no other run writes into {output_dir}", file=sys.stderr, flush=True)


def _open_lock_file(output_dir, path):
    """The lock file, opened for writing, after checking that a new file can be made there."""
    try:
        os.makedirs(output_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):  # the files of the run will be new files
            pass
        return os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as e:
        raise UserError(f"--output-dir {output_dir}: cannot write there ({e.strerror}); "
                        "choose a folder you can write to") from None


def _same_file(fd, path):
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def _write_holder(fd):
    """Say in the lock file who holds it, for the run that finds it taken."""
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    text = f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n"
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode(), 0)
    except OSError:  # a full disk: the lock holds all the same
        pass


def _read_holder(fd):
    """The holder as its lock file describes it."""
    try:
        text = os.pread(fd, 300, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return f"held by {text}" if text else "its lock is held"


# --- train.log: a copy of what rank 0 prints, readable after the terminal is gone -------------

def _last_state(line):
    """A line redrawn with carriage returns (a progress bar): what it showed last."""
    return line.rstrip("\r").rsplit("\r", 1)[-1]


class _Tee(io.TextIOBase):
    """A text stream that writes to the terminal and, as plain lines, to a log file."""

    def __init__(self, stream, log):
        self.stream = stream
        self.log = log
        self.line = ""

    def write(self, text):
        length = len(text)
        text = printable(text)  # a file or class name that is not UTF-8: escaped, never an error
        try:
            self.stream.write(text)
        except UnicodeEncodeError:  # a terminal that cannot show every character (an ASCII locale)
            encoding = self.stream.encoding or "ascii"
            self.stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
        *complete, self.line = (self.line + text).split("\n")
        head, sep, _ = self.line.rstrip("\r").rpartition("\r")
        if sep:  # keep only the latest redraw of an unfinished line
            self.line = self.line[len(head) + 1:]
        if complete:
            self.log.write("".join(_last_state(line) + "\n" for line in complete))
        return length

    def finish(self):
        if _last_state(self.line).strip():
            self.log.write(_last_state(self.line) + "\n")
        self.line = ""

    def flush(self):
        self.stream.flush()

    def isatty(self):
        return self.stream.isatty()

    def fileno(self):
        return self.stream.fileno()

    @property
    def encoding(self):
        return self.stream.encoding


class RunLog:
    """Copies this process's stdout and stderr, as plain lines (progress bars as their final
    state, no carriage returns): held in memory from the start, then into the file given to
    ``attach`` once the output folder is known to be usable."""

    def __init__(self):
        self.file = None
        self.pending = []
        self.streams = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = _Tee(sys.stdout, self), _Tee(sys.stderr, self)

    def write(self, text):
        if self.file is None:
            self.pending.append(text)
        elif not self.file.closed:
            try:
                self.file.write(text)
                self.file.flush()
            except OSError as e:  # a full disk: what is printed must still reach the terminal
                self._stop_copying(e)

    def _stop_copying(self, error):
        """Close train.log after a failed write, and say so on the terminal, once."""
        try:
            self.file.close()
        except OSError:
            pass  # the close flushes what did not fit either
        self.streams[1].write(f"warning: {self.file.name}: cannot write ({error.strerror or error}); "
                              "no longer copying the output there\n")
        self.streams[1].flush()

    def attach(self, path, append=False):
        """Write what was printed so far to ``path`` (appending: a resumed run), then keep copying."""
        self.file = open(path, "a" if append else "w", encoding="utf-8")
        self.write("".join(self.pending))
        self.pending = []

    def close(self):
        """Stop copying and close the file."""
        for tee in (sys.stdout, sys.stderr):
            if isinstance(tee, _Tee) and tee.log is self:
                tee.finish()
        sys.stdout, sys.stderr = self.streams
        if self.file is not None and not self.file.closed:
            self.file.close()
