"""The built-in store server: one thread, one ``selectors`` loop, any number of clients.

Blocking operations (``wait``, ``watch``) park the connection as a waiter with a deadline; any
change to a key wakes exactly the waiters on that key. A client that sends a malformed,
truncated or oversized frame, or fails authentication, loses its connection; the server goes on.

Built to hold thousands of connections (a job of N nodes opens 3 per node): each loop turn costs
the events it got, not the number of clients (deadlines sit in a heap); the open-file limit is
raised for the expected number of clients, with one clear warning when the hard limit is too
low; out of descriptors, the listener rests until a connection closes instead of spinning. A
client whose unsent replies pile up past ``OUT_HIGH_WATER`` (it sends but does not read) gets
no more of its requests read until they drain to ``OUT_LOW_WATER``: TCP's flow control then
pushes back on it alone, and the server's memory for it stays bounded.

What a client may make the server hold is bounded, before it proves the token and after:

- Before: its first frame may announce at most ``PRE_AUTH_LIMIT`` bytes (the authentication
  frame is about 80; a larger announcement closes the connection at once), it is read that
  much at a time, and it has ``HANDSHAKE_TIMEOUT`` seconds. At most a quarter of the open-file
  limit (``runtime.descriptor_share``, ``MAX_UNAUTHENTICATED`` at most) of connections wait to
  authenticate, so that they cannot take the descriptors the hosting agent needs: when that
  many do, a newcomer takes the place of the oldest if that one has had ``HANDSHAKE_GRACE``
  seconds, or waits in the kernel's queue until it has.
- After: a connection holds at most one read (``_RECV_SIZE``) of small frames; a larger frame
  is received only once its announced size is reserved in ``FRAME_BUDGET``, shared by every
  client (first come, first served; until its frame fits, the client is not read), so that
  large values cannot add up past it whatever the number of connections.

Between stores (docs/store-failover.md): only a store with a token serves a standby's stream
(``REPLICATE``) or takes votes (``PROMOTE``), since both trust the client with the job. A standby
counts votes by itself: its ``Electorate``, read from its copy of the primary's keys, says who
may vote and how many must ask at once; a vote counts while its request waits.

A connection closed for misbehaving (a wrong token, no authentication in time, garbage, an
oversized frame) is logged with its reason when it is the first in ``REFUSAL_SUMMARY_INTERVAL``
seconds; the others of that time are summed up in one line at its end: a flood of connections
does not flood the log.
"""

from __future__ import annotations

import errno
import functools
import heapq
import itertools
import logging
import mmap
import os
import resource
import select
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from relaunch.runtime import (
    descriptor_share,
    open_descriptors,
    raise_open_file_limit,
    start_thread,
)
from relaunch.store import auth, wire
from relaunch.store.api import StoreError, StoreProtocolError
from relaunch.store.refusals import Refusals
from relaunch.store.state import KeyValueState

if TYPE_CHECKING:
    from relaunch.store.client import TcpStore

log = logging.getLogger(__name__)

#: A client must authenticate within this many seconds of connecting ...
HANDSHAKE_TIMEOUT = 5.0
#: ... having sent no frame larger than this first (the authentication frame is ~80 bytes).
PRE_AUTH_LIMIT = 4096
#: Connections that have not authenticated yet, at most (a few KiB of memory each; fewer under
#: a low open-file limit: ``descriptor_share``) ...
MAX_UNAUTHENTICATED = 1024
#: ... each given this many seconds before a newcomer may take its place.
HANDSHAKE_GRACE = 1.0
#: Bytes of frames larger than one read that all clients together may have in the server's
#: buffers at once: room for four of the largest frames.
FRAME_BUDGET = 4 * wire.MAX_FRAME
#: Connections closed after the first are summed up in one log line per this many seconds.
REFUSAL_SUMMARY_INTERVAL = 10.0
#: How many connections a server expects at once when not told (the open-file limit is
#: raised for that many).
DEFAULT_CLIENTS = 4096
#: Unsent reply bytes of one client above which its requests are no longer read ...
OUT_HIGH_WATER = 1 << 20
#: ... until they drain to this. A slow reader costs at most OUT_HIGH_WATER plus one reply.
OUT_LOW_WATER = 1 << 16
_RECV_SIZE = 1 << 16
#: Longer WAIT/WATCH timeouts (in ms) are clamped to this: any decimal integer then fits a float.
_MAX_PARK_MS = 365 * 86400 * 1000
#: The longest one select() sleeps: epoll refuses timeouts over ~24.8 days.
_MAX_SELECT = 3600.0
#: Descriptors a hosting process needs besides the store's connections (its logs, its workers'
#: pipes, the clients of its own store): part of what the open-file limit must allow.
_FD_MARGIN = 256
#: Connections accepted per loop turn: a burst of connects does not hold up the clients served.
_ACCEPTS_PER_TURN = 128
#: Out of descriptors, the listener rests this long (or until a connection closes).
_ACCEPT_BACKOFF = 0.5
_OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_WAKE = "wake"
_LENGTH = struct.Struct(">I")
#: A standby further behind than this is dropped (it follows again from a fresh snapshot).
REPLICA_HIGH_WATER = 64 << 20
#: What PROMOTE requests wait on (no client's key: they start with a NUL).
_PROMOTED = "\0promoted"


