"""torch's store served without torch: a server of torch's ``TCPStore`` wire protocol
(``store.torch_wire_shapes``) on one ``ServerLoop`` thread, which the agent of group rank 0
runs for each attempt at ``MASTER_ADDR:MASTER_PORT`` (``agent.hook_torch_store``), as
torchrun's agent serves torch's store (``TORCHELASTIC_USE_AGENT_STORE=True``).

It answers every query torch's client sends as torch's own server does (keys, values, counters,
waits and their cancel, queues, barriers), and bounds what a client may make it hold, as the
port is open to anyone who reaches it:

- a key, a value, the keys of a request: torch's own caps (``torch_wire_shapes``); a request
  torch's client never sends, or past a cap, closes that connection only;
- ``MAX_HELD`` bytes in all: the keys and values kept, and every connection's unread request
  and unsent replies; a request that would take more closes its connection;
- a connection that has not validated within ``HANDSHAKE_TIMEOUT`` seconds, or takes more than
  ``REQUEST_TIMEOUT`` seconds to send a request it began, is closed; an idle one is kept (torch's
  clients hold theirs for the whole job);
- at most ``max_connections`` connections: past it, new ones wait in the kernel's queue until
  one closes; replies a client does not read stop its requests being read past
  ``OUT_HIGH_WATER`` bytes;
- a wait has no deadline here (the client's timeout ends it with ``CANCEL_WAIT``): it holds
  its connection, one wait a connection, and nobody else.
"""

from __future__ import annotations

import logging
import selectors
import socket
from collections import deque
from collections.abc import Callable
from typing import Any

import relaunch.store.torch_wire_shapes as wire
from relaunch.runtime import SYSTEM_CLOCK, Clock
from relaunch.server_loop import Listener, ServerLoop, Timer, adopt, bind_tcp
from relaunch.store.refusals import Refusals
from relaunch.store.torch_wire_shapes import BadRequest

log = logging.getLogger(__name__)

#: Seconds a new connection has to validate (torch's client does it at once).
HANDSHAKE_TIMEOUT = 10.0
#: Seconds a request may take to arrive once its first byte did (8 MiB at 140 KB/s).
REQUEST_TIMEOUT = 60.0
#: Bytes all keys, values and buffers together may take.
MAX_HELD = 1 << 30
#: What a kept key or queued value costs besides its bytes (Python's objects for it).
ENTRY_COST = 100
#: Unsent reply bytes of a client above which its requests are no longer read.
OUT_HIGH_WATER = 1 << 20
#: Connections closed after the first are summed up in one log line per this many seconds.
REFUSAL_SUMMARY_INTERVAL = 10.0
_RECV_SIZE = 1 << 16


def listen(port: int, host: str | None = None) -> tuple[socket.socket | None, str]:
    """A socket listening on ``port`` (``server_loop.bind_tcp``), as torch's ``TCPStore``
    listens where ``host`` is not loopback; or None and why the port cannot be bound."""
    descriptor, why = bind_tcp(port, host)
    return (None, why) if descriptor is None else (adopt(descriptor), "")


class _Connection:
    __slots__ = (
        "deadline", "events", "inbox", "name", "outbox", "scanner", "sock", "validated",
        "wait_cost", "wait_keys", "waiting",
    )  # fmt: skip

    def __init__(self, sock: socket.socket, name: str) -> None:
        self.sock, self.name = sock, name
        self.inbox = bytearray()  # bytes of requests not yet whole
        self.scanner = wire.Scanner()  # how far the request begun is seen
        self.outbox = bytearray()  # replies not yet sent
        self.events = selectors.EVENT_READ
        self.validated = False
        self.waiting = 0  # keys its wait (or barrier) still waits for; 0: none
        self.wait_keys: list[bytes] = []  # the keys it waits on
        self.wait_cost = 0  # what its wait counts against MAX_HELD
        self.deadline: Timer | None = None  # the handshake's, or the request's begun


