"""The files, pipes and terminals behind one rank's ``RankIO``, while its worker starts and runs.

``core.workers.rank_io`` plans where each stream goes; this opens it. A stream that is neither
logged nor relayed is the worker's to inherit (the launcher's own file, pipe or terminal: its bytes
reach it untouched). Every other stream is a pipe whose other end the monitor copies (``TeeStream``)
to the log file, if any, and to the console: as prefixed lines (tee'd) or byte for byte (relayed),
in whole lines either way (ranks never interleave within a line). Where a tee'd stream is shown on a
terminal the pipe is a pseudo-terminal of the console's width less the prefix, so that the worker
draws its bars as it would in a terminal of its own.

A log file relaunch cannot write (a full disk, a quota, an I/O error) never fails the worker
nor the thread that copies: relaunch says once which file and why, stops writing that file,
keeps the console going, and keeps the last ``STDERR_TAIL_BYTES`` of each worker's stderr in
memory, so that the failure report still shows the root cause.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from relaunch.core.workers.rank_io import RankIO
from relaunch.procs.console import Console
from relaunch.procs.log_file import LogFile
from relaunch.procs.terminals import open_terminal

if TYPE_CHECKING:
    from relaunch.core.output.screen import ScreenFramer
    from relaunch.procs.duplicates import FilteredCopy

_READ_SIZE = 1 << 16
#: How much of a worker's stderr relaunch keeps in memory for the failure report (about 20 lines
#: of traceback are shown; a long last line or a stack dump fits too).
STDERR_TAIL_BYTES = 64 * 1024
#: The most a relayed stream holds of a line not ended yet: past it, the bytes are written as
#: they are (binary data, a bar redrawn with ``\r`` for ever), in order.
HOLD_BYTES = 64 * 1024
#: The most of a worker's output a stream keeps for the console before it is written: a long
#: line, or a worker that writes faster than the agent reads, goes on in pieces of about this
#: size, so that the agent's memory does not grow with what one worker writes at once.
PENDING_BYTES = 1 << 20


_told: set[int] = set()
_told_guard = threading.Lock()


def _first_time(code: int) -> bool:
    """Whether a log write error of this kind (errno) is the first this process meets."""
    with _told_guard:
        if code in _told:
            return False
        _told.add(code)
        return True


def log_error_line(path: str, error: str) -> bytes:
    """The one line that says a log file could not be written."""
    return (
        f"relaunch: cannot write {path}: {error}; that log stops here and the job goes on "
        "(the failure report keeps each rank's stderr tail in memory; other log files that "
        "fail so are not named)\n"
    ).encode(errors="replace")


class TeeStream:
    """One stream relaunch reads: bytes from a worker's pipe (or pseudo-terminal) to its log
    file, if any, and, unless ``shown`` is False, to the console: byte for byte when
    ``verbatim``, else as lines, prefixed.

    Either way the console gets whole lines, so that the ranks sharing it never interleave
    within a line. A verbatim stream holds the start of a line (``held``) until its newline
    comes, the stream ends, ``HOLD_BYTES`` are held (binary data, endless ``\r`` records), or it
    was held for ``console.HOLD_SECONDS`` (a prompt): then the bytes go as they are. Every byte
    goes on, unchanged and in order.

    Console output is rendered into ``pending`` and written by the monitor once per wake-up, for
    all streams together: under a flood of small writes that is one console write per round, not
    one per read; ``PENDING_BYTES`` at most, so a long line or a flood passes in pieces, never
    all held at once. In a tee'd stream, rows being redrawn (progress bars, live displays) become
    the stream's ``bar`` rather than lines; the log file gets every byte either way. A stderr
    stream keeps its last ``STDERR_TAIL_BYTES`` in ``tail``. A tee'd stream with a ``copy``
    (torch's duplicate filters) gives it its lines, prefixed ``copy_prefix``.
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
        *,
        log_path: str = "",
        shown: bool = True,
        verbatim: bool = False,
        copy: FilteredCopy | None = None,
        copy_prefix: bytes = b"",
    ) -> None:
        os.set_blocking(read_fd, False)
        self.read_fd = read_fd
        self.log = None if log_fd is None else LogFile(log_path, log_fd)
        self.console = console
        self.prefix = prefix
        self.err = err
        self.shown = shown
        self.verbatim = verbatim
        self.key = f"{prefix.decode(errors='replace')}{key}{'e' if err else 'o'}"
        self._framer: ScreenFramer | None = None
        #: Whether ``read_fd`` is a pseudo-terminal the console resizes.
        self.terminal = terminal
        self.pending: list[bytes] = []
        self._pending_size = 0
        #: The bar the stream redraws now (None: none), and whether the console must hear of it.
        self.bar: bytes | None = None
        self.bar_changed = False
        self.open = True
        #: The last bytes of a stderr stream, for the failure report (None: not kept).
        self.tail: bytearray | None = bytearray() if err else None
        #: A verbatim stream's bytes after its last newline, not written yet.
        self.held = bytearray()
        self.copy, self.copy_prefix = copy, copy_prefix
        if copy is not None:
            copy.hold()

    @property
    def framer(self) -> ScreenFramer:
        """What reads the stream as a terminal would show it: made with the first line shown
        (``core.output.screen``'s expressions cost 2 ms, which a launch that shows none skips)."""
        if self._framer is None:
            from relaunch.core.output.screen import ScreenFramer

            self._framer = ScreenFramer()
        return self._framer

    @property
    def log_fd(self) -> int | None:
        return None if self.log is None else self.log.fd

    @property
    def log_error(self) -> str:
        """Why the log file is incomplete ("" when it has every byte, or there is none)."""
        return "" if self.log is None else self.log.error

    def pump(self, until_empty: bool = False) -> bool:
        """Copy what the pipe holds to the log file; True once the pipe is at end of file.

        Woken by the selector, it reads while reads come full, until ``PENDING_BYTES`` wait
        for the console (the caller writes them; the selector wakes again while data remains);
        with ``until_empty`` it reads until the pipe is empty, as after the worker has exited,
        writing to the console every ``PENDING_BYTES`` on the way.
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
            self._keep(chunk)
            if self._pending_size >= PENDING_BYTES:
                if not until_empty:
                    return False
                self.write_pending()
            elif not until_empty and len(chunk) < _READ_SIZE:
                return False

    def _keep(self, chunk: bytes) -> None:
        if self.log is not None and not self.log.write(chunk):
            self._tell_log_error(self.log)
        if self.tail is not None:
            self.tail += chunk
            if len(self.tail) > 2 * STDERR_TAIL_BYTES:
                del self.tail[:-STDERR_TAIL_BYTES]
        if not self.shown:
            return
        if self.verbatim:
            self._relay(chunk)
            return
        lines, bar = self.framer.feed(chunk)
        if lines:
            shown = self.console.render(lines, self.prefix)
            if self.bar is not None and bar is None:  # its row ended: a line now
                shown = self.console.unprinted(self.key, shown)
            self._add_pending(shown)
            if self.copy is not None:
                self.copy.take(self.copy_prefix, lines)
        if bar is not None or self.bar is not None:
            self.bar_changed = self.bar_changed or bar != self.bar
            self.bar = bar

    def _relay(self, chunk: bytes) -> None:
        """Pass ``chunk`` on in whole lines, holding the start of a line not ended yet."""
        was_held = bool(self.held)
        end = chunk.rfind(b"\n") + 1
        line = b""
        if end:
            line = self.take_held() + chunk[:end] if was_held else chunk[:end]
        self.held += chunk[end:]
        if len(self.held) > HOLD_BYTES:
            line += self.take_held()
        if line:
            self._add_pending(line)
        # The console writes what is held HOLD_SECONDS after the first of it came.
        if was_held and (line or not self.held):
            self.console.unhold(self)
        if self.held and (line or not was_held):
            self.console.hold(self)

    def take_held(self) -> bytes:
        """The start of a line held, to be written as it is now (held a while, or the end)."""
        held = bytes(self.held)
        self.held.clear()
        return held

    def _tell_log_error(self, log: LogFile) -> None:
        if _first_time(log.errno):
            self.console.write(b"", log_error_line(log.path, log.error))

    def stderr_tail(self) -> bytes | None:
        """The last ``STDERR_TAIL_BYTES`` the stream carried (None: not a stderr stream)."""
        return None if self.tail is None else bytes(self.tail[-STDERR_TAIL_BYTES:])

    def shown_bar(self, bar: bytes) -> bytes:
        """``bar`` as the console shows it: each of its rows prefixed."""
        return self.prefix + bar.replace(b"\n", b"\n" + self.prefix) if bar else b""

    def _add_pending(self, data: bytes) -> None:
        self.pending.append(data)
        self._pending_size += len(data)

    def take_pending(self) -> bytes:
        data = b"".join(self.pending)
        self.pending.clear()
        self._pending_size = 0
        return data

    def write_pending(self) -> None:
        """Write what waits for the console now, rather than with the monitor's next round."""
        data = self.take_pending()
        self.console.write(b"" if self.err else data, data if self.err else b"")

    def finish(self) -> None:
        """Write out the last partial line (a bar's last state) and close the stream's files."""
        if not self.open:
            return
        self.open = False
        if self.shown and not self.verbatim:
            last = self.framer.flush()
            shown = self.console.render(last, self.prefix)
            if self.bar is not None:  # its rows end as lines
                shown = self.console.unprinted(self.key, shown)
            self._add_pending(shown)
            if self.copy is not None:
                self.copy.take(self.copy_prefix, last)
        if self.held:
            self.console.unhold(self)
            self._add_pending(self.take_held())
        if self.bar is not None:
            self.console.end_bar(self.key, print_last=False)  # the last line shows it
            self.bar = None
        self.write_pending()
        if self.terminal:
            self.console.worker_terminals.remove(self.read_fd)
        os.close(self.read_fd)
        if self.log is not None:
            failed_before = bool(self.log.error)
            self.log.close()
            if self.log.error and not failed_before:
                self._tell_log_error(self.log)
        if self.copy is not None:
            self.copy.release()


