"""train.log: a copy of what rank 0 prints, readable after the terminal is gone."""
import io
import sys

from multi_train_utils.errors import printable


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
