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
- After: ``store.frames``.

Between stores (docs/store-failover.md): ``store.replication``; the operations:
``store.operations``; who still uses the store: ``store.attendance``.

A connection closed for misbehaving (a wrong token, no authentication in time, garbage, an
oversized frame) is logged with its reason when the first in ``REFUSAL_SUMMARY_INTERVAL`` s; the
others of that time are summed up in one line at its end: a flood does not flood the log.
"""

from __future__ import annotations

import functools
import logging
import selectors
import socket
import threading
from collections.abc import Callable, Iterator

import relaunch.store.auth as auth
import relaunch.store.wire as wire
from relaunch.runtime import descriptor_share
from relaunch.server_loop import Listener, ServerLoop, Timer
from relaunch.store.api import StoreError, StoreProtocolError
from relaunch.store.attendance import Attendance
from relaunch.store.data import KeyValueData
from relaunch.store.frames import _RECV_SIZE, PRE_AUTH_LIMIT, Frames, _Refused
from relaunch.store.limits import (
    check_open_file_limit,
    say_out_of_descriptors,
    say_tokenless_full,
)
from relaunch.store.operations import Client, Operations, Waiter
from relaunch.store.refusals import Refusals
from relaunch.store.replication import Elect, Replication

log = logging.getLogger(__name__)

#: A client must authenticate within this many seconds of connecting.
HANDSHAKE_TIMEOUT = 5.0
#: Connections that have not authenticated yet, at most (a few KiB of memory each; fewer under
#: a low open-file limit: ``descriptor_share``) ...
MAX_UNAUTHENTICATED = 1024
#: ... each given this many seconds before a newcomer may take its place.
HANDSHAKE_GRACE = 1.0
#: Connections closed after the first are summed up in one log line per this many seconds.
REFUSAL_SUMMARY_INTERVAL = 10.0
#: How many connections a server expects at once when not told (the open-file limit is
#: raised for that many).
DEFAULT_CLIENTS = 4096
#: Unsent reply bytes of one client above which its requests are no longer read ...
OUT_HIGH_WATER = 1 << 20
#: ... until they drain to this. A slow reader costs at most OUT_HIGH_WATER plus one reply.
OUT_LOW_WATER = 1 << 16
#: Connections accepted per loop turn: a burst of connects does not hold up the clients served.
_ACCEPTS_PER_TURN = 128
#: Out of descriptors, the listener rests this long (or until a connection closes).
_ACCEPT_BACKOFF = 0.5


class TcpStoreServer:
    """Serves a ``KeyValueData`` on ``host:port`` (port 0 picks a free one) until ``stop()``.

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
        expected = DEFAULT_CLIENTS if expected_clients is None else max(expected_clients, 1)
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        # A backlog for a burst of connects (the kernel caps it at net.core.somaxconn).
        listener.listen(min(max(expected, 1024), 65535))
        self.host, self.port = listener.getsockname()[:2]
        self._loop = loop = ServerLoop()
        loop.on_wake, loop.after_events = self._woken, self._serve_ready
        loop.on_end = self._release_all
        self._listener = Listener(
            loop, listener, self._accept, name="store", admit=self._admit,
            per_turn=_ACCEPTS_PER_TURN, backoff=_ACCEPT_BACKOFF, short=self._short,
            recovered=self._recovered,
        )  # fmt: skip
        self._clients: set[Client] = set()
        self.attendance = Attendance(lambda: len(self._clients), loop.clock)
        self._unproven: dict[Client, None] = {}  # not authenticated yet, oldest first
        self._recv_buffer = bytearray(_RECV_SIZE)
        self._recv_view = memoryview(self._recv_buffer)
        self._frames = Frames(self._update_events)
        self._ready: list[Client] = []  # unpaused clients whose buffered requests wait
        self._refusals = Refusals(REFUSAL_SUMMARY_INTERVAL, "store", log)
        self._thread: threading.Thread | None = None
        self._operations = Operations(self._send, self._schedule, loop.clock.monotonic)
        self._replication = Replication(
            self._operations, self._token, self._send, self._close, loop.wake,
            loop.clock.monotonic,
        )  # fmt: skip
        self._operations.on_change = self._replication.ship
        self._handlers = {
            **self._operations.handlers(),
            wire.REPLICATE: self._replication.replicate,
            wire.PROMOTE: self._replication.promote_request,
        }
        self._fenced = self._fence_told = self._tokenless_full_said = False
        check_open_file_limit(expected + MAX_UNAUTHENTICATED, expected)
        #: Connections that may wait to authenticate at once (``descriptor_share``).
        self.max_unauthenticated = descriptor_share(MAX_UNAUTHENTICATED)
        #: Without a token no client proves anything: all of them at once, at most (the
        #: listener rests at that many until one closes), with room for twice the expected.
        self.max_tokenless = descriptor_share(max(2 * expected, MAX_UNAUTHENTICATED))

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def refused(self) -> int:
        """How many connections the server closed for misbehaving since it started."""
        return self._refusals.total

    @property
    def _waiters(self) -> dict[str, dict[Waiter, None]]:
        return self._operations.waiters

    @property
    def _deadlines(self) -> list[tuple[float, int, Timer]]:
        return self._loop.timers

    @property
    def _sequence(self) -> Iterator[int]:
        return self._loop.sequence

    @property
    def _state(self) -> KeyValueData:
        return self._operations.state

    def start(self) -> TcpStoreServer:
        """Serve in a background thread."""
        self._thread = self._loop.start("relaunch-store")
        return self

    # -- between stores: a standby, its promotion, fencing -----------------------------------

    @property
    def standby(self) -> bool:
        """Whether this store follows another (and redirects its clients there)."""
        return self._replication.primary is not None

    @property
    def following(self) -> bool:
        """Whether a standby's stream from its primary is open now."""
        return self._replication.follower is not None

    @property
    def synced(self) -> bool:
        """Whether a standby holds a whole snapshot of its primary (only then may it take over)."""
        return self._replication.synced

    @property
    def primary(self) -> str | None:
        """A standby: the store it follows (``host:port``); None for a primary."""
        return self._replication.primary

    @property
    def snapshots(self) -> int:
        """Whole snapshots a standby took (one per connection to its primary)."""
        return self._replication.snapshots

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
        self._replication.follow(host, port, elect)

    def fence(self) -> None:
        """Serve nobody from now on (this store lost the job's majority): every request, and
        every one waiting, is answered ``FENCED``."""
        self._fenced = True
        self._loop.wake()

    def stop(self) -> None:
        """Stop serving and release everything; the wake-up pipe is closed here, after the
        thread ended, so that no write can land on a descriptor closed under it."""
        if self._replication.stopped.is_set():
            return
        self._replication.abort()
        self._loop.stop()
        if self._thread is None:  # never served: released here
            self._release_all()
        self._loop.close()

    # -- the loop's handlers ------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Serve on this thread until ``stop``."""
        self._loop.run()

    def _release_all(self) -> None:
        self._refusals.flush()
        for client in list(self._clients):
            self._close(client)
        self._listener.sock.close()

    def _woken(self) -> None:
        if self._fenced and not self._fence_told:
            self._fence_told = True
            self._operations.answer_all(wire.FENCED)
        self._replication.weigh_votes()  # the standby's snapshot may have just completed

    def _serve_ready(self) -> None:
        while self._ready:
            client = self._ready.pop()
            if client in self._clients and not client.paused:
                self._serve_buffered(client)

    def _schedule(self, deadline: float, action: Callable[[], None]) -> Timer:
        # At most one live timer per client: the heap is kept O(clients).
        return self._loop.call_at(deadline, action, live=len(self._clients) + 1)

    def _admit(self, now: float) -> bool:
        if not self._token and len(self._clients) >= self.max_tokenless:
            self._hold_tokenless()
            return False
        return len(self._unproven) < self.max_unauthenticated or self._make_room(now)

    def _accept(self, sock: socket.socket, address: tuple[str, int]) -> None:
        now = self._loop.clock.monotonic()
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client = Client(sock, f"{address[0]}:{address[1]}", auth.nonce(), accepted=now)
        client.handler = functools.partial(self._service, client)
        self._clients.add(client)
        self._unproven[client] = None
        self._loop.register(sock, selectors.EVENT_READ, client.handler)
        client.handshake = self._schedule(now + HANDSHAKE_TIMEOUT, lambda: self._too_slow(client))
        required = b"1" if self._token else b"0"
        self._send(client, wire.encode(wire.HELLO, [wire.PROTOCOL, required, client.nonce]))

    def _too_slow(self, client: Client) -> None:
        if client in self._unproven:
            timeout = f"no authentication within {HANDSHAKE_TIMEOUT:g}s"
            self._refuse(client, _Refused(timeout, timeout))

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
        self._listener.rest(oldest.accepted + HANDSHAKE_GRACE)
        return False

    def _hold_tokenless(self) -> None:
        """A store without a token holds ``max_tokenless`` connections: rest the listener until
        one closes (the rest of the open-file limit stays the agent's), said once."""
        if not self._tokenless_full_said:
            self._tokenless_full_said = True
            say_tokenless_full(len(self._clients))
        self._listener.rest(None)

    def _short(self, exc: OSError) -> None:
        """Out of descriptors with clients waiting: said once an episode."""
        say_out_of_descriptors(exc, len(self._clients))

    def _recovered(self) -> None:
        log.info("store: accepting connections again (%d open)", len(self._clients))

    def _service(self, client: Client, mask: int) -> None:
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
                self._frames.complete(client, body)
        else:
            try:
                self._frames.take(client, self._recv_view[:received])
            except _Refused as refused:
                self._refuse(client, refused)
                return
        self._serve_buffered(client)

    def _serve_buffered(self, client: Client) -> None:
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
                    self._frames.release(client, size)
        except StoreProtocolError as exc:
            reason = "malformed requests" if client.authenticated else "not the store's protocol"
            self._refuse(client, _Refused(reason, str(exc)))
            return
        except _Refused as refused:
            self._refuse(client, refused)
            return
        self._update_events(client)

    def _update_events(self, client: Client) -> None:
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
        if events != client.events and client.handler is not None:
            if not events:
                self._loop.unregister(client.sock)
            elif not client.events:
                self._loop.register(client.sock, events, client.handler)
            else:
                self._loop.modify(client.sock, events, client.handler)
            client.events = events

    def _handle(self, client: Client, op: int, fields: list[bytes]) -> None:
        if not client.authenticated:
            self._authenticate(client, op, fields)
            return
        if client.waiter is not None or client.replica:
            raise StoreProtocolError("a request arrived while another one is still waiting")
        self.attendance.requests += 1
        if self._fenced and op != wire.PING:
            self._reply(client, wire.FENCED)
            return
        primary = self._replication.primary
        if primary is not None and op not in (wire.PING, wire.PROMOTE):
            self._reply(client, wire.REDIRECT, [primary.encode()])
            return
        handler = self._handlers.get(op)
        if handler is None:
            raise StoreProtocolError(f"unknown operation {op}")
        try:
            handler(client, fields)
        except StoreProtocolError:
            raise
        except (StoreError, ValueError, IndexError) as exc:
            self._reply(client, wire.ERROR, [str(exc).encode()])

    def _authenticate(self, client: Client, op: int, fields: list[bytes]) -> None:
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
        if client.handshake is not None:
            client.handshake.cancel()
        if not self._listener.accepting and self._listener.resting_until is not None:
            self._listener.resume()  # a place among the unauthenticated is free
        own_proof = auth.proof(self._token, b"server", client_nonce) if self._token else b""
        self._reply(client, wire.OK, [own_proof])

    def _reply(self, client: Client, status: int, fields: list[bytes] | None = None) -> None:
        self._operations.reply(client, status, fields)

    def _send(self, client: Client, frame: bytes) -> None:
        client.out += frame
        self._flush(client)
        self._update_events(client)

    def _flush(self, client: Client) -> None:
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

    def _note(self, client: Client, refused: _Refused) -> None:
        self._refusals.note(
            client.peer, refused.reason, refused.detail, self._loop.clock.monotonic()
        )
        self._refusals.timed(self._loop)

    def _refuse(self, client: Client, refused: _Refused) -> None:
        """Close a misbehaving client, noting why (one log line per interval at most)."""
        if client in self._clients:
            self._note(client, refused)
            self._close(client)

    def _close(self, client: Client) -> None:
        if client not in self._clients:
            return
        self._clients.discard(client)
        self.attendance.left()
        self._replication.replicas.discard(client)
        self._unproven.pop(client, None)
        if client.handshake is not None:
            client.handshake.cancel()
        if client.waiter is not None:
            self._operations.unpark(client.waiter)
        if client.events:
            self._loop.unregister(client.sock)
        client.sock.close()
        client.frames.clear()
        client.partial = bytearray()
        client.body = None
        client.out = bytearray()
        if client.reserved:
            self._frames.release(client, client.reserved)
        if not self._listener.accepting:
            self._listener.resume()  # a descriptor is free: take the next waiting client
