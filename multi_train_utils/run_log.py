"""train.log: a copy of what rank 0 prints, readable after the terminal is gone."""
import io
import sys


def _last_state(line):
    """A line redrawn with carriage returns (a progress bar): what it showed last."""
    return line.rstrip("\r").rsplit("\r", 1)[-1]


class _Tee(io.TextIOBase):
    """A text stream that writes to the terminal and, as plain lines, to a log file."""

    def __init__(self, stream, file):
        self.stream = stream
        self.file = file
        self.line = ""

    def write(self, text):
        self.stream.write(text)
        *complete, self.line = (self.line + text).split("\n")
        head, sep, _ = self.line.rstrip("\r").rpartition("\r")
        if sep:  # keep only the latest redraw of an unfinished line
            self.line = self.line[len(head) + 1:]
        if complete and not self.file.closed:
            self.file.write("".join(_last_state(line) + "\n" for line in complete))
            self.file.flush()
        return len(text)

    def finish(self):
        if _last_state(self.line).strip() and not self.file.closed:
            self.file.write(_last_state(self.line) + "\n")
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
    """From now on, copies this process's stdout and stderr into ``path`` as plain lines
    (progress bars as their final state, no carriage returns)."""

    def __init__(self, path, append=False):
        self.file = open(path, "a" if append else "w", encoding="utf-8")
        self.streams = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = _Tee(sys.stdout, self.file), _Tee(sys.stderr, self.file)

    def close(self):
        """Stop copying and close the file."""
        if self.file.closed:
            return
        for tee in (sys.stdout, sys.stderr):
            if isinstance(tee, _Tee):
                tee.finish()
        sys.stdout, sys.stderr = self.streams
        self.file.close()
