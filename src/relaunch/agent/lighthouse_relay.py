"""A node's relay to the job's lighthouse: the address its workers get (``TORCHFT_LIGHTHOUSE``)
stays valid when the lighthouse moves to another node.

The relay listens on a loopback port only (a new way in, so never on the network) and forwards
each connection's bytes, both ways, to wherever the lighthouse is now (``set_target``: the
agent sets it from the address the lighthouse's host wrote in the store). A connection made
while no lighthouse is known is closed at once; one already forwarded stays with its lighthouse
until that one ends it (torchft's client then connects again, and reaches the new one).

Bounded for whoever reaches the port: at most ``MAX_CONNECTIONS`` at once (the listener rests
until one closes), ``CONNECT_TIMEOUT`` seconds to reach the lighthouse, and at most ``CHUNK``
bytes held per direction: a side that does not read stops the reading of the other. It runs on
a ``ServerLoop``: one thread, no thread per connection.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
from typing import Any

import relaunch.core.run.lighthouse as decide
from relaunch.endpoints import is_loopback
from relaunch.runtime import start_thread
from relaunch.server_loop import Listener, ServerLoop, Timer
from relaunch.store.api import StoreError, Watchable

log = logging.getLogger(__name__)

#: Connections relayed at once, at most (a job has a few: one a replica group, and clients).
MAX_CONNECTIONS = 256
#: Seconds a connection has to reach the lighthouse.
CONNECT_TIMEOUT = 3.0
#: Bytes read at once, and held at most per direction.
CHUNK = 65536
#: Seconds one watch of the store's key waits before it is made again.
WATCH_SLICE = 30.0
#: Seconds before the store is read again after it failed (it may be moving to a standby).
STORE_RETRY = 1.0


class _Side:
    """One socket of a relayed connection: what it still has to send (``pending``), and
    whether its peer will send it no more (``peer_done``) or it sent its end (``shut``)."""

    __slots__ = ("peer", "peer_done", "pending", "shut", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.peer: _Side | None = None
        self.pending = b""
        self.peer_done = False
        self.shut = False


class LighthouseRelay:
    """Forwards every connection to a loopback port to the lighthouse's current address."""

    def __init__(
        self, max_connections: int = MAX_CONNECTIONS, connect_timeout: float = CONNECT_TIMEOUT
    ) -> None:
        self.max_connections, self.connect_timeout = max_connections, connect_timeout
        self.loop = ServerLoop()
        self.port: int | None = None
        self.relayed = 0  # connections forwarded so far
        self._target: tuple[str, int] | None = None
        self._pairs: dict[_Side, Timer | None] = {}  # each connection's client side
        self._listener: Listener | None = None
        self._closed = threading.Event()

    @property
    def address(self) -> str:
        """What the workers get: ``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def target(self) -> tuple[str, int] | None:
        """Where new connections go now (None: nowhere: they are closed)."""
        return self._target

    @property
    def open_connections(self) -> int:
        return len(self._pairs)

    def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen on ``host`` (loopback only) and serve on a thread; the port."""
        if not is_loopback(host):
            raise ValueError(f"the lighthouse relay listens on loopback only, not {host!r}")
        sock = socket.create_server((host, port))
        self.port = int(sock.getsockname()[1])
        self._listener = Listener(
            self.loop, sock, self._accept, name="lighthouse relay", admit=self._admit
        )
        self.loop.start("lighthouse relay")
        return self.port

    def set_target(self, target: tuple[str, int] | None) -> None:
        """Where the lighthouse is now (None: unknown); for the connections from now on."""
        self.loop.call_soon(lambda: setattr(self, "_target", target))

    def follow(self, store: Watchable, key: str) -> threading.Thread:
        """Keep the target where the store's ``key`` says the lighthouse is (a thread of its
        own, until ``close``): each change is heard by a watch, none is polled for."""
        return start_thread(self._follow, "lighthouse relay's watch", store, key)

    def _follow(self, store: Watchable, key: str) -> None:
        version, said = -1, None
        while not self._closed.is_set():
            try:
                current = store.get(key) if version < 0 else store.watch(key, version, WATCH_SLICE)
            except StoreError as exc:
                if self._closed.is_set():
                    return  # closed under its wait: nothing to say
                if said != str(exc):
                    log.warning("the lighthouse relay cannot read the store: %s", exc)
                    said = str(exc)
                self._closed.wait(STORE_RETRY)
                continue
            if current.version == version:
                continue
            version = current.version
            target, wrong = decide.target_from(current.value)
            if wrong is not None and said != wrong:
                log.warning("%s", wrong)
                said = wrong
            self.set_target(target)

    def close(self) -> None:
        """Stop serving: every connection closed, the port too."""
        self._closed.set()

        def end() -> None:
            for side in list(self._pairs):
                self._close(side)
            if self._listener is not None:
                self._listener.rest(None)
                self._listener.sock.close()

        self.loop.on_end = end
        self.loop.stop(10.0)
        self.loop.close()

    # -- on the loop's thread ------------------------------------------------------------------

    def _admit(self, now: float) -> bool:
        if len(self._pairs) < self.max_connections:
            return True
        assert self._listener is not None
        self._listener.rest(None)  # until a connection closes
        return False

    def _accept(self, sock: socket.socket, address: Any) -> None:
        target = self._target
        if target is None:
            sock.close()
            return
        sock.setblocking(False)
        client = _Side(sock)
        upstream = _Side(socket.socket(_family(target[0]), socket.SOCK_STREAM))
        upstream.sock.setblocking(False)
        client.peer, upstream.peer = upstream, client
        timer = self.loop.call_later(self.connect_timeout, lambda: self._close(client))
        self._pairs[client] = timer
        code = upstream.sock.connect_ex(target)
        if code not in (0, errno.EINPROGRESS):
            self._close(client)
            return
        self.loop.register(upstream.sock, selectors.EVENT_WRITE, lambda _: self._connected(client))

    def _connected(self, client: _Side) -> None:
        upstream = client.peer
        assert upstream is not None
        if upstream.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            self._close(client)
            return
        timer = self._pairs.get(client)
        if timer is not None:
            timer.cancel()
        self._pairs[client] = None
        self.relayed += 1
        for side in (client, upstream):
            self._watch(side)

    def _ready(self, side: _Side, mask: int) -> None:
        client = side if side in self._pairs else side.peer
        assert client is not None and side.peer is not None
        try:
            if mask & selectors.EVENT_WRITE:
                self._flush(side)
            if mask & selectors.EVENT_READ:
                data = side.sock.recv(CHUNK)
                peer = side.peer
                if data:
                    peer.pending += data
                    self._flush(peer)
                else:  # its end: the peer sends its own end once it sent the rest
                    peer.peer_done = True
                    self._flush(peer)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._close(client)
            return
        for each in (side, side.peer):
            if client in self._pairs:
                self._watch(each)

    def _flush(self, side: _Side) -> None:
        if side.pending:
            sent = side.sock.send(side.pending)
            side.pending = side.pending[sent:]
        if not side.pending and side.peer_done and not side.shut:
            side.shut = True
            side.sock.shutdown(socket.SHUT_WR)

    def _watch(self, side: _Side) -> None:
        """Read a side while its peer holds nothing to send; write it while it holds some."""
        peer = side.peer
        assert peer is not None
        events = 0
        if not peer.pending and not peer.peer_done:
            events |= selectors.EVENT_READ
        if side.pending:
            events |= selectors.EVENT_WRITE
        if side.shut and peer.shut:
            client = side if side in self._pairs else peer
            self._close(client)
            return
        self.loop.unregister(side.sock)
        if events:
            self.loop.register(side.sock, events, lambda mask: self._ready(side, mask))

    def _close(self, client: _Side) -> None:
        if client not in self._pairs:
            return
        timer = self._pairs.pop(client)
        if timer is not None:
            timer.cancel()
        for side in (client, client.peer):
            if side is not None:
                self.loop.unregister(side.sock)
                side.sock.close()
        if self._listener is not None and not self._listener.accepting:
            self._listener.resume()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
