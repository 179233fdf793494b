"""One writer per --output-dir: an OS lock on a file in it, held from the first write to exit.

The kernel drops the lock when the process ends, however it ends, so a crash never leaves a
stale lock. It is a POSIX record lock (``fcntl.lockf``): such locks belong to the process
that took them, so forked DataLoader workers do not hold it and cannot keep it alive after
the run. On shared file systems it is as good as their locking: NFS mounted with ``nolock``
or ``local_lock``, Lustre without ``-o flock`` and BeeGFS (by default) keep locks node-local,
so two runs on two nodes are not kept apart there.
"""
import atexit
import datetime
import errno
import os
import socket
import sys
import tempfile

from multi_train_utils.errors import UserError

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