class StreamEnds:
    """Where one standard stream of one worker goes: inherited, or a pipe to relaunch, which
    copies it to its log file (``path``, if any) and, tee'd or relayed, to the console."""

    def __init__(self, path: str, tee: bool, relay: bool = False) -> None:
        self.path = path
        self.tee = tee
        self.relay = relay
        self.child_fd: int | None = None  # what the child writes to
        self.read_fd: int | None = None  # what the monitor reads
        self.log_fd: int | None = None  # where the monitor writes
        self.terminal = False  # read_fd is a pseudo-terminal

    def open(self, terminal: tuple[int, int] | None = None) -> None:
        """Open the stream's ends; ``terminal`` (columns, rows) makes a tee'd stream's pipe a
        terminal."""
        if not self.path and not self.relay:
            return
        if self.path:
            self.log_fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        terminal = terminal if self.tee else None
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
    ends relaunch reads pass to the monitor as ``TeeStream``s, which close them when the stream
    ends.
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

    def tees(
        self,
        console: Console,
        pid: int,
        copies: Mapping[bool, FilteredCopy] | None = None,
    ) -> list[TeeStream]:
        """A ``TeeStream`` per stream relaunch reads: tee'd ones shown as lines prefixed with the
        rank's prefix, relayed ones shown byte for byte, redirected ones not shown; the
        pseudo-terminals of worker ``pid`` follow the console's size. A tee'd stream also
        gives its lines to ``copies[err]``, if any (torch's duplicate filters)."""
        prefix = self.io.prefix.encode()
        copies = copies or {}
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
                log_path=ends.path,
                shown=ends.tee or ends.relay,
                verbatim=ends.relay and not ends.tee,
                copy=copies.get(err) if ends.tee else None,
                copy_prefix=prefix,
            )
            if ends.terminal:
                console.worker_terminals.add(ends.read_fd, len(self.io.prefix), pid)
            streams.append(stream)
        return streams
