"""The workers' pseudo-terminals: opened as wide as the launcher's terminal less the console
prefix, and resized with it."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import struct
import threading
from collections.abc import Callable
from types import FrameType

log = logging.getLogger(__name__)


def pty_size(size: os.terminal_size, prefix_width: int) -> tuple[int, int]:
    """(columns, rows) of a worker's terminal: the launcher's, less the prefix and the last
    column (a row that fills a terminal wraps on some)."""
    return max(20, size.columns - prefix_width - 1), size.lines


def _set_size(fd: int, columns: int, rows: int) -> None:
    import termios  # here: only workers given a terminal need it

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))


def open_terminal(columns: int, rows: int) -> tuple[int, int]:
    """A pseudo-terminal of ``columns`` x ``rows``: (the end relaunch reads, the worker's end).

    Newlines are left as the worker wrote them (no CR LF), so the log file gets its bytes.
    """
    read_fd, child_fd = os.openpty()
    try:
        _set_size(child_fd, columns, rows)
        import termios

        attributes = termios.tcgetattr(child_fd)
        attributes[1] &= ~termios.ONLCR
        termios.tcsetattr(child_fd, termios.TCSANOW, attributes)
    except BaseException:
        os.close(read_fd)
        os.close(child_fd)
        raise
    return read_fd, child_fd


class WorkerTerminals:
    """The open pseudo-terminals of the workers, to resize with the launcher's terminal."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, tuple[int, int]] = {}  # read end -> (prefix width, worker pid)

    def add(self, fd: int, prefix_width: int, pid: int) -> None:
        with self._lock:
            self._open[fd] = (prefix_width, pid)

    def remove(self, fd: int) -> None:
        with self._lock:
            self._open.pop(fd, None)

    def resize(self, size: os.terminal_size) -> None:
        """Give every terminal ``size`` less its prefix, and tell its worker (SIGWINCH to its
        process group: it is not the worker's controlling terminal, the kernel tells it
        nothing)."""
        with self._lock:
            for fd, (prefix_width, pid) in self._open.items():
                try:
                    _set_size(fd, *pty_size(size, prefix_width))
                    os.killpg(pid, signal.SIGWINCH)
                except OSError as exc:
                    if exc.errno not in (errno.ESRCH, errno.EIO, errno.EBADF):  # it is gone
                        log.warning("could not resize the terminal of pid %d: %s", pid, exc)


def on_resize(callback: Callable[[], None]) -> None:
    """Call ``callback()`` (from a signal handler: it must only set a flag or wake a thread)
    when the launcher's terminal is resized, unless the program handles SIGWINCH already or
    this is not the main thread (only it may set signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGWINCH) not in (signal.SIG_DFL, None):
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        callback()

    signal.signal(signal.SIGWINCH, handler)
