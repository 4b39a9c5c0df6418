"""The HTTP side of ``--metrics-port``: a small server on a daemon thread that answers
``GET /metrics`` with what ``agent.metrics`` renders.

Hand-written (``socket``, ``selectors``): ``http.server`` would add about 30 ms to the agent's
start, and ``prometheus_client`` about 50 ms. One thread serves every connection at once from one
selector loop, with non-blocking sockets: a client has ``REQUEST_TIMEOUT`` seconds from its
connect to send its request head (at most ``MAX_REQUEST`` bytes), then as long to take the
answer, which closes the connection; at most ``MAX_CONNECTIONS`` are held, the oldest dropped
for a newcomer. Idle or trickling clients cannot hold up a scrape. Deadlines are read on a
``runtime.Clock`` (the selector waits in real time, so only the system clock serves it).
"""

from __future__ import annotations

import errno
import logging
import os
import selectors
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from relaunch.core.output.metrics import CONTENT_TYPE
from relaunch.runtime import SYSTEM_CLOCK, Clock, descriptor_share
from relaunch.server_loop import Listener, ServerLoop, Timer

if TYPE_CHECKING:
    import socket

log = logging.getLogger(__name__)

#: Seconds a client has from its connect to send its request head, and then to take the answer.
REQUEST_TIMEOUT = 5.0
#: The most bytes of a request head (request line and headers); a longer one gets a 431.
MAX_REQUEST = 8192
#: Connections held at once (and no more than a quarter of the open-file limit, so that idle
#: clients cannot take the descriptors the agent needs); a newcomer beyond them takes the place
#: of the oldest. A scrape's request comes with its connect: it is read, and answered, long
#: before that many newer connections could push it out.
MAX_CONNECTIONS = 1024
#: Connections accepted per loop turn, before the ready ones are served.
_ACCEPTS_PER_TURN = 64
#: Out of descriptors with no connection to drop, the listener rests this long.
_ACCEPT_BACKOFF = 0.5


class _Connection:
    """One client: its request head so far, then the answer left to send; its deadline."""

    __slots__ = ("answer", "draining", "handler", "head", "sock", "timer")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.head = bytearray()
        self.answer: memoryview | None = None
        self.timer: Timer | None = None  # its deadline
        self.draining = False  # answered: what else it sends is read and dropped until it hangs up
        self.handler: Callable[[int], None] = lambda mask: None