class TorchWireServer:
    """torch's store on ``listener`` (bound and listening: clients that came early wait in its
    backlog) from ``start`` until ``stop``, at most ``max_connections`` connections at once."""

    def __init__(
        self, listener: socket.socket, max_connections: int, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self._loop = loop = ServerLoop(clock)
        loop.on_end = self._close_all
        self._listener = Listener(
            loop, listener, self._accept, name="torch's store", admit=self._admit
        )
        self.max_connections = max_connections
        self._connections: dict[socket.socket, _Connection] = {}
        self._data: dict[bytes, bytes] = {}
        self._queues: dict[bytes, deque[bytes]] = {}
        #: key -> the connections whose wait it may end, in the order they asked.
        self._waiters: dict[bytes, list[_Connection]] = {}
        self.held = 0  # bytes counted against MAX_HELD
        self._full_said = False
        self._refusals = Refusals(REFUSAL_SUMMARY_INTERVAL, "torch's store", log)
        self._buffer = bytearray(_RECV_SIZE)
        self._queries: dict[int, Callable[..., bytes | None]] = {
            wire.PING: self._ping,
            wire.SET: self._set,
            wire.COMPARE_SET: self._compare_set,
            wire.GET: self._get,
            wire.ADD: self._add,
            wire.CHECK: self._check,
            wire.WAIT: self._wait,
            wire.GETNUMKEYS: self._num_keys,
            wire.DELETE_KEY: self._delete,
            wire.APPEND: self._append,
            wire.MULTI_GET: self._multi_get,
            wire.MULTI_SET: self._multi_set,
            wire.CANCEL_WAIT: self._cancel_wait,
            wire.QUEUE_PUSH: self._queue_push,
            wire.QUEUE_POP: self._queue_pop,
            wire.QUEUE_LEN: self._queue_len,
            wire.LIST_KEYS: self._list_keys,
            wire.BARRIER: self._barrier,
        }

    @property
    def port(self) -> int:
        return int(self._listener.sock.getsockname()[1])

    @property
    def waiting(self) -> int:
        """Connections whose wait (or barrier) is pending."""
        return sum(1 for connection in list(self._connections.values()) if connection.waiting)

    def start(self) -> TorchWireServer:
        self._loop.start("relaunch-torch-store")
        return self

    def running(self) -> bool:
        """Whether the server's thread serves (it ends only by ``stop``, or a failure, which
        ``runtime.start_thread`` reports)."""
        thread = self._loop.thread
        return thread is not None and thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Close every connection and the listener (the port is free again when this
        returns), and end the thread."""
        self._loop.stop(timeout)
        if self._loop.thread is None:  # never started: nothing else closes them
            self._close_all()
        elif self._loop.thread.is_alive():
            log.warning("torch's store: its thread did not end within %gs", timeout)
        self._loop.close()

    def _close_all(self) -> None:
        for connection in list(self._connections.values()):
            self._drop(connection)
        self._loop.unregister(self._listener.sock)
        self._listener.sock.close()
        self._refusals.flush()

    # -- connections -------------------------------------------------------------------------

    def _admit(self, now: float) -> bool:
        if len(self._connections) < self.max_connections:
            return True
        if not self._full_said:
            self._full_said = True
            log.warning(
                "torch's store: %d connections, the most it holds: new ones wait until some close",
                len(self._connections),
            )
        self._listener.rest(None)
        return False

    def _accept(self, sock: socket.socket, address: object) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection = _Connection(sock, _peer(address))
        self._connections[sock] = connection
        connection.deadline = self._loop.call_later(
            HANDSHAKE_TIMEOUT,
            lambda: self._refuse(connection, BadRequest("no handshake", "no handshake in time")),
        )
        self._loop.register(sock, selectors.EVENT_READ, lambda mask: self._ready(connection))

    def _ready(self, connection: _Connection) -> None:
        sock = connection.sock
        if connection.outbox:
            self._flush(connection)
            if connection.sock.fileno() < 0 or not connection.events & selectors.EVENT_READ:
                return
        try:
            count = sock.recv_into(self._buffer)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            count = 0
        if count == 0:
            self._drop(connection)
            return
        if self.held + count > MAX_HELD:
            self._refuse(connection, BadRequest("store full", f"over {MAX_HELD} bytes held"))
            return
        connection.inbox += memoryview(self._buffer)[:count]
        self.held += count
        try:
            self._serve(connection)
        except BadRequest as bad:
            self._refuse(connection, bad)
        if connection.outbox and connection.sock.fileno() >= 0:
            self._flush(connection)

    def _serve(self, connection: _Connection) -> None:
        inbox, at = connection.inbox, 0
        while connection.scanner.end(inbox, at) is not None:
            request = wire.parse(inbox, at)
            assert request is not None  # whole: the scanner found its end
            query, fields, at = request
            if not connection.validated:
                if query != wire.VALIDATE or fields[0] != wire.MAGIC:
                    raise BadRequest("bad handshake", "no validation first")
                connection.validated = True
                self._cancel_deadline(connection)
                continue
            self._answer(connection, query, fields)
            if connection.sock.fileno() < 0:
                return
        if at:
            del inbox[:at]
            connection.scanner.moved(at)
            self.held -= at
            if connection.validated:
                self._cancel_deadline(connection)  # the next request has a deadline of its own
        if inbox and connection.validated and connection.deadline is None:
            connection.deadline = self._loop.call_later(
                REQUEST_TIMEOUT,
                lambda: self._refuse(
                    connection, BadRequest("slow request", "a request not whole in time")
                ),
            )
        elif not inbox and connection.validated:
            self._cancel_deadline(connection)

    def _cancel_deadline(self, connection: _Connection) -> None:
        if connection.deadline is not None:
            connection.deadline.cancel()
            connection.deadline = None

    def _flush(self, connection: _Connection) -> None:
        outbox = connection.outbox
        try:
            sent = connection.sock.send(outbox)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._drop(connection)
            return
        del outbox[:sent]
        self.held -= sent
        reading = len(outbox) <= OUT_HIGH_WATER  # else its requests wait for it to read
        events = (selectors.EVENT_READ if reading else 0) | (selectors.EVENT_WRITE if outbox else 0)
        if events != connection.events:
            connection.events = events
            self._loop.modify(connection.sock, events, lambda mask: self._ready(connection))

    def _send(self, connection: _Connection, reply: bytes) -> None:
        if self.held + len(reply) > MAX_HELD:
            raise BadRequest("store full", f"a reply over {MAX_HELD} bytes held")
        connection.outbox += reply
        self.held += len(reply)

    def _refuse(self, connection: _Connection, bad: BadRequest) -> None:
        now = self._loop.clock.monotonic()
        self._refusals.note(connection.name, bad.reason, str(bad), now)
        self._refusals.timed(self._loop)
        self._drop(connection)

    def _drop(self, connection: _Connection) -> None:
        if self._connections.pop(connection.sock, None) is None:
            return
        self._cancel_deadline(connection)
        self._stop_waiting(connection)
        self.held -= len(connection.inbox) + len(connection.outbox)
        connection.inbox.clear()
        connection.outbox.clear()
        self._loop.unregister(connection.sock)
        connection.sock.close()
        if not self._listener.accepting and not self._loop.stopping:
            self._full_said = False
            self._listener.resume()

    # -- the store ---------------------------------------------------------------------------

    def _answer(self, connection: _Connection, query: int, fields: tuple[Any, ...]) -> None:
        """Do what ``query`` asks; its reply, if it has one, goes into the outbox."""
        if query == wire.VALIDATE:
            raise BadRequest("bad handshake", "a second validation")
        reply = self._queries[query](connection, *fields)
        if reply is not None:
            self._send(connection, reply)

    def _ping(self, connection: _Connection, nonce: int) -> bytes:
        return wire.nonce(nonce)

    def _set(self, connection: _Connection, key: bytes, value: bytes) -> None:
        self._put(key, value)

    def _append(self, connection: _Connection, key: bytes, value: bytes) -> None:
        self._put(key, self._data.get(key, b"") + value)

    def _compare_set(
        self, connection: _Connection, key: bytes, expected: bytes, desired: bytes
    ) -> bytes:
        current = self._data.get(key)
        if (current is None and not expected) or current == expected:
            self._put(key, desired)
        else:
            self._wake(key)  # as torch's server does
        return wire.blob(self._data.get(key, expected))

    def _get(self, connection: _Connection, key: bytes) -> bytes:
        return wire.blob(self._data.get(key, b""))

    def _multi_get(self, connection: _Connection, keys: tuple[bytes, ...]) -> bytes:
        data = self._data
        if sum(len(data.get(key, b"")) + 8 for key in keys) > wire.MAX_REQUEST:
            raise BadRequest("reply too long", f"a reply over {wire.MAX_REQUEST} bytes")
        return b"".join(wire.blob(data.get(key, b"")) for key in keys)

    def _multi_set(self, connection: _Connection, pairs: tuple[tuple[bytes, bytes], ...]) -> None:
        for key, value in pairs:
            self._put(key, value)

    def _add(self, connection: _Connection, key: bytes, delta: int) -> bytes:
        total = wire.added(self._data.get(key), delta)
        self._put(key, str(total).encode())
        return wire.int64(total)

    def _barrier(self, connection: _Connection, key: bytes, world_size: int) -> bytes | None:
        total = wire.added(self._data.get(key), 1)
        self._put(key, str(total).encode(), wake=total >= world_size)  # all came: wake them
        if total >= world_size:
            return bytes([wire.STOP_WAITING])
        self._wait_on(connection, [key])
        return None

    def _check(self, connection: _Connection, keys: tuple[bytes, ...]) -> bytes:
        ready = all(self._present(key) for key in keys)
        return bytes([wire.READY if ready else wire.NOT_READY])

    def _wait(self, connection: _Connection, keys: tuple[bytes, ...]) -> bytes | None:
        if all(self._present(key) for key in keys):
            return bytes([wire.STOP_WAITING])
        self._wait_on(connection, [key for key in keys if key not in self._data])
        return None

    def _cancel_wait(self, connection: _Connection) -> bytes:
        self._stop_waiting(connection)
        return bytes([wire.WAIT_CANCELED])

    def _num_keys(self, connection: _Connection) -> bytes:
        return wire.int64(len(self._data))

    def _delete(self, connection: _Connection, key: bytes) -> bytes:
        value = self._data.pop(key, None)
        if value is not None:
            self.held -= len(key) + len(value) + ENTRY_COST
        return wire.int64(0 if value is None else 1)

    def _list_keys(self, connection: _Connection) -> bytes:
        return wire.int64(len(self._data)) + b"".join(map(wire.blob, self._data))

    def _queue_push(self, connection: _Connection, key: bytes, value: bytes) -> None:
        self._grow(len(value) + ENTRY_COST)
        self._queues.setdefault(key, deque()).append(value)
        self._wake(key, everyone=False)

    def _queue_pop(self, connection: _Connection, key: bytes) -> bytes:
        queue = self._queues.get(key)
        if not queue:
            return wire.int64(0)
        reply = wire.int64(len(queue))
        value = queue.popleft()
        if not queue:
            del self._queues[key]
        self.held -= len(value) + ENTRY_COST
        return reply + wire.blob(value)

    def _queue_len(self, connection: _Connection, key: bytes) -> bytes:
        return wire.int64(len(self._queues.get(key, ())))

    def _grow(self, size: int) -> None:
        if self.held + size > MAX_HELD:
            raise BadRequest("store full", f"over {MAX_HELD} bytes held")
        self.held += size

    def _put(self, key: bytes, value: bytes, wake: bool = True) -> None:
        old = self._data.get(key)
        self._grow(len(value) - len(old) if old is not None else len(key) + len(value) + ENTRY_COST)
        self._data[key] = value
        if wake:
            self._wake(key)

    def _present(self, key: bytes) -> bool:
        return key in self._data or bool(self._queues.get(key))

    def _wait_on(self, connection: _Connection, keys: list[bytes]) -> None:
        if connection.waiting:
            raise BadRequest("two waits", "a wait while one is pending")
        cost = sum(len(key) + ENTRY_COST for key in keys)
        self._grow(cost)
        for key in keys:
            self._waiters.setdefault(key, []).append(connection)
        connection.waiting, connection.wait_keys, connection.wait_cost = len(keys), keys, cost

    def _wake(self, key: bytes, everyone: bool = True) -> None:
        """``key`` changed: each wait on it counts it as come, and those it ends are answered
        (``everyone``: all of them, else the first, as for a queue's new value, which one pop
        takes)."""
        waiting = self._waiters.pop(key, None)
        if not waiting:
            return
        for index, connection in enumerate(waiting):
            connection.waiting -= 1
            if connection.waiting == 0:
                self._end_wait(connection)
                connection.outbox += bytes([wire.STOP_WAITING])
                self.held += 1
                self._flush(connection)
                if not everyone:
                    if index + 1 < len(waiting):
                        self._waiters[key] = waiting[index + 1 :]
                    return

    def _end_wait(self, connection: _Connection) -> None:
        connection.waiting = 0
        connection.wait_keys = []
        self.held -= connection.wait_cost
        connection.wait_cost = 0

    def _stop_waiting(self, connection: _Connection) -> None:
        """Its wait is cancelled, or its connection closed."""
        if not connection.waiting:
            return
        for key in set(connection.wait_keys):
            waiting = self._waiters.get(key)
            if waiting is not None:
                waiting[:] = [other for other in waiting if other is not connection]
                if not waiting:
                    del self._waiters[key]
        self._end_wait(connection)


def _peer(address: object) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{address[0]}:{address[1]}"
    return str(address)
