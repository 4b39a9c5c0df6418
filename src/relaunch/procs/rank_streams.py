"""The files, pipes and terminals behind one rank's ``RankIO``, while its worker starts and runs.

``core.rank_io`` plans where each stream goes; this opens it: a log file the child writes to, or,
for a stream relaunch shows on its console (tee'd, or relayed), a pipe whose other end the
monitor copies (``TeeStream``) to the log file, if any, and the console. Where that console is a
terminal the pipe is a pseudo-terminal of the console's width less the prefix, so that the
worker draws its bars as it would in a terminal of its own.
"""

from __future__ import annotations

import errno
import os

from relaunch.core.rank_io import RankIO
from relaunch.core.screen import ScreenFramer
from relaunch.procs.console import Console
from relaunch.procs.terminals import open_terminal

_READ_SIZE = 1 << 16


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class TeeStream:
    """One stream shown on a console: bytes from a worker's pipe (or pseudo-terminal) to its log
    file, if any, and, as lines, to the console.

    Console output is rendered into ``pending`` and written by the monitor once per wake-up, for
    all streams together: under a flood of small writes that is one console write per round, not
    one per read. Rows being redrawn (progress bars, live displays) become the stream's ``bar``
    rather than lines; the log file gets every byte either way.
    """

    def __init__(
        self,
        read_fd: int,
        log_fd: int | None,
        console: Console,
        prefix: bytes,
        err: bool = False,
        key: str = "",
        terminal: bool = False,
    ) -> None:
        os.set_blocking(read_fd, False)
        self.read_fd = read_fd
        self.log_fd = log_fd
        self.console = console
        self.prefix = prefix
        self.err = err
        self.key = f"{prefix.decode(errors='replace')}{key}{'e' if err else 'o'}"
        self.framer = ScreenFramer()
        #: Whether ``read_fd`` is a pseudo-terminal the console resizes.
        self.terminal = terminal
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
            except OSError as error:  # a pseudo-terminal whose worker side is closed
                if error.errno != errno.EIO:
                    raise
                return True
            if not chunk:
                return True
            if self.log_fd is not None:
                write_all(self.log_fd, chunk)
            lines, bar = self.framer.feed(chunk)
            if lines:
                self.pending.append(self.console.render(lines, self.prefix))
            if bar is not None or self.bar is not None:
                self.bar_changed = self.bar_changed or bar != self.bar
                self.bar = bar
            if not until_empty and len(chunk) < _READ_SIZE:
                return False

    def shown_bar(self, bar: bytes) -> bytes:
        """``bar`` as the console shows it: each of its rows prefixed."""
        return self.prefix + bar.replace(b"\n", b"\n" + self.prefix) if bar else b""

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
        if self.terminal:
            self.console.worker_terminals.remove(self.read_fd)
        os.close(self.read_fd)
        if self.log_fd is not None:
            os.close(self.log_fd)


class StreamEnds:
    """Where one standard stream of one worker goes: inherited, a file, or a pipe to relaunch
    (tee'd to a file and the console, or relayed to the console only)."""

    def __init__(self, path: str, tee: bool, relay: bool = False) -> None:
        self.path = path
        self.tee = tee
        self.relay = relay
        self.child_fd: int | None = None  # what the child writes to
        self.read_fd: int | None = None  # tee or relay: what the monitor reads
        self.log_fd: int | None = None  # tee: where the monitor writes
        self.terminal = False  # read_fd is a pseudo-terminal

    def open(self, terminal: tuple[int, int] | None = None) -> None:
        """Open the stream's ends; ``terminal`` (columns, rows) makes its pipe a terminal."""
        if not self.path and not self.relay:
            return
        if self.path and not self.tee:
            self.child_fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            return
        if self.path:
            self.log_fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.read_fd, self.child_fd = open_terminal(*terminal) if terminal else os.pipe()
        self.terminal = terminal is not None

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
        self.stdout = StreamEnds(io.stdout, io.tee_stdout, io.relay_stdout)
        self.stderr = StreamEnds(io.stderr, io.tee_stderr, io.relay_stderr)

    def open(self, console: Console) -> None:
        """Open both streams; those shown on a terminal get one of their own."""
        width = len(self.io.prefix)
        self.stdout.open(console.terminal_size(err=False, prefix_width=width))
        self.stderr.open(console.terminal_size(err=True, prefix_width=width))

    def close_child_ends(self) -> None:
        self.stdout.close_child_end()
        self.stderr.close_child_end()

    def close_all(self) -> None:
        """Close every end (a start that failed)."""
        self.stdout.close_all()
        self.stderr.close_all()

    def tees(self, console: Console, pid: int) -> list[TeeStream]:
        """A ``TeeStream`` per stream shown on the console, its lines prefixed with the rank's
        prefix (relayed streams have none); the pseudo-terminals of worker ``pid`` follow the
        console's size."""
        prefix = self.io.prefix.encode()
        streams = []
        for ends, err in ((self.stdout, False), (self.stderr, True)):
            if ends.read_fd is None:
                continue
            stream = TeeStream(
                ends.read_fd,
                ends.log_fd,
                console,
                console.prefix(prefix, self.io.local_rank, err) if ends.tee else b"",
                err,
                key=f"{self.io.local_rank}:",
                terminal=ends.terminal,
            )
            if ends.terminal:
                console.worker_terminals.add(ends.read_fd, len(self.io.prefix), pid)
            streams.append(stream)
        return streams
