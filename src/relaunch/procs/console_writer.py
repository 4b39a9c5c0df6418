"""Writing bytes to one of the launcher's streams: each piece whole, never mixed with another
thread's, and every byte written even on a non-blocking descriptor. ``Console`` (the live area
and the bars) writes through two of these; a log tail writes through one of its own."""

from __future__ import annotations

import os
import select
import threading
from typing import TextIO

from relaunch.core.output.console_plan import console_shared
from relaunch.core.output.lines import prefix_lines

#: How long a writer waits for a progress bar to clear itself before writing anyway.
PROGBAR_CLEAR_TIMEOUT = 0.5

ProgbarEvents = dict[str, threading.Event]

_locks: dict[int, threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock_for(dst: TextIO) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(id(dst), threading.Lock())


class ConsoleWriter:
    """Writes prefixed complete lines to ``dst`` in one piece, so ranks never interleave mid-line.

    Bytes go to ``dst.buffer`` when there is one (undecodable bytes pass through untouched), else
    they are decoded with replacement characters. With ``progbar_events`` (ice-learn's handshake),
    each batch of lines first asks the progress bar to clear itself (``trigger_clear``), waits a
    bounded time for ``cleared``, writes every line as ``\\r{line}\\033[K\\n``, then lets the bar
    redraw by clearing ``trigger_clear``.
    """

    def __init__(self, dst: TextIO, progbar_events: ProgbarEvents | None = None) -> None:
        self.stream = dst
        self._dst = dst
        self._binary = getattr(dst, "buffer", None)
        self._progbar = progbar_events
        self._lock = _lock_for(dst)
        # Other launchers' workers write to this console too (one node's replica groups): a
        # write of at most PIPE_BUF bytes to a pipe is never mixed with another's.
        self._whole_lines = console_shared(os.environ)

    def render(self, lines: bytes, prefix: bytes) -> bytes:
        """Complete lines (each ending in ``\\n``) as they will appear: each one prefixed."""
        return prefix_lines(lines, prefix, progress_safe=self._progbar is not None)

    def write(self, rendered: bytes) -> None:
        """Write what ``render`` made, in one piece, after the progress bar (if any) cleared."""
        if not rendered:
            return
        if self._progbar is None:
            self._write(rendered)
            return
        trigger, cleared = self._progbar["trigger_clear"], self._progbar["cleared"]
        trigger.set()
        try:
            cleared.wait(PROGBAR_CLEAR_TIMEOUT)
            self._write(rendered)
        finally:
            trigger.clear()

    def write_raw(self, data: bytes) -> None:
        """Write ``data`` as it is (terminal control sequences), without the handshake."""
        if data:
            self._write(data)

    def write_lines(self, lines: bytes, prefix: bytes) -> None:
        self.write(self.render(lines, prefix))

    def _write(self, data: bytes) -> None:
        with self._lock:
            try:
                if self._binary is not None:
                    self._dst.flush()
                    self._binary.flush()
                    fd = _fileno(self._binary)
                    if fd is None:
                        self._binary.write(data)
                        self._binary.flush()
                    else:
                        # Straight to the descriptor: a buffered writer on a non-blocking one
                        # (a pipe shared with a program that set O_NONBLOCK) drops what it
                        # cannot write at once; ``write_all`` waits for room instead.
                        if self._whole_lines:
                            for piece in line_pieces(data, select.PIPE_BUF):
                                write_all(fd, piece)
                        else:
                            write_all(fd, data)
                else:
                    self._dst.write(data.decode("utf-8", errors="replace"))
                    self._dst.flush()
            except (OSError, ValueError):
                # A closed or broken console must not stop the log files from being written.
                pass


def _fileno(stream: object) -> int | None:
    try:
        fd = stream.fileno()  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return None
    return fd if isinstance(fd, int) else None


def line_pieces(data: bytes, most: int) -> list[bytes]:
    """``data`` cut after a line's end into pieces of at most ``most`` bytes (a longer line is
    a piece of its own)."""
    pieces: list[bytes] = []
    start = 0
    while len(data) - start > most:
        end = data.rfind(b"\n", start, start + most) + 1
        if end <= start:  # a line longer than ``most``: whole, as one piece
            end = data.find(b"\n", start + most) + 1 or len(data)
        pieces.append(data[start:end])
        start = end
    if start < len(data):
        pieces.append(data[start:])
    return pieces


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of ``data`` to ``fd``: a partial write goes on from where it stopped, and
    a non-blocking descriptor that is full is waited on rather than dropped."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except InterruptedError:
            continue
        except BlockingIOError:
            waiter = select.poll()  # not select(): descriptors past 1023 are common here
            waiter.register(fd, select.POLLOUT)
            waiter.poll()
