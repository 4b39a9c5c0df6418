"""The built-in store server: one thread, one ``selectors`` loop, any number of clients.

Blocking operations (``wait``, ``watch``) park the connection as a waiter with a deadline; any
change to a key wakes exactly the waiters on that key. A client that sends a malformed,
truncated or oversized frame, or fails authentication, loses its connection; the server goes on.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field

from relaunch.runtime import start_thread
from relaunch.store import auth, wire
from relaunch.store.api import StoreError, StoreProtocolError
from relaunch.store.state import KeyValueState

log = logging.getLogger(__name__)

#: A client must authenticate within this many seconds of connecting.
HANDSHAKE_TIMEOUT = 10.0
_RECV_SIZE = 1 << 16
#: Longer WAIT/WATCH timeouts (in ms) are clamped to this: any decimal integer then fits a float.
_MAX_PARK_MS = 365 * 86400 * 1000
#: The longest one select() sleeps: epoll refuses timeouts over ~24.8 days.
_MAX_SELECT = 3600.0


@dataclass(eq=False)
class _Client:
    sock: socket.socket
    peer: str
    nonce: bytes
    reader: wire.FrameReader = field(default_factory=wire.FrameReader)
    out: bytearray = field(default_factory=bytearray)
    authenticated: bool = False
    handshake_deadline: float = 0.0
    waiter: _Waiter | None = None
    closing: bool = False
    writing: bool = False  # registered for EVENT_WRITE while replies wait to be sent


@dataclass(eq=False)
class _Waiter:
    client: _Client
    keys: tuple[str, ...]
    deadline: float
    version: int | None = None  # None: wait for the keys to exist; else watch for a change


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
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> None:
        self._token = token or None
        self._state = KeyValueState()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(1024)
        self._listener.setblocking(False)
        self.host, self.port = self._listener.getsockname()[:2]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._clients: set[_Client] = set()
        self._waiters: dict[str, list[_Waiter]] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> TcpStoreServer:
        """Serve in a background thread."""
        self._thread = start_thread(self.serve_forever, "relaunch-store")
        return self

    def stop(self) -> None:
        """Stop serving and release everything; the wake-up pipe is closed here, after the
        thread ended, so that no write can land on a descriptor closed under it."""
        if self._wake_w < 0:
            return
        self._stopping = True
        os.write(self._wake_w, b"x")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._wake_r = self._wake_w = -1

    # -- the loop -------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        try:
            while not self._stopping:
                for key, mask in self._selector.select(self._next_deadline()):
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        os.read(self._wake_r, 512)
                    else:
                        self._service(key.data, mask)
                self._expire(time.monotonic())
        finally:
            for client in list(self._clients):
                self._close(client)
            self._selector.close()
            self._listener.close()

    def _next_deadline(self) -> float | None:
        deadlines = [w.deadline for ws in self._waiters.values() for w in ws]
        deadlines += [c.handshake_deadline for c in self._clients if not c.authenticated]
        if not deadlines:
            return None
        return min(max(0.0, min(deadlines) - time.monotonic()), _MAX_SELECT)

    def _accept(self) -> None:
        while True:
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of file descriptors: keep serving the others
                log.warning("store: cannot accept a connection: %s", exc)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client = _Client(
                sock,
                f"{address[0]}:{address[1]}",
                auth.nonce(),
                handshake_deadline=time.monotonic() + HANDSHAKE_TIMEOUT,
            )
            self._clients.add(client)
            self._selector.register(sock, selectors.EVENT_READ, client)
            required = b"1" if self._token else b"0"
            self._send(client, wire.encode(wire.HELLO, [wire.PROTOCOL, required, client.nonce]))

    def _service(self, client: _Client, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(client)
        if not mask & selectors.EVENT_READ or client not in self._clients:
            return
        try:
            data = client.sock.recv(_RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(client)
            return
        try:
            for payload in client.reader.feed(data):
                if client.closing:
                    break
                self._handle(client, *wire.decode_payload(payload))
        except StoreProtocolError as exc:
            log.warning("store: closing %s: %s", client.peer, exc)
            self._close(client)

    # -- requests -------------------------------------------------------------------------------

    def _handle(self, client: _Client, op: int, fields: list[bytes]) -> None:
        if not client.authenticated:
            self._authenticate(client, op, fields)
            return
        if client.waiter is not None:
            raise StoreProtocolError("a request arrived while another one is still waiting")
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
            raise StoreProtocolError("expected the authentication frame first")
        answer, client_nonce = fields
        if self._token and not auth.verify(self._token, b"client", client.nonce, answer):
            log.warning("store: refused %s: wrong or missing token", client.peer)
            client.closing = True  # first: the reply's flush closes the connection once sent
            self._reply(client, wire.ERROR, [b"authentication failed: wrong or missing token"])
            return
        client.authenticated = True
        own_proof = auth.proof(self._token, b"server", client_nonce) if self._token else b""
        self._reply(client, wire.OK, [own_proof])

    def _get(self, client: _Client, fields: list[bytes]) -> None:
        (key,) = fields
        current = self._state.get(_key(key))
        self._reply(client, wire.OK, _versioned_fields(*current))

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

    _HANDLERS = {
        wire.GET: _get,
        wire.SET: _set,
        wire.CAS: _cas,
        wire.ADD: _add,
        wire.DELETE: _delete,
        wire.WAIT: _wait,
        wire.WATCH: _watch,
        wire.PING: _ping,
    }

    # -- waiters --------------------------------------------------------------------------------

    def _park(self, waiter: _Waiter) -> None:
        waiter.client.waiter = waiter
        for key in waiter.keys:
            self._waiters.setdefault(key, []).append(waiter)

    def _unpark(self, waiter: _Waiter) -> None:
        waiter.client.waiter = None
        for key in waiter.keys:
            parked = self._waiters.get(key, [])
            if waiter in parked:
                parked.remove(waiter)
            if not parked:
                self._waiters.pop(key, None)

    def _changed(self, key: str) -> None:
        for waiter in list(self._waiters.get(key, ())):
            if waiter.version is None:
                if self._state.all_exist(waiter.keys):
                    self._unpark(waiter)
                    self._reply(waiter.client, wire.OK)
            elif self._state.get(key).version != waiter.version:
                self._unpark(waiter)
                self._reply(waiter.client, wire.OK, _versioned_fields(*self._state.get(key)))

    def _expire(self, now: float) -> None:
        expired = {w for ws in self._waiters.values() for w in ws if w.deadline <= now}
        for waiter in expired:
            self._unpark(waiter)
            if waiter.version is None:
                missing = [k.encode() for k in waiter.keys if not self._state.all_exist([k])]
                self._reply(waiter.client, wire.TIMEOUT, missing)
            else:
                self._reply(
                    waiter.client, wire.OK, _versioned_fields(*self._state.get(waiter.keys[0]))
                )
        for client in [c for c in self._clients if not c.authenticated]:
            if client.handshake_deadline <= now:
                log.warning(
                    "store: closing %s: no authentication within %ss",
                    client.peer,
                    HANDSHAKE_TIMEOUT,
                )
                self._close(client)

    # -- sending and closing --------------------------------------------------------------------

    def _reply(self, client: _Client, status: int, fields: list[bytes] | None = None) -> None:
        try:
            frame = wire.encode(status, fields or [])
        except StoreProtocolError as exc:  # e.g. a value too big to fit in a reply frame
            frame = wire.encode(wire.ERROR, [str(exc).encode()])
        self._send(client, frame)

    def _send(self, client: _Client, frame: bytes) -> None:
        client.out += frame
        self._flush(client)

    def _flush(self, client: _Client) -> None:
        if client not in self._clients:
            return
        try:
            while client.out:
                sent = client.sock.send(client.out)
                del client.out[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._close(client)
            return
        if bool(client.out) != client.writing:
            client.writing = bool(client.out)
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if client.writing else 0)
            self._selector.modify(client.sock, events, client)
        if client.closing and not client.out:
            self._close(client)

    def _close(self, client: _Client) -> None:
        if client not in self._clients:
            return
        self._clients.discard(client)
        if client.waiter is not None:
            self._unpark(client.waiter)
        self._selector.unregister(client.sock)
        client.sock.close()
