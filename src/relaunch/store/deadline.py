"""Whole-operation deadlines for network I/O, said once for every client relaunch has.

A socket timeout bounds each ``recv``: a peer that sends one byte a second never trips it, and
holds its caller as long as it likes. Here an operation (connect, send a request, read its whole
reply) gets one ``Deadline``, and each blocking call on the way waits only what is left of it
(``settimeout(deadline.timeout())`` before it: CPython bounds one ``recv``, ``sendall``, TLS
handshake or connect by its timeout as a whole). ``Reader`` buffers a socket's bytes so that
lines and counted bodies are read against a deadline, keeping what arrived when it passes.

``limit(seconds)`` narrows every deadline made inside it, in the calling thread (as trio's
cancel scopes do): ``relaunch status`` bounds one whole read of the job, however many requests
it takes, and each request inside keeps its own, shorter, deadline too.
"""

from __future__ import annotations

import contextvars
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from relaunch.core.durations import seconds
from relaunch.runtime import SYSTEM_CLOCK, Clock

#: The innermost ``limit`` of this thread: its end (a ``SYSTEM_CLOCK.monotonic()`` instant) and
#: its length in seconds, or None.
_LIMIT: contextvars.ContextVar[tuple[float, float] | None] = contextvars.ContextVar(
    "deadline", default=None
)


class Deadline:
    """``seconds`` from now on ``clock``, or the enclosing ``limit``'s end if that comes first
    (a ``limit`` keeps the system clock's time: a deadline on another clock ignores it).
    ``seconds`` (for messages): what the binding one allowed, the ``limit``'s whole length
    when that binds."""

    __slots__ = ("at", "clock", "seconds")

    def __init__(self, seconds: float, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self.seconds = max(0.0, seconds)
        self.at = clock.monotonic() + self.seconds
        outer = _LIMIT.get() if clock is SYSTEM_CLOCK else None
        if outer is not None and outer[0] < self.at:
            self.at, self.seconds = outer

    def left(self) -> float:
        """Seconds left (0 once passed)."""
        return max(0.0, self.at - self.clock.monotonic())

    def expired(self) -> bool:
        return self.clock.monotonic() >= self.at

    def timeout(self) -> float:
        """The time left, for ``settimeout``; ``TimeoutError`` once it passed (a timeout of 0
        would make the socket non-blocking, not fail)."""
        left = self.at - self.clock.monotonic()
        if left <= 0:
            raise TimeoutError(f"no complete reply within {seconds(self.seconds)}")
        return left

    def within(self, seconds: float) -> Deadline:
        """A deadline ``seconds`` from now, or this one's end if that comes first: one part
        (one member's attempt, say) of this operation."""
        part = Deadline(seconds, self.clock)
        if self.at < part.at:
            part.at = self.at
            part.seconds = self.left()
        return part


@contextmanager
def limit(seconds: float) -> Iterator[Deadline]:
    """Every ``Deadline`` made in this thread within the block ends ``seconds`` from now at
    the latest (an enclosing ``limit`` that ends sooner still wins)."""
    bound = Deadline(seconds)
    token = _LIMIT.set((bound.at, bound.seconds))
    try:
        yield bound
    finally:
        _LIMIT.reset(token)


def connect(host: str, port: int, deadline: Deadline) -> socket.socket:
    """A TCP connection to ``host:port`` (TCP_NODELAY) made within ``deadline``."""
    sock = socket.create_connection((host, port), timeout=deadline.timeout())
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def sendall(sock: socket.socket, data: bytes, deadline: Deadline) -> None:
    """Send all of ``data`` within ``deadline`` (a peer that reads nothing cannot hold us)."""
    sock.settimeout(deadline.timeout())
    sock.sendall(data)


class Reader:
    """What a socket received, read a line or a counted number of bytes at a time, each read
    within a deadline. When the deadline passes (``TimeoutError``) the bytes already received
    stay buffered: the next read goes on from them."""

    def __init__(self, sock: socket.socket, chunk: int = 1 << 16) -> None:
        self._sock = sock
        self._chunk = chunk
        self._buffer = bytearray()
        self._scanned = 0  # bytes of _buffer already searched for a newline

    def _fill(self, deadline: Deadline) -> bool:
        """Receive more bytes within ``deadline``; False at the end of the stream."""
        self._sock.settimeout(deadline.timeout())
        data = self._sock.recv(self._chunk)
        if not data:
            return False
        self._buffer += data
        return True

    def _take(self, size: int) -> bytes:
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        self._scanned = 0
        return data

    def readline(self, limit: int, deadline: Deadline) -> bytes:
        """The next line with its newline; at most ``limit`` bytes (a longer line comes in
        parts); what is left, or b"", at the end of the stream."""
        while True:
            end = self._buffer.find(b"\n", self._scanned, limit)
            if end >= 0:
                return self._take(end + 1)
            if len(self._buffer) >= limit:
                return self._take(limit)
            self._scanned = len(self._buffer)
            if not self._fill(deadline):
                return self._take(len(self._buffer))

    def read(self, size: int, deadline: Deadline) -> bytes:
        """``size`` bytes, or fewer at the end of the stream."""
        while len(self._buffer) < size:
            if not self._fill(deadline):
                break
        return self._take(min(size, len(self._buffer)))

    def read_to_end(self, limit: int, deadline: Deadline) -> bytes:
        """Every byte until the peer closes; ``ValueError`` beyond ``limit`` bytes."""
        while self._fill(deadline):
            if len(self._buffer) > limit:
                raise ValueError(f"a reply of more than {limit} bytes")
        return self._take(len(self._buffer))