@dataclass(frozen=True, slots=True)
class Electorate:
    """Who may vote a standby into its primary's place (``voters``), and how many of them must
    ask at once (``quorum``)."""

    voters: Container[str]
    quorum: int


#: How a standby reads its ``Electorate`` from its copy of the primary's keys (``read(key)``:
#: the value, or None); None while nobody may vote.
Elect = Callable[[Callable[[str], "bytes | None"]], "Electorate | None"]


@dataclass(eq=False, slots=True)
class _Client:
    sock: socket.socket
    peer: str
    nonce: bytes
    accepted: float = 0.0
    # What it sent and was not handled yet: complete frames' payloads, and the frame being
    # received (its length prefix, then its payload so far; ``size``: the announced length,
    # -1 until the prefix is complete).
    frames: deque[bytes | mmap.mmap] = field(default_factory=deque)
    partial: bytearray = field(default_factory=bytearray)
    size: int = -1
    # A frame larger than one read, once its size is reserved: received straight into ``body``
    # (mapped memory: the system has it back, all of it, when the frame is handled).
    body: mmap.mmap | None = None
    filled: int = 0
    reserved: int = 0  # bytes of FRAME_BUDGET its large frames hold
    starving: bool = False  # its large frame waits for FRAME_BUDGET: not read meanwhile
    out: bytearray = field(default_factory=bytearray)
    authenticated: bool = False
    waiter: _Waiter | None = None
    closing: bool = False
    events: int = selectors.EVENT_READ  # what the selector watches for it (0: unregistered)
    paused: bool = False  # its requests wait: its replies are over OUT_HIGH_WATER
    replica: bool = False  # a standby following this store: each change is sent to it


@dataclass(eq=False, slots=True)
class _Waiter:
    client: _Client
    keys: tuple[str, ...]
    deadline: float
    version: int | None = None  # None: wait for the keys to exist; else watch for a change


class _Refused(Exception):
    """A client to close, with a reason for the log: ``reason`` sums it up, ``detail`` says it."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _key(field: bytes) -> str:
    try:
        return field.decode()
    except UnicodeDecodeError:
        raise StoreProtocolError("keys must be UTF-8") from None


def _seconds(millis: bytes) -> float:
    """A request's timeout field (decimal milliseconds) in seconds, clamped to a sane range."""
    return min(max(wire.to_int(millis), 0), _MAX_PARK_MS) / 1000


def _value(field: bytes) -> bytes:
    if len(field) > wire.MAX_VALUE:
        raise StoreError(f"value of {len(field)} bytes exceeds the limit of {wire.MAX_VALUE}")
    return field


def _versioned_fields(value: bytes | None, version: int) -> list[bytes]:
    return [b"1" if value is not None else b"0", value or b"", wire.from_int(version)]


