"""The files and pipes behind one rank's ``RankIO``, while its worker starts and runs.

``core.rank_io`` plans where each stream goes; this opens it: a log file the child writes to, or,
for a tee'd stream, a pipe whose other end the monitor copies (``TeeStream``) to the log file and
the console.
"""

from __future__ import annotations

import os

from relaunch.core.lines import ConsoleFramer
from relaunch.core.rank_io import RankIO
from relaunch.procs.console import Console

_READ_SIZE = 1 << 16


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class TeeStream:
    """One tee'd stream: bytes from a worker's pipe to its log file and, as lines, to a console.

    Console output is rendered into ``pending`` and written by the monitor once per wake-up, for
    all streams together: under a flood of small writes that is one console write per round, not
    one per read. Carriage-return refreshes (progress bars) become the stream's ``bar`` rather
    than lines; the log file gets every byte either way.
    """

    def __init__(
        self, read_fd: int, log_fd: int, console: Console, prefix: bytes, err: bool = False
    ) -> None:
        os.set_blocking(read_fd, False)
        self.read_fd = read_fd
        self.log_fd = log_fd
        self.console = console
        self.prefix = prefix
        self.err = err
        self.key = f"{prefix.decode(errors='replace')}{'e' if err else 'o'}"
        self.framer = ConsoleFramer()
        self.pending: list[bytes] = []
        #: The bar the stream redraws now (None: none), and whether the console must hear of it.
        self.bar: bytes | None = None
        self.bar_changed = False
        self.open = True

    def pump(self, until_empty: bool = False) -> bool:
        """Copy what the pipe holds to the log file; True once the pipe is at end of file.

        One read is enough when woken by the selector (it wakes again while data remains); with
        ``until_empty`` it reads until the pipe is empty, as after the worker has exited.
        """
        while True:
            try:
                chunk = os.read(self.read_fd, _READ_SIZE)
            except BlockingIOError:
                return False
            except InterruptedError:
                continue
            if not chunk:
                return True
            write_all(self.log_fd, chunk)
            lines, bar = self.framer.feed(chunk)
            if lines:
                self.pending.append(self.console.render(lines, self.prefix))
            if bar is not None or self.bar is not None:
                self.bar_changed = self.bar_changed or bar != self.bar
                self.bar = bar
            if not until_empty and len(chunk) < _READ_SIZE:
                return False

    def take_pending(self) -> bytes:
        data = b"".join(self.pending)
        self.pending.clear()
        return data

    def finish(self) -> None:
        """Write out the last partial line (a bar's last state) and close the stream's files."""
        if not self.open:
            return
        self.open = False
        self.pending.append(self.console.render(self.framer.flush(), self.prefix))
        if self.bar is not None:
            self.console.end_bar(self.key, print_last=False)  # the last line shows it
            self.bar = None
        data = self.take_pending()
        self.console.write(b"" if self.err else data, data if self.err else b"")
        os.close(self.read_fd)
        os.close(self.log_fd)


class StreamEnds:
    """Where one standard stream of one worker goes: inherited, a file, or a tee pipe."""

    def __init__(self, path: str, tee: bool) -> None:
        self.path = path
        self.tee = tee
        self.child_fd: int | None = None  # what the child writes to
        self.read_fd: int | None = None  # tee: what the monitor reads
        self.log_fd: int | None = None  # tee: where the monitor writes

    def open(self) -> None:
        if not self.path:
            return
        log_fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if self.tee:
            self.read_fd, self.child_fd = os.pipe()
            self.log_fd = log_fd
        else:
            self.child_fd = log_fd

    def close_child_end(self) -> None:
        if self.child_fd is not None:
            os.close(self.child_fd)
            self.child_fd = None

    def close_all(self) -> None:
        self.close_child_end()
        for fd in (self.read_fd, self.log_fd):
            if fd is not None:
                os.close(fd)
        self.read_fd = self.log_fd = None


class RankStreams:
    """The stdout and stderr of one rank, opened as its ``RankIO`` says.

    The child's ends are closed here once the worker started (it holds its own copies); the
    tee'd ends pass to the monitor as ``TeeStream``s, which close them when the stream ends.
    """

    def __init__(self, io: RankIO) -> None:
        self.io = io
        self.stdout = StreamEnds(io.stdout, io.tee_stdout)
        self.stderr = StreamEnds(io.stderr, io.tee_stderr)

    def open(self) -> None:
        self.stdout.open()
        self.stderr.open()

    def close_child_ends(self) -> None:
        self.stdout.close_child_end()
        self.stderr.close_child_end()

    def close_all(self) -> None:
        """Close every end (a start that failed)."""
        self.stdout.close_all()
        self.stderr.close_all()

    def tees(self, console: Console) -> list[TeeStream]:
        """A ``TeeStream`` per tee'd stream, its lines prefixed with the rank's prefix."""
        prefix = self.io.prefix.encode()
        return [
            TeeStream(
                ends.read_fd,
                ends.log_fd,
                console,
                console.prefix(prefix, self.io.local_rank, err),
                err,
            )
            for ends, err in ((self.stdout, False), (self.stderr, True))
            if ends.read_fd is not None and ends.log_fd is not None
        ]
