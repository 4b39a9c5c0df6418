"""The FIFO the file timers talk through: who may be trusted to have made it, and reading the
requests on it (``FifoRequestQueue``, one request a line) with a blocking ``poll`` that a stop
can wake. What a line means is the caller's (``file_based_local_timer.parse_request``)."""

from __future__ import annotations

import errno
import math
import os
import select
import stat
from collections.abc import Callable

from relaunch.core.output.lines import LineFramer
from relaunch.timer.base import RequestQueue, TimerRequest

#: A line longer than this on the pipe is garbage: it is reported malformed, not buffered.
_MAX_LINE = 64 * 1024
#: The longest one wait in ``poll`` (its timeout is a C int of milliseconds).
_MAX_POLL_MS = 2**31 - 1


def check_fifo(path: str) -> None:
    """Refuse a path a client would send to that is missing or no FIFO (one line saying why)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(
            f"timer file {path} does not exist: is the timer server running?"
        ) from None
    if not stat.S_ISFIFO(mode):
        raise ValueError(f"timer file {path} is not a FIFO (named pipe)")


def check_server_fifo(path: str) -> None:
    """Refuse an existing FIFO a server would read from (ValueError, one line saying why): it
    must be a FIFO itself (not a symbolic link to one), owned by this user, and writable by
    nobody else, since whoever can write to it names the pids the server signals."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return  # the server creates it
    except OSError as exc:
        raise ValueError(f"timer file {path}: {exc.strerror}") from None
    _check_fifo_owner(path, info)


def _check_fifo_owner(path: str, info: os.stat_result) -> None:
    if stat.S_ISLNK(info.st_mode):
        raise ValueError(
            f"timer file {path} is a symbolic link: name the FIFO itself, or leave "
            "TORCHELASTIC_TIMER_FILE unset for one of relaunch's own"
        )
    if not stat.S_ISFIFO(info.st_mode):
        raise ValueError(f"timer file {path} is not a FIFO (named pipe)")
    if info.st_uid != os.geteuid():
        raise ValueError(
            f"timer file {path} belongs to uid {info.st_uid}, not to this user "
            f"({os.geteuid()}): whoever writes to it names the pids the timer server kills; "
            "remove it, or leave TORCHELASTIC_TIMER_FILE unset for one of relaunch's own"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(
            f"timer file {path} is writable by other users (mode "
            f"{stat.S_IMODE(info.st_mode):o}): whoever writes to it names the pids the timer "
            f"server kills; chmod 600 {path}, or leave TORCHELASTIC_TIMER_FILE unset"
        )


class FifoRequestQueue(RequestQueue):
    """Requests from the FIFO, each line read by ``parse`` (ValueError: malformed, passed to
    ``on_malformed`` with the reason); ``get`` blocks in ``poll`` on it and a wake-up pipe."""

    def __init__(
        self,
        parse: Callable[[bytes], TimerRequest],
        on_malformed: Callable[[bytes, str], None],
    ) -> None:
        self._read_fd: int | None = None
        self._keep_open_fd: int | None = None
        self._wake_r: int | None = None
        self._wake_w: int | None = None
        self._framer = LineFramer(max_partial=_MAX_LINE)  # a longer "line" is garbage
        self._buffered: list[TimerRequest] = []
        self._parse_line = parse
        self._on_malformed = on_malformed

    def open(self, path: str) -> None:
        nofollow = os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            self._read_fd = os.open(path, os.O_RDONLY | nofollow)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symbolic link planted after the check
                _check_fifo_owner(path, os.lstat(path))
            raise ValueError(f"timer file {path}: {exc.strerror}") from None
        try:
            # What was opened is what was checked (a FIFO swapped in between is refused).
            _check_fifo_owner(path, os.fstat(self._read_fd))
        except ValueError:
            os.close(self._read_fd)
            self._read_fd = None
            raise
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # Our own writer keeps the pipe from reaching end-of-file when clients close theirs.
        # Opened through the descriptor, so that it is the same FIFO whatever the path is now.
        self._keep_open_fd = os.open(
            f"/proc/self/fd/{self._read_fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC
        )

    def close(self) -> None:
        """Close every descriptor, once (a descriptor closed twice may be someone else's)."""
        for fd in (self._read_fd, self._keep_open_fd, self._wake_r, self._wake_w):
            if fd is not None:
                os.close(fd)
        self._read_fd = self._keep_open_fd = self._wake_r = self._wake_w = None

    def size(self) -> int:
        return max(1, len(self._buffered))

    def interrupt(self) -> None:
        if self._wake_w is None:
            return
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # already woken

    def _read(self) -> None:
        assert self._read_fd is not None
        while True:
            try:
                chunk = os.read(self._read_fd, 65536)
            except BlockingIOError:
                return
            if not chunk:
                return
            for line in self._framer.feed(chunk).splitlines():
                self._parse(line)

    def _parse(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            self._buffered.append(self._parse_line(line))
        except ValueError as exc:
            self._on_malformed(line, str(exc))

    def get(self, size: int, timeout: float) -> list[TimerRequest]:
        """Up to ``size`` of the requests that have arrived, waiting at most ``timeout``
        seconds only while none has: what the server asks (one, then what is queued)."""
        assert self._read_fd is not None and self._wake_r is not None
        if not self._buffered:
            # poll, not select: under a raised open-file limit a descriptor may be past 1023.
            poller = select.poll()
            poller.register(self._read_fd, select.POLLIN)
            poller.register(self._wake_r, select.POLLIN)
            wait = max(0, min(math.ceil(timeout * 1000), _MAX_POLL_MS))
            ready = {fd for fd, _ in poller.poll(wait)}
            if self._wake_r in ready:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            if self._read_fd in ready:
                self._read()
        taken, self._buffered = self._buffered[:size], self._buffered[size:]
        return list(taken)