class TcpStoreServer:
    """Serves a ``KeyValueState`` on ``host:port`` (port 0 picks a free one) until ``stop()``.

    With ``token``, every client must prove it knows the token (and the server proves it to the
    client) by HMAC over fresh nonces; the token itself never crosses the wire.
    ``expected_clients`` (default ``DEFAULT_CLIENTS``) is how many connections may come at
    once: the soft open-file limit is raised to the hard limit if it cannot hold them, and one
    warning says what to do if even the hard limit cannot.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        expected_clients: int | None = None,
    ) -> None:
        self._token = token or None
        self._state = KeyValueState()
        expected = DEFAULT_CLIENTS if expected_clients is None else max(expected_clients, 1)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        # A backlog for a burst of connects (the kernel caps it at net.core.somaxconn).
        self._listener.listen(min(max(expected, 1024), 65535))
        self._listener.setblocking(False)
        self.host, self.port = self._listener.getsockname()[:2]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._accepting = True
        self._queue = select.poll()  # whether clients wait to be accepted (no descriptor used)
        self._queue.register(self._listener, select.POLLIN)
        self._accept_resume: float | None = None  # the listener rests: when to try again
        self._out_of_descriptors = False  # in an episode of failed accepts (logged once)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._clients: set[_Client] = set()
        self._unproven: dict[_Client, None] = {}  # not authenticated yet, oldest first
        self._waiters: dict[str, dict[_Waiter, None]] = {}
        # (deadline, tie-break, parked waiter or unauthenticated client); entries whose waiter
        # was woken or whose client authenticated or left stay until popped (lazy deletion).
        self._deadlines: list[tuple[float, int, _Waiter | _Client]] = []
        self._sequence = itertools.count()
        self._recv_buffer = bytearray(_RECV_SIZE)
        self._recv_view = memoryview(self._recv_buffer)
        self._reserved = 0  # bytes of FRAME_BUDGET held
        self._starving: deque[_Client] = deque()  # large frames waiting for FRAME_BUDGET
        self._ready: list[_Client] = []  # unpaused clients whose buffered requests wait
        self._refusals = Refusals(REFUSAL_SUMMARY_INTERVAL, "store", log)
        self._stopping = False
        self._thread: threading.Thread | None = None
        # Between stores (``follow``, ``fence``; the design: docs/store-failover.md).
        self._replicas: set[_Client] = set()
        self._primary: str | None = None  # a standby: the store it follows ("host:port")
        self._synced = False  # a standby holds a whole snapshot of its primary
        self._fresh = False  # its stream just began: the snapshot replaces what it held
        #: Whole snapshots a standby took (one per connection to its primary).
        self.snapshots = 0
        self._stopped = threading.Event()
        self._follow_lock = threading.Lock()  # the follower's writes against the promotion
        self._follower: TcpStore | None = None
        self._elect: Elect | None = None  # a standby: who may vote it into the primary's place
        self._votes: dict[str, _Waiter] = {}  # each voter's waiting PROMOTE request
        self._fenced = False
        self._fence_told = False
        self._check_open_file_limit(expected)
        #: Connections that may wait to authenticate at once (``descriptor_share``).
        self.max_unauthenticated = descriptor_share(MAX_UNAUTHENTICATED)
        #: Without a token no client proves anything: all of them at once, at most (the
        #: listener rests at that many until one closes), with room for twice the expected.
        self.max_tokenless = descriptor_share(max(2 * expected, MAX_UNAUTHENTICATED))
        self._tokenless_full_said = False

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def refused(self) -> int:
        """How many connections the server closed for misbehaving since it started."""
        return self._refusals.total

    def start(self) -> TcpStoreServer:
        """Serve in a background thread."""
        self._thread = start_thread(self.serve_forever, "relaunch-store")
        return self

    # -- between stores: a standby, its promotion, fencing -----------------------------------

    @property
    def standby(self) -> bool:
        """Whether this store follows another (and redirects its clients there)."""
        return self._primary is not None

    @property
    def following(self) -> bool:
        """Whether a standby's stream from its primary is open now."""
        return self._follower is not None

    @property
    def synced(self) -> bool:
        """Whether a standby holds a whole snapshot of its primary (only then may it take over)."""
        return self._synced

    @property
    def primary(self) -> str | None:
        """A standby: the store it follows (``host:port``); None for a primary."""
        return self._primary

    @property
    def fenced(self) -> bool:
        return self._fenced

    def follow(self, host: str, port: int, elect: Elect) -> None:
        """Serve as the standby of the store at ``host:port``: follow its every change (a
        thread, reconnecting with backoff until promoted or stopped) and redirect clients
        there, until a quorum of the voters ``elect`` reads from the copy asks this store to
        take over (``PROMOTE``). A standby told to follow another primary drops its stream and
        starts afresh from the new one. Only a store with a token may follow (``ValueError``):
        its primary serves a stream to no other."""
        if self._token is None:
            raise ValueError("a standby needs the job's token: no primary serves a copy without")
        target = f"{host}:{port}"
        with self._follow_lock:
            self._elect = elect
            if self._primary == target:
                return
            # Nothing from the old primary may be promoted: whole again with the new snapshot.
            self._primary, follower, self._synced = target, self._follower, False
        if follower is not None:
            follower.abort()
        start_thread(lambda: self._follow(host, port), "relaunch-store-standby")

    def fence(self) -> None:
        """Serve nobody from now on (this store lost the job's majority): every request, and
        every one waiting, is answered ``FENCED``."""
        self._fenced = True
        if self._wake_w >= 0:
            os.write(self._wake_w, b"f")

    def _follow(self, host: str, port: int) -> None:
        from relaunch.store.client import TcpStore

        target, pause = f"{host}:{port}", 0.05
        while self._primary == target and not self._stopping:
            try:
                store = TcpStore(host, port, self._token, timeout=30.0, connect_timeout=1.0)
            except StoreError:
                self._stopped.wait(pause)  # the primary is not there (yet, or any more)
                pause = min(2 * pause, 1.0)
                continue
            pause = 0.05
            with self._follow_lock:
                if self._primary != target or self._stopping:
                    store.close()
                    return
                self._follower, self._synced, self._fresh = store, False, True
            try:
                store.replicate(functools.partial(self._apply, store))
            except StoreError as exc:
                log.debug("standby: lost the primary at %s:%d: %s", host, port, exc)
            finally:
                with self._follow_lock:
                    if self._follower is store:
                        self._follower = None

    def _apply(self, stream: TcpStore, fields: list[bytes]) -> None:
        """One record of the primary's ``stream``, taken in (the follower's thread)."""
        with self._follow_lock:
            if self._follower is not stream or self._stopping:
                raise StoreError("promoted, or following another store: this stream ends")
            kind = fields[0] if fields else b""
            if self._fresh:  # a new stream begins with a whole snapshot: start afresh
                self._state, self._fresh = KeyValueState(), False
            if kind == wire.RECORD_KEY and len(fields) == 4:
                self._state.apply(_key(fields[1]), fields[2], wire.to_int(fields[3]))
            elif kind == wire.RECORD_DELETED and len(fields) == 3:
                self._state.apply(_key(fields[1]), None, wire.to_int(fields[2]))
            elif kind == wire.RECORD_SYNCED and len(fields) == 2:
                self._state.revision = max(self._state.revision, wire.to_int(fields[1]))
                self._synced = True
                self.snapshots += 1
                if self._wake_w >= 0:  # votes that came before the snapshot count now
                    os.write(self._wake_w, b"s")
            else:
                raise StoreProtocolError("not a replication record")

    def _promote(self, voters: int) -> None:
        """Take over, ``voters`` having asked: serve the job from the state followed so far
        (the loop's thread)."""
        with self._follow_lock:
            follower, self._follower, self._primary = self._follower, None, None
        if follower is not None:
            follower.abort()
        log.warning("store: this standby serves the job now (%d voters asked)", voters)
        self._votes.clear()
        for waiter in list(self._waiters.get(_PROMOTED, {})):
            self._unpark(waiter)
            self._reply(waiter.client, wire.OK)

    def stop(self) -> None:
        """Stop serving and release everything; the wake-up pipe is closed here, after the
        thread ended, so that no write can land on a descriptor closed under it."""
        if self._wake_w < 0:
            return
        self._stopping = True
        self._stopped.set()
        follower = self._follower
        if follower is not None:
            follower.abort()
        os.write(self._wake_w, b"x")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._wake_r = self._wake_w = -1

    def _check_open_file_limit(self, expected: int) -> None:
        """Raise the soft open-file limit for ``expected`` connections if it is too low; one
        warning (how many fit, how many may come, what to do) if the hard limit is too low."""
        in_use = open_descriptors()
        needed = in_use + expected + MAX_UNAUTHENTICATED + _FD_MARGIN
        soft, hard = raise_open_file_limit(needed)
        if soft == resource.RLIM_INFINITY or soft >= needed:
            return
        hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
        log.warning(
            "store: the open-file limit (%d, hard limit %s) leaves room for about %d "
            "connections, but up to %d may come: raise it to at least %d (`ulimit -n %d` in "
            "the shell that starts relaunch, LimitNOFILE=%d in a systemd unit, "
            "--ulimit nofile=%d in a container)",
            soft,
            hard_text,
            max(soft - in_use, 0),
            expected,
            needed,
            needed,
            needed,
            needed,
        )

    # -- the loop -------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        try:
            while not self._stopping:
                for key, mask in self._selector.select(self._next_timeout()):
                    data = key.data
                    if isinstance(data, _Client):
                        self._service(data, mask)
                    elif data is None:
                        self._accept()
                    else:
                        os.read(self._wake_r, 512)
                        if self._fenced and not self._fence_told:
                            self._tell_fenced()
                        self._weigh_votes()  # the standby's snapshot may have just completed
                while self._ready:
                    client = self._ready.pop()
                    if client in self._clients and not client.paused:
                        self._serve_buffered(client)
                self._expire(time.monotonic())
        finally:
            self._stopping = True
            self._refusals.flush()
            for client in list(self._clients):
                self._close(client)
            self._selector.close()
            self._listener.close()

    def _live(self, item: _Waiter | _Client) -> bool:
        """Whether a deadline entry still counts: its waiter parked, its client unproven."""
        if isinstance(item, _Waiter):
            return item.client.waiter is item
        return item in self._unproven

    def _schedule(self, deadline: float, item: _Waiter | _Client) -> None:
        heapq.heappush(self._deadlines, (deadline, next(self._sequence), item))
        # At most one live entry per client: rebuilding when the dead ones outnumber them
        # keeps the heap O(clients) at amortised O(1) per entry.
        if len(self._deadlines) > 2 * len(self._clients) + 64:
            self._deadlines = [entry for entry in self._deadlines if self._live(entry[2])]
            heapq.heapify(self._deadlines)

    def _next_timeout(self) -> float | None:
        deadlines = self._deadlines
        while deadlines and not self._live(deadlines[0][2]):
            heapq.heappop(deadlines)
        candidates = [self._accept_resume, self._refusals.until]
        if deadlines:
            candidates.append(deadlines[0][0])
        deadline = min((when for when in candidates if when is not None), default=None)
        if deadline is None:
            return None
        return min(max(0.0, deadline - time.monotonic()), _MAX_SELECT)

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_TURN):
            now = time.monotonic()
            if not self._token and len(self._clients) >= self.max_tokenless:
                self._hold_tokenless()
                return
            if len(self._unproven) >= self.max_unauthenticated and not self._make_room(now):
                return
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                self._end_shortage()
                return
            except ConnectionAbortedError:
                continue  # the client gave up before we took it
            except OSError as exc:
                if exc.errno not in _OUT_OF_DESCRIPTORS:  # keep serving the others
                    log.warning("store: cannot accept a connection: %s", exc)
                elif self._queue.poll(0):  # clients wait in the kernel's queue
                    self._pause_accepting(exc)
                else:  # only at the limit: Linux refuses before it looks at the queue
                    self._end_shortage()
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client = _Client(sock, f"{address[0]}:{address[1]}", auth.nonce(), accepted=now)
            self._clients.add(client)
            self._unproven[client] = None
            self._selector.register(sock, selectors.EVENT_READ, client)
            self._schedule(now + HANDSHAKE_TIMEOUT, client)
            required = b"1" if self._token else b"0"
            self._send(client, wire.encode(wire.HELLO, [wire.PROTOCOL, required, client.nonce]))

    def _make_room(self, now: float) -> bool:
        """``max_unauthenticated`` connections wait to authenticate: close the oldest if it
        has had ``HANDSHAKE_GRACE`` seconds (true), else rest the listener until it has."""
        oldest = next(iter(self._unproven))
        if now - oldest.accepted >= HANDSHAKE_GRACE:
            self._refuse(
                oldest,
                _Refused(
                    "made room for newer ones",
                    f"not authenticated after {now - oldest.accepted:.1f}s, with "
                    f"{self.max_unauthenticated} connections waiting to: made room for a newer "
                    "one",
                ),
            )
            return True
        self._rest_listener(oldest.accepted + HANDSHAKE_GRACE)
        return False

    def _hold_tokenless(self) -> None:
        """A store without a token holds ``max_tokenless`` connections: rest the listener until
        one closes (the rest of the open-file limit stays the agent's), said once."""
        if not self._tokenless_full_said:
            self._tokenless_full_said = True
            log.warning(
                "store: %d connections, the most a store without a token holds under an "
                "open-file limit of %d: new clients wait until some close; set a token "
                "(--rdzv-conf token=..., RELAUNCH_RDZV_TOKEN) so that only members count",
                len(self._clients),
                resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            )
        self._rest_listener(None)

    def _rest_listener(self, until: float | None) -> None:
        """Stop watching the listener (it would stay readable: no busy loop) until ``until``
        or until a connection closes or authenticates."""
        if self._accepting:
            self._selector.unregister(self._listener)
            self._accepting = False
        self._accept_resume = until

    def _pause_accepting(self, exc: OSError) -> None:
        """Out of descriptors with clients waiting: rest the listener until a connection
        closes or a short back-off passes. The first time in an episode (until no client waits
        any more), say so."""
        if not self._out_of_descriptors:
            self._out_of_descriptors = True
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            log.warning(
                "store: cannot accept more connections (%s) with %d open and an open-file "
                "limit of %d: new clients wait until some close; raise the limit (`ulimit -n`, "
                "systemd LimitNOFILE)",
                exc.strerror or exc,
                len(self._clients),
                soft,
            )
        self._rest_listener(time.monotonic() + _ACCEPT_BACKOFF)

    def _end_shortage(self) -> None:
        """No client waits to be accepted any more: an episode of shortage is over."""
        if self._out_of_descriptors:
            self._out_of_descriptors = False
            log.info("store: accepting connections again (%d open)", len(self._clients))

    def _resume_accepting(self) -> None:
        self._accept_resume = None
        if not self._accepting and not self._stopping:
            self._selector.register(self._listener, selectors.EVENT_READ, None)
            self._accepting = True

    def _service(self, client: _Client, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(client)
            self._update_events(client)
        if not mask & selectors.EVENT_READ or client not in self._clients:
            return
        if client.paused or client.starving:
            return
        body = client.body
        try:
            if body is not None:  # a large frame: straight into its buffer, up to its end
                with memoryview(body) as view:
                    received = client.sock.recv_into(view[client.filled :])
            else:  # unauthenticated, a client is read no more than it may send
                size = _RECV_SIZE if client.authenticated else PRE_AUTH_LIMIT
                received = client.sock.recv_into(self._recv_buffer, size)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            received = 0
        if not received:
            self._close(client)
            return
        if body is not None:
            client.filled += received
            if client.filled == len(body):
                self._complete(client, body)
        else:
            try:
                self._take(client, self._recv_view[:received])
            except _Refused as refused:
                self._refuse(client, refused)
                return
        self._serve_buffered(client)

    def _take(self, client: _Client, data: memoryview) -> None:
        """Assemble ``data`` into ``client``'s frames. A frame larger than one read must fit in
        FRAME_BUDGET first: until it does, the client starves (is not read)."""
        partial, at, end = client.partial, 0, len(data)
        while True:
            if client.size < 0:
                take = min(4 - len(partial), end - at)
                partial += data[at : at + take]
                at += take
                if len(partial) < 4:
                    return
                client.size = self._announced(client, _LENGTH.unpack(partial)[0])
                if client.size + 4 > _RECV_SIZE:
                    self._reserve(client, client.size + 4)
            body = client.body
            if body is not None:
                take = min(client.size - client.filled, end - at)
                body[client.filled : client.filled + take] = data[at : at + take]
                client.filled += take
                at += take
                if client.filled < client.size:
                    return
                self._complete(client, body)
            else:
                take = min(client.size + 4 - len(partial), end - at)
                partial += data[at : at + take]
                at += take
                if len(partial) < client.size + 4:
                    return
                client.frames.append(bytes(partial[4:]))
                partial.clear()  # frees its memory: an idle connection keeps no buffer
                client.size = -1

    @staticmethod
    def _announced(client: _Client, size: int) -> int:
        """A frame's announced size, or ``_Refused`` if it is too large for the client now."""
        if client.authenticated:
            if size > wire.MAX_FRAME:
                raise _Refused(
                    "oversized frames", f"frame of {size} bytes exceeds {wire.MAX_FRAME}"
                )
        elif size > PRE_AUTH_LIMIT:
            raise _Refused(
                "oversized frames before authenticating",
                f"a frame of {size} bytes before authenticating (at most {PRE_AUTH_LIMIT})",
            )
        return size

    def _complete(self, client: _Client, body: mmap.mmap) -> None:
        client.frames.append(body)
        client.body = None
        client.size = -1
        client.filled = 0

    def _begin_body(self, client: _Client) -> None:
        """``client``'s large frame got its reservation: its buffer, with what came already."""
        received = len(client.partial) - 4
        client.body = mmap.mmap(-1, client.size)
        client.body[:received] = client.partial[4:]
        client.filled = received
        client.partial.clear()

    def _reserve(self, client: _Client, size: int) -> None:
        """Reserve ``size`` bytes of FRAME_BUDGET for ``client``'s frame, or make it wait its
        turn (clients that wait are served in order; one frame alone always fits)."""
        if not self._starving and (self._reserved == 0 or self._reserved + size <= FRAME_BUDGET):
            self._reserved += size
            client.reserved += size
            self._begin_body(client)
        else:
            client.starving = True
            self._starving.append(client)

    def _release(self, client: _Client, size: int) -> None:
        """``client`` gave back ``size`` bytes of FRAME_BUDGET: let the frames waiting in."""
        client.reserved -= size
        self._reserved -= size
        while self._starving:
            waiting = self._starving[0]
            if waiting not in self._clients:
                self._starving.popleft()
                continue
            need = waiting.size + 4
            if self._reserved and self._reserved + need > FRAME_BUDGET:
                break
            self._starving.popleft()
            self._reserved += need
            waiting.reserved += need
            waiting.starving = False
            self._begin_body(waiting)
            self._update_events(waiting)

    def _serve_buffered(self, client: _Client) -> None:
        """Handle the client's complete requests in order, until its unsent replies pass
        OUT_HIGH_WATER (then pause it: the rest stay buffered, in the kernel too)."""
        try:
            while not client.closing and client in self._clients and client.frames:
                if len(client.out) >= OUT_HIGH_WATER:
                    client.paused = True
                    break
                payload = client.frames.popleft()
                size = len(payload) + 4
                self._handle(client, *wire.decode_payload(payload))
                del payload  # a large frame's buffer is freed before its budget is let go
                if size > _RECV_SIZE and client in self._clients:
                    self._release(client, size)
        except StoreProtocolError as exc:
            reason = "malformed requests" if client.authenticated else "not the store's protocol"
            self._refuse(client, _Refused(reason, str(exc)))
            return
        except _Refused as refused:
            self._refuse(client, refused)
            return
        self._update_events(client)

    def _update_events(self, client: _Client) -> None:
        """Watch the client for requests unless paused or starving, and for writing while
        replies wait. A paused client whose replies drained to OUT_LOW_WATER is resumed."""
        if client not in self._clients:
            return
        if client.paused and len(client.out) <= OUT_LOW_WATER:
            client.paused = False
            if client.frames:
                self._ready.append(client)  # served in this loop turn, not recursively here
        events = 0 if client.paused or client.starving else selectors.EVENT_READ
        if client.out:
            events |= selectors.EVENT_WRITE
        if events != client.events:
            if not events:
                self._selector.unregister(client.sock)
            elif not client.events:
                self._selector.register(client.sock, events, client)
            else:
                self._selector.modify(client.sock, events, client)
            client.events = events

    # -- requests -------------------------------------------------------------------------------

    def _handle(self, client: _Client, op: int, fields: list[bytes]) -> None:
        if not client.authenticated:
            self._authenticate(client, op, fields)
            return
        if client.waiter is not None or client.replica:
            raise StoreProtocolError("a request arrived while another one is still waiting")
        if self._fenced and op != wire.PING:
            self._reply(client, wire.FENCED)
            return
        primary = self._primary
        if primary is not None and op not in (wire.PING, wire.PROMOTE):
            self._reply(client, wire.REDIRECT, [primary.encode()])
            return
        handler = self._HANDLERS.get(op)
        if handler is None:
            raise StoreProtocolError(f"unknown operation {op}")
        try:
            handler(self, client, fields)
        except StoreProtocolError:
            raise
        except (StoreError, ValueError, IndexError) as exc:
            self._reply(client, wire.ERROR, [str(exc).encode()])

    def _authenticate(self, client: _Client, op: int, fields: list[bytes]) -> None:
        if op != wire.AUTH or len(fields) != 2:
            raise _Refused("not the store's protocol", "expected the authentication frame first")
        answer, client_nonce = fields
        if self._token and not auth.verify(self._token, b"client", client.nonce, answer):
            self._note(client, _Refused("wrong tokens", "refused: wrong or missing token"))
            client.closing = True  # first: the reply's flush closes the connection once sent
            self._reply(client, wire.ERROR, [b"authentication failed: wrong or missing token"])
            return
        client.authenticated = True
        self._unproven.pop(client, None)
        if not self._accepting and self._accept_resume is not None:
            self._resume_accepting()  # a place among the unauthenticated is free
        own_proof = auth.proof(self._token, b"server", client_nonce) if self._token else b""
        self._reply(client, wire.OK, [own_proof])

    def _get(self, client: _Client, fields: list[bytes]) -> None:
        (key,) = fields
        current = self._state.get(_key(key))
        self._reply(client, wire.OK, _versioned_fields(*current))

    def _gets(self, client: _Client, fields: list[bytes]) -> None:
        if len(fields) > wire.MAX_GETS:
            raise ValueError(f"at most {wire.MAX_GETS} keys a request")
        reply: list[bytes] = []
        for key in fields:
            reply += _versioned_fields(*self._state.get(_key(key)))
        self._reply(client, wire.OK, reply)

    def _set(self, client: _Client, fields: list[bytes]) -> None:
        key, value = _key(fields[0]), _value(fields[1])
        self._reply(client, wire.OK, [wire.from_int(self._state.set(key, value))])
        self._changed(key)

    def _cas(self, client: _Client, fields: list[bytes]) -> None:
        key, expected, value = _key(fields[0]), wire.to_int(fields[1]), _value(fields[2])
        succeeded, current = self._state.compare_set(key, expected, value)
        self._reply(client, wire.OK, [b"1" if succeeded else b"0", *_versioned_fields(*current)])
        if succeeded:
            self._changed(key)

    def _add(self, client: _Client, fields: list[bytes]) -> None:
        key, amount = _key(fields[0]), wire.to_int(fields[1])
        self._reply(client, wire.OK, [wire.from_int(self._state.add(key, amount))])
        self._changed(key)

    def _delete(self, client: _Client, fields: list[bytes]) -> None:
        key = _key(fields[0])
        existed = self._state.delete(key)
        self._reply(client, wire.OK, [b"1" if existed else b"0"])
        if existed:
            self._changed(key)

    def _wait(self, client: _Client, fields: list[bytes]) -> None:
        # Duplicate keys would park the waiter twice on one key, and reply twice.
        timeout, keys = _seconds(fields[0]), tuple(dict.fromkeys(_key(k) for k in fields[1:]))
        if self._state.all_exist(keys):
            self._reply(client, wire.OK)
            return
        self._park(_Waiter(client, keys, time.monotonic() + timeout))

    def _watch(self, client: _Client, fields: list[bytes]) -> None:
        key, version, timeout = _key(fields[0]), wire.to_int(fields[1]), _seconds(fields[2])
        current = self._state.get(key)
        if current.version != version:
            self._reply(client, wire.OK, _versioned_fields(*current))
            return
        self._park(_Waiter(client, (key,), time.monotonic() + timeout, version))

    def _ping(self, client: _Client, fields: list[bytes]) -> None:
        self._reply(client, wire.OK)

    def _between_stores(self, what: str) -> None:
        """Only a store with a token serves standbys and takes votes: its clients proved it."""
        if self._token is None:
            raise StoreError(f"{what} needs a store with a token: this one has none")

    def _replicate(self, client: _Client, fields: list[bytes]) -> None:
        """The client is a standby: a snapshot now, then every change as it is made."""
        self._between_stores("following a store")
        client.replica = True
        self._replicas.add(client)
        for key, value, version in self._state.items():
            record = [wire.RECORD_KEY, key.encode(), value, wire.from_int(version)]
            self._send(client, _frame(wire.OK, record))
        self._send(
            client, _frame(wire.OK, [wire.RECORD_SYNCED, wire.from_int(self._state.revision)])
        )

    def _ship(self, key: str) -> None:
        """Send the change just made to ``key`` to every standby; one too far behind is dropped."""
        value, version = self._state.get(key)
        record = (
            [wire.RECORD_DELETED, key.encode(), wire.from_int(self._state.revision)]
            if value is None
            else [wire.RECORD_KEY, key.encode(), value, wire.from_int(version)]
        )
        frame = _frame(wire.OK, record)
        for replica in list(self._replicas):
            self._send(replica, frame)
            if len(replica.out) > REPLICA_HIGH_WATER:
                log.warning("store: dropping the standby at %s: too far behind", replica.peer)
                self._close(replica)

    def _promote_request(self, client: _Client, fields: list[bytes]) -> None:
        """``voter`` asks this standby to take over; the answer waits until a quorum of its
        electorate asked at once (or its timeout). A primary answers at once."""
        self._between_stores("a vote")
        if len(fields) != 2:
            raise StoreError("a vote is a voter and a timeout")
        voter, timeout = _key(fields[0]), _seconds(fields[1])
        if self._primary is None:
            self._reply(client, wire.OK)
            return
        waiter = _Waiter(client, (_PROMOTED,), time.monotonic() + timeout)
        self._votes[voter] = waiter
        self._park(waiter)
        self._weigh_votes()

    def _weigh_votes(self) -> None:
        """Take over once the snapshot is whole and a quorum of the electorate read from it
        asks at once. Votes that lapsed (timed out, or their voter left) are forgotten first;
        a voter outside the electorate counts for nothing, and neither does what it says."""
        if self._primary is None or not self._votes:
            return
        for voter, waiter in list(self._votes.items()):
            if waiter.client.waiter is not waiter:
                del self._votes[voter]
        if not self._synced or not self._votes or self._elect is None:
            return
        with self._follow_lock:  # the follower's thread writes the copy
            electorate = self._elect(lambda key: self._state.get(key).value)
        if electorate is None:
            return
        asking = sum(1 for voter in self._votes if voter in electorate.voters)
        if asking >= max(electorate.quorum, 1):
            self._promote(asking)

    def _tell_fenced(self) -> None:
        """Answer every waiting request ``FENCED`` (the loop's thread)."""
        self._fence_told = True
        for parked in list(self._waiters.values()):
            for waiter in list(parked):
                self._unpark(waiter)
                self._reply(waiter.client, wire.FENCED)

    _HANDLERS = {
        wire.GET: _get,
        wire.SET: _set,
        wire.CAS: _cas,
        wire.ADD: _add,
        wire.DELETE: _delete,
        wire.WAIT: _wait,
        wire.WATCH: _watch,
        wire.PING: _ping,
        wire.REPLICATE: _replicate,
        wire.PROMOTE: _promote_request,
        wire.GETS: _gets,
    }

    # -- waiters --------------------------------------------------------------------------------

    def _park(self, waiter: _Waiter) -> None:
        waiter.client.waiter = waiter
        for key in waiter.keys:
            self._waiters.setdefault(key, {})[waiter] = None
        self._schedule(waiter.deadline, waiter)

    def _unpark(self, waiter: _Waiter) -> None:
        waiter.client.waiter = None  # its deadline entry is dead from now on
        for key in waiter.keys:
            parked = self._waiters.get(key)
            if parked is not None:
                parked.pop(waiter, None)
                if not parked:
                    del self._waiters[key]

    def _changed(self, key: str) -> None:
        """Send the change to the standbys; wake the waiters on ``key`` (only those) that the
        change satisfies."""
        if self._replicas:
            self._ship(key)
        parked = self._waiters.get(key)
        if not parked:
            return
        current = self._state.get(key)
        watched: bytes | None = None  # one frame for every watcher of the key
        for waiter in list(parked):
            if waiter.version is None:
                if self._state.all_exist(waiter.keys):
                    self._unpark(waiter)
                    self._reply(waiter.client, wire.OK)
            elif current.version != waiter.version:
                self._unpark(waiter)
                if watched is None:
                    watched = _frame(wire.OK, _versioned_fields(*current))
                self._send(waiter.client, watched)

    def _expire(self, now: float) -> None:
        """Time out the waiters and unauthenticated clients whose deadline passed."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            item = heapq.heappop(deadlines)[2]
            if not self._live(item):
                continue
            if isinstance(item, _Waiter):
                self._unpark(item)
                if item.version is None:
                    missing = [k.encode() for k in item.keys if not self._state.all_exist([k])]
                    self._reply(item.client, wire.TIMEOUT, missing)
                else:
                    current = self._state.get(item.keys[0])
                    self._reply(item.client, wire.OK, _versioned_fields(*current))
            else:
                timeout = f"no authentication within {HANDSHAKE_TIMEOUT:g}s"
                self._refuse(item, _Refused(timeout, timeout))
        if self._accept_resume is not None and self._accept_resume <= now:
            self._resume_accepting()
        self._refusals.tick(now)

    # -- sending and closing --------------------------------------------------------------------

    def _reply(self, client: _Client, status: int, fields: list[bytes] | None = None) -> None:
        self._send(client, _frame(status, fields or []))

    def _send(self, client: _Client, frame: bytes) -> None:
        client.out += frame
        self._flush(client)
        self._update_events(client)

    def _flush(self, client: _Client) -> None:
        """Send what the socket takes now; close the client on an error, or once its last
        reply is out if it is ``closing``."""
        if client not in self._clients:
            return
        out = client.out
        try:
            while out:
                sent = client.sock.send(out)
                if sent == len(out):
                    out.clear()  # frees the memory: an idle connection keeps no buffer
                else:
                    del out[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._close(client)
            return
        if client.closing and not out:
            self._close(client)

    def _note(self, client: _Client, refused: _Refused) -> None:
        self._refusals.note(client.peer, refused.reason, refused.detail, time.monotonic())

    def _refuse(self, client: _Client, refused: _Refused) -> None:
        """Close a misbehaving client, noting why (one log line per interval at most)."""
        if client in self._clients:
            self._note(client, refused)
            self._close(client)

    def _close(self, client: _Client) -> None:
        if client not in self._clients:
            return
        self._clients.discard(client)
        self._replicas.discard(client)
        self._unproven.pop(client, None)
        if client.waiter is not None:
            self._unpark(client.waiter)
        if client.events:
            self._selector.unregister(client.sock)
        client.sock.close()
        client.frames.clear()
        client.partial = bytearray()
        client.body = None
        client.out = bytearray()
        if client.reserved:
            self._release(client, client.reserved)
        if not self._accepting:
            self._resume_accepting()  # a descriptor is free: take the next waiting client


def _frame(status: int, fields: list[bytes]) -> bytes:
    """A reply frame; an error frame if it cannot be one (e.g. a value too big to fit)."""
    try:
        return wire.encode(status, fields)
    except StoreProtocolError as exc:
        return wire.encode(wire.ERROR, [str(exc).encode()])
