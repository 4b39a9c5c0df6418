"""The state peers' TCP server (``agent.state_peers``): a thread a connection, bounded for
whoever reaches its port, member or not.

At most ``MAX_CONNECTIONS`` connections are served at once, and at most ``MAX_UNPROVEN`` of them
have not proved the job's key yet: when that many wait, a newcomer takes the place of the oldest
if that one has had ``HANDSHAKE_GRACE`` seconds, or waits in the kernel's queue until it has
(as the built-in store does). A connection has ``HANDSHAKE_TIMEOUT`` seconds from its accept,
all reads together, to prove the key and make its request; only then is it read with
``IO_TIMEOUT`` a read. Out of descriptors (``EMFILE``) or threads, the accept loop rests
``ACCEPT_BACKOFF`` seconds and goes on (one line per episode); the connection that found no
thread is closed. Refused connections are logged as the store's are (``store.refusals``): the
first in full, the others summed up in one line per ``REFUSAL_SUMMARY_INTERVAL`` seconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from relaunch.runtime import start_thread
from relaunch.store.refusals import Refusals

log = logging.getLogger(__name__)

#: Seconds any one read or write of a connection that proved the key may take.
IO_TIMEOUT = 30.0
#: Seconds a connection has, from its accept, to prove the key and make its request.
HANDSHAKE_TIMEOUT = 3.0
#: Connections served at once (a thread each), at most ...
MAX_CONNECTIONS = 64
#: ... of which this many at most have not proved the key yet ...
MAX_UNPROVEN = 32
#: ... each given this many seconds before a newcomer may take its place.
HANDSHAKE_GRACE = 1.0
#: Out of descriptors or threads, the listener rests this long.
ACCEPT_BACKOFF = 0.5
#: Refused connections after the first are summed up in one log line per this many seconds.
REFUSAL_SUMMARY_INTERVAL = 10.0
#: Connections accepted per turn of the accept loop, at most.
_ACCEPTS_PER_TURN = 64

Request = TypeVar("Request")


class Refused(Exception):
    """A connection to close unserved: ``reason`` sums it up, ``detail`` says it."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class PeerServer(Generic[Request]):
    """Serves each connection to ``host`` (a port of its own) in a thread of its own:
    ``handshake(connection, deadline)`` proves the peer and reads its request (``Refused``,
    ``OSError`` or ``ValueError`` when it cannot), then ``serve(connection, peer, request)``."""

    def __init__(
        self,
        host: str,
        handshake: Callable[[socket.socket, float], Request],
        serve: Callable[[socket.socket, str, Request], None],
    ) -> None:
        self._handshake, self._serve_request = handshake, serve
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._unproven: dict[socket.socket, float] = {}  # -> when accepted; oldest first
        self._evicted: set[socket.socket] = set()  # closed to make room for newer ones
        self._refusals = Refusals(REFUSAL_SUMMARY_INTERVAL, "state peers", log)
        self._closing = False
        self._short: str | None = None  # what accepting runs short of, in an episode
        self._rest_until = 0.0
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._watching = False  # the selector watches the listener
        self._accepter = start_thread(self._accept_loop, "relaunch-state-peers")

    @property
    def refused(self) -> int:
        """Connections refused so far (for tests and metrics)."""
        with self._lock:
            return self._refusals.total

    def serving(self) -> tuple[int, int]:
        """Connections open now, and those of them that have not proved the key."""
        with self._lock:
            return len(self._open), len(self._unproven)

    def refuse(self, peer: str, refused: Refused) -> None:
        """Log ``peer``'s connection as refused (summed up with the others)."""
        with self._lock:
            self._refusals.note(peer, refused.reason, refused.detail, time.monotonic())
            self._wake()  # the summary's interval may have begun: the loop's timer

    def close(self) -> None:
        """Stop accepting, end every connection, and wait for the accept loop."""
        with self._lock:
            self._closing = True
            for connection in self._open:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)
            self._wake()
        self._accepter.join()

    # -- the accept loop ------------------------------------------------------------------

    def _accept_loop(self) -> None:
        try:
            while True:
                now = time.monotonic()
                with self._lock:
                    if self._closing:
                        return
                    self._refusals.tick(now)
                    room, until = self._room(now)
                    until = _sooner(until, self._refusals.until)
                if now < self._rest_until:
                    room, until = False, _sooner(until, self._rest_until)
                self._watch_listener(room)
                timeout = None if until is None else max(0.0, until - now)
                for key, _ in self._selector.select(timeout):
                    if key.fileobj is self._listener:
                        self._take()
                    else:
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 4096)
        finally:
            self._selector.close()
            self._listener.close()
            with self._lock:
                self._refusals.flush()
                os.close(self._wake_w)
                self._wake_w = -1
            os.close(self._wake_r)

    def _room(self, now: float) -> tuple[bool, float | None]:
        """Whether a newcomer may be accepted now (the lock held), making room for it among
        the unproven when their oldest has had its grace; else when to look again (None: when
        a connection ends)."""
        if len(self._open) >= MAX_CONNECTIONS:
            return False, None
        if len(self._unproven) < MAX_UNPROVEN:
            return True, None
        oldest, accepted = next(iter(self._unproven.items()))
        if now - accepted < HANDSHAKE_GRACE:
            return False, accepted + HANDSHAKE_GRACE
        del self._unproven[oldest]
        self._evicted.add(oldest)
        with contextlib.suppress(OSError):
            oldest.shutdown(socket.SHUT_RDWR)  # its thread sees the end and says why
        return True, None

    def _watch_listener(self, watch: bool) -> None:
        """Watch the listener or not (unwatched, it stays readable: no busy loop)."""
        if watch and not self._watching:
            self._selector.register(self._listener, selectors.EVENT_READ)
        elif not watch and self._watching:
            self._selector.unregister(self._listener)
        self._watching = watch

    def _take(self) -> None:
        """Accept the connections waiting, as many as there is room for, each with a thread of
        its own (``_ACCEPTS_PER_TURN`` at most: the loop's timers are looked at between)."""
        for _ in range(_ACCEPTS_PER_TURN):
            now = time.monotonic()
            with self._lock:
                room, _ = self._room(now)
            if not room:
                return
            try:
                connection, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                if self._short is not None:  # nobody waits any more: the shortage is over
                    self._short = None
                    log.info("state peers: accepting connections again")
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:  # out of descriptors, most likely: the others still served
                self._run_short(exc.strerror or str(exc))
                return
            if not self._start(connection, f"{address[0]}:{address[1]}", now):
                return

    def _start(self, connection: socket.socket, peer: str, now: float) -> bool:
        """Serve ``connection`` in a thread of its own; whether one could start."""
        connection.setblocking(True)
        with self._lock:
            if self._closing:
                connection.close()
                return False
            self._open.add(connection)
            self._unproven[connection] = now
        try:
            start_thread(self._serve, "relaunch-state-peer", connection, peer, now)
        except RuntimeError as exc:  # can't start new thread: this one closed, the others go on
            with self._lock:
                self._open.discard(connection)
                self._unproven.pop(connection, None)
            connection.close()
            self.refuse(peer, Refused("found no thread", f"no thread to serve it ({exc})"))
            self._run_short(str(exc))
            return False
        return True

    def _run_short(self, what: str) -> None:
        """Accepting failed for want of ``what``: rest the listener a while; said once an
        episode."""
        if self._short is None:
            with self._lock:
                count = len(self._open)
            log.warning(
                "state peers: cannot accept more connections (%s) with %d open: new ones wait "
                "until some close; raise the open-file limit (ulimit -n, systemd LimitNOFILE) "
                "or the task limit (ulimit -u, TasksMax)",
                what,
                count,
            )
        self._short = what
        self._rest_until = time.monotonic() + ACCEPT_BACKOFF

    def _wake(self) -> None:
        """Wake the accept loop (the lock held)."""
        if self._wake_w >= 0:
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake_w, b"\0")

    # -- a connection ---------------------------------------------------------------------

    def _serve(self, connection: socket.socket, peer: str, accepted: float) -> None:
        try:
            try:
                request = self._handshake(connection, accepted + HANDSHAKE_TIMEOUT)
            except Refused as refused:
                self.refuse(peer, refused)
                return
            except (OSError, ValueError) as exc:
                self.refuse(peer, self._unproven_end(connection, accepted, exc))
                return
            with self._lock:
                proven = self._unproven.pop(connection, None) is not None
                self._wake()
            if not proven:  # made room for a newer one just as it proved the key
                self.refuse(peer, self._unproven_end(connection, accepted, None))
                return
            connection.settimeout(IO_TIMEOUT)
            self._serve_request(connection, peer, request)
        except (OSError, ValueError) as exc:
            log.debug("state peers: the connection of %s ended: %s", peer, exc)
        finally:
            with self._lock:
                self._open.discard(connection)
                self._unproven.pop(connection, None)
                self._evicted.discard(connection)
                self._wake()
            connection.close()

    def _unproven_end(
        self, connection: socket.socket, accepted: float, exc: BaseException | None
    ) -> Refused:
        """Why a connection ended before it proved the key."""
        with self._lock:
            evicted = connection in self._evicted
        age = time.monotonic() - accepted
        if evicted:
            return Refused(
                "made room for newer ones",
                f"no proof of the job's key after {age:.1f}s, with {MAX_UNPROVEN} connections "
                "waiting to prove it: made room for a newer one",
            )
        if isinstance(exc, TimeoutError) or age >= HANDSHAKE_TIMEOUT:
            return Refused(
                "no proof in time", f"no proof of the job's key within {HANDSHAKE_TIMEOUT:g}s"
            )
        return Refused("ended before a proof", f"ended before it proved the job's key ({exc})")


def _sooner(one: float | None, other: float | None) -> float | None:
    """The earlier of two moments, either of which may be None (never)."""
    if one is None or other is None:
        return other if one is None else one
    return min(one, other)