class MetricsServer:
    """Answers ``GET /metrics`` with ``render()`` from one selector loop on a daemon thread, any
    number of clients at once; bound at construction."""

    def __init__(
        self, host: str, port: int, render: Callable[[], bytes], clock: Clock = SYSTEM_CLOCK
    ) -> None:
        import socket  # here: an agent without metrics loads no network code

        from relaunch.config import ConfigError

        self._render = render
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            if host:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                self._sock = socket.create_server(
                    (host, port), family=family, backlog=MAX_CONNECTIONS
                )
            elif socket.has_dualstack_ipv6():
                self._sock = socket.create_server(
                    ("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=MAX_CONNECTIONS
                )
            else:
                self._sock = socket.create_server(("", port), backlog=MAX_CONNECTIONS)
        except OSError as exc:
            raise ConfigError(
                f"--metrics-port {where}: cannot serve metrics there "
                f"({os.strerror(exc.errno) if exc.errno else exc}); give another port"
            ) from None
        self.port: int = self._sock.getsockname()[1]
        self.max_connections = descriptor_share(MAX_CONNECTIONS)
        self._loop = ServerLoop(clock)
        self._loop.on_end = self._release
        self._listener = Listener(
            self._loop, self._sock, self._accept, name="metrics", per_turn=_ACCEPTS_PER_TURN,
            backoff=_ACCEPT_BACKOFF, on_error=self._accept_failed,
        )  # fmt: skip
        # Every connection, in the order of their deadlines (a deadline only moves later, and
        # a connection whose deadline moves is put last): the first is the oldest.
        self._connections: dict[socket.socket, _Connection] = {}
        self._thread: threading.Thread | None = None
        self._closed = False
        log.info("serving Prometheus metrics on %s:%d/metrics", host or "*", self.port)

    def start(self) -> None:
        if self._thread is None and not self._closed:
            self._thread = self._loop.start("relaunch-metrics", self._serve)

    def close(self) -> None:
        """Stop serving; the thread ends within its current turn (an answer is one render)."""
        if self._closed:
            return
        self._closed = True
        self._loop.stop(REQUEST_TIMEOUT)
        if self._thread is None:
            self._release()
        self._loop.close()

    def _release(self) -> None:
        """Close every connection and the listener (the thread's last act, or ``close``'s)."""
        for conn in list(self._connections.values()):
            self._drop(conn)
        self._sock.close()

    # -- the loop --------------------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            self._loop.run()
        except Exception as exc:  # never silent: the agent goes on, without metrics
            log.error("the metrics server stopped (%s): metrics are no longer served", exc)
            log.debug("the metrics server's failure", exc_info=True)

    def _accept_failed(self, exc: OSError) -> bool:
        """Whether to go on accepting after ``exc``: out of descriptors, once the oldest
        connection is dropped; not for want of memory (the listener rests)."""
        if exc.errno in (errno.EMFILE, errno.ENFILE) and self._connections:
            self._drop(next(iter(self._connections.values())))
            return True
        if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
            return False
        log.debug("a metrics connection failed before it was taken", exc_info=True)
        return True

    def _accept(self, sock: socket.socket, address: object) -> None:
        if len(self._connections) >= self.max_connections:
            self._drop(next(iter(self._connections.values())))  # the oldest
        sock.setblocking(False)
        conn = _Connection(sock)
        conn.handler = lambda mask: self._service(conn, mask)
        self._deadline(conn)
        self._loop.register(sock, selectors.EVENT_READ, conn.handler)

    def _deadline(self, conn: _Connection) -> None:
        """``REQUEST_TIMEOUT`` from now, ``conn`` is dropped; it is put last in the order."""
        if conn.timer is not None:
            conn.timer.cancel()
        self._connections.pop(conn.sock, None)
        self._connections[conn.sock] = conn
        conn.timer = self._loop.call_later(REQUEST_TIMEOUT, lambda: self._drop(conn))

    def _service(self, conn: _Connection, mask: int) -> None:
        try:
            if conn.draining:
                if not conn.sock.recv(65536):
                    self._drop(conn)
                return
            if conn.answer is not None:
                self._send(conn)
                return
            chunk = conn.sock.recv(MAX_REQUEST + 1 - len(conn.head))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not chunk:
            self._drop(conn)
            return
        conn.head += chunk
        if b"\r\n\r\n" in conn.head or b"\n\n" in conn.head:
            self._respond(conn, self._answer(bytes(conn.head)))
        elif len(conn.head) > MAX_REQUEST:
            self._respond(conn, _response("431 Request Header Fields Too Large", b"", b"GET"))

    def _respond(self, conn: _Connection, answer: bytes) -> None:
        """Send ``answer`` (now, or as the client takes it, within a fresh deadline)."""
        conn.answer = memoryview(answer)
        self._deadline(conn)
        self._loop.modify(conn.sock, selectors.EVENT_WRITE, conn.handler)
        try:
            self._send(conn)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(conn)

    def _send(self, conn: _Connection) -> None:
        import socket

        answer = conn.answer
        assert answer is not None
        sent = conn.sock.send(answer)
        conn.answer = answer[sent:]
        if not conn.answer:
            # A lingering close: closing with unread bytes (the rest of a request too long)
            # would reset the connection, and the client could lose the answer. It has until
            # its deadline to hang up.
            conn.sock.shutdown(socket.SHUT_WR)
            conn.draining = True
            self._loop.modify(conn.sock, selectors.EVENT_READ, conn.handler)

    def _drop(self, conn: _Connection) -> None:
        if self._connections.pop(conn.sock, None) is not None:
            self._loop.unregister(conn.sock)
        if conn.timer is not None:
            conn.timer.cancel()
        conn.sock.close()

    def _answer(self, request: bytes) -> bytes:
        method, _, rest = request.partition(b" ")
        path = rest.split(b" ", 1)[0].split(b"?", 1)[0]
        content_type = "text/plain; charset=utf-8"
        if method not in (b"GET", b"HEAD"):
            status, body = "405 Method Not Allowed", b"GET /metrics\n"
        elif path == b"/metrics":
            try:
                status, body, content_type = "200 OK", self._render(), CONTENT_TYPE
            except Exception:  # a scrape must never end the agent; the next one may do
                log.debug("rendering the metrics failed", exc_info=True)
                status, body = "500 Internal Server Error", b"the metrics are not readable now\n"
        elif path == b"/":
            status, body = "200 OK", b"relaunch agent: metrics at /metrics\n"
        else:
            status, body = "404 Not Found", b"not found: metrics are at /metrics\n"
        return _response(status, body, method, content_type)


def _response(
    status: str, body: bytes, method: bytes, content_type: str = "text/plain; charset=utf-8"
) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    return head if method == b"HEAD" else head + body
