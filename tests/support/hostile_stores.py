"""Hostile servers on 127.0.0.1 for tests: a store or an etcd member that trickles its reply a
byte at a time, says nothing, sends garbage, or answers with values of the wrong shape.

Each runs in daemon threads of the test process and is closed by its context manager (which
closes every connection it accepted, so no thread outlives the test for long)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from relaunch.store import wire


class _Server:
    """Accepts on a loopback port; each connection is served by ``serve(conn)`` in a thread."""

    def __init__(self, serve: Callable[[socket.socket], None]) -> None:
        self._serve = serve
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"127.0.0.1:{self.port}"
        self._conns: list[socket.socket] = []
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        try:
            self._serve(conn)
        except OSError:
            pass

    def pause(self, seconds: float) -> bool:
        """Wait ``seconds`` (the server's pace); False once closed."""
        return not self._closed.wait(seconds)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        for conn in self._conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()


@contextmanager
def serving(serve: Callable[[_Server, socket.socket], None]) -> Iterator[_Server]:
    server: _Server

    def run(conn: socket.socket) -> None:
        serve(server, conn)

    server = _Server(run)
    try:
        yield server
    finally:
        server.close()


def _read_request(conn: socket.socket) -> bytes:
    """One HTTP request's head and body (Content-Length framed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def http_reply(body: bytes, status: str = "200 OK") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def etcd_member(mode: str, reply: bytes = b"") -> AbstractContextManager[_Server]:
    """A hostile etcd member: ``trickle`` (a valid-looking reply, a byte every 0.5 s),
    ``silent`` (accepts, reads, says nothing), ``garbage`` (bytes that are not HTTP), or
    ``reply`` (answers every request with the raw HTTP ``reply``)."""

    def serve(server: _Server, conn: socket.socket) -> None:
        while _read_request(conn):
            if mode == "trickle":
                for byte in http_reply(b'{"header": {"revision": "1"}}' + b" " * 1000):
                    conn.sendall(bytes([byte]))
                    if not server.pause(0.5):
                        return
            elif mode == "silent":
                server.pause(3600)
                return
            elif mode == "garbage":
                conn.sendall(b"\x00\xff garbage \x1b[2J\r\n" * 50)
            else:
                conn.sendall(reply)

    return serving(serve)


def store_hello() -> bytes:
    return wire.encode(wire.HELLO, [wire.PROTOCOL, b"0", b"n" * 16])


def fake_store(
    answer: Callable[[int, list[bytes]], bytes], trickle: float = 0.0, delay: float = 0.0
) -> AbstractContextManager[_Server]:
    """A built-in store speaking the wire protocol without a token, whose every request after
    the handshake is answered with the frame ``answer(op, fields)`` returns: sent a byte every
    ``trickle`` seconds if set, or whole after ``delay`` seconds."""

    def serve(server: _Server, conn: socket.socket) -> None:
        reader = wire.FrameReader()
        conn.sendall(store_hello())
        authed = False
        while True:
            data = conn.recv(65536)
            if not data:
                return
            for payload in reader.feed(data):
                op, fields = wire.decode_payload(payload)
                if not authed:
                    authed = True
                    conn.sendall(wire.encode(wire.OK, []))
                    continue
                frame = answer(op, fields)
                if trickle:
                    for byte in frame:
                        conn.sendall(bytes([byte]))
                        if not server.pause(trickle):
                            return
                else:
                    if delay and not server.pause(delay):
                        return
                    conn.sendall(frame)

    return serving(serve)


def values_store(values: dict[str, bytes], **kwargs: float) -> AbstractContextManager[_Server]:
    """A fake built-in store holding ``values`` (GET answers them; anything else is absent).
    A value of type ``bytes`` starting with b"FRAME:" is sent as that raw frame instead."""

    def answer(op: int, fields: list[bytes]) -> bytes:
        key = fields[0].decode() if fields else ""
        value = values.get(key)
        if value is not None and value.startswith(b"FRAME:"):
            return value[len(b"FRAME:") :]
        if value is None:
            return wire.encode(wire.OK, [b"0", b"", b"0"])
        return wire.encode(wire.OK, [b"1", value, b"7"])

    return fake_store(answer, **kwargs)


def etcd_range_reply(kvs: object, revision: object = "9") -> bytes:
    """An etcd range reply (raw HTTP) with ``kvs`` as given, for a fake member."""
    return http_reply(json.dumps({"header": {"revision": revision}, "kvs": kvs}).encode())


def elapsed(function: Callable[[], object]) -> tuple[float, object]:
    """``function()``'s seconds and its result (or the exception it raised)."""
    started = time.monotonic()
    try:
        result: object = function()
    except Exception as exc:
        result = exc
    return time.monotonic() - started, result
