"""The built-in store's client: one connection, one request at a time, deadlines on everything."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence

from relaunch.store import auth, wire
from relaunch.store.api import (
    CasResult,
    StoreAuthError,
    StoreConnectionError,
    StoreError,
    StoreProtocolError,
    StoreTimeout,
    Versioned,
)

#: Extra seconds a client waits beyond a server-side deadline for the reply to arrive.
REPLY_MARGIN = 5.0


def _versioned(fields: list[bytes]) -> Versioned:
    present, value, version = fields
    return Versioned(value if present == b"1" else None, wire.to_int(version))


class TcpStore:
    """A ``Store`` served by a ``TcpStoreServer`` at ``host:port``.

    Connecting retries (with backoff) for up to ``connect_timeout`` seconds, so agents may start
    before the node that hosts the store. Every call has a deadline (``timeout`` by default); a
    call that times out drops the connection, and the next call reconnects.
    """

    def __init__(
        self,
        host: str,
        port: int,
        token: str | None = None,
        timeout: float = 30.0,
        connect_timeout: float | None = None,
    ) -> None:
        self.host, self.port = host, port
        self.timeout = timeout
        self._token = token or None
        self._connect_timeout = timeout if connect_timeout is None else connect_timeout
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._reader = wire.FrameReader()
        self._pending: list[bytes] = []
        with self._lock:
            self._connect()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    # -- connection -----------------------------------------------------------------------------

    def _connect(self) -> None:
        deadline = time.monotonic() + self._connect_timeout
        delay = 0.01
        while True:
            try:
                sock = socket.create_connection(
                    (self.host, self.port), timeout=max(0.01, deadline - time.monotonic())
                )
                break
            except OSError as exc:
                if time.monotonic() + delay > deadline:
                    raise StoreConnectionError(
                        f"cannot reach the store at {self.endpoint} within "
                        f"{self._connect_timeout:g}s: {exc}"
                    ) from None
                time.sleep(delay)  # backoff between connection attempts, bounded by the deadline
                delay = min(delay * 2, 0.5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock, self._reader, self._pending = sock, wire.FrameReader(), []
        try:
            self._handshake(deadline)
        except BaseException:
            self._drop()
            raise

    def _handshake(self, deadline: float) -> None:
        code, hello = self._receive(deadline)
        if code != wire.HELLO or len(hello) != 3 or hello[0] != wire.PROTOCOL:
            raise StoreProtocolError(f"{self.endpoint} is not a relaunch store")
        required, server_nonce = hello[1] == b"1", hello[2]
        if self._token and not required:
            raise StoreAuthError(
                f"the store at {self.endpoint} does not ask for a token: refusing to trust it"
            )
        if required and not self._token:
            raise StoreAuthError(
                f"the store at {self.endpoint} requires a token: set token=... in --rdzv-conf "
                "or RELAUNCH_RDZV_TOKEN"
            )
        my_nonce = auth.nonce()
        answer = auth.proof(self._token, b"client", server_nonce) if self._token else b""
        self._send(wire.encode(wire.AUTH, [answer, my_nonce]))
        code, fields = self._receive(deadline)
        if code != wire.OK:
            raise StoreAuthError(f"the store at {self.endpoint} refused the token")
        if self._token and not (
            len(fields) == 1 and auth.verify(self._token, b"server", my_nonce, fields[0])
        ):
            raise StoreAuthError(f"the store at {self.endpoint} could not prove it knows the token")

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _send(self, frame: bytes) -> None:
        assert self._sock is not None
        try:
            self._sock.sendall(frame)
        except OSError as exc:
            raise StoreConnectionError(f"lost the store at {self.endpoint}: {exc}") from None

    def _receive(self, deadline: float) -> tuple[int, list[bytes]]:
        assert self._sock is not None
        while True:
            if self._pending:
                return wire.decode_payload(self._pending.pop(0))
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreTimeout(f"no reply from the store at {self.endpoint} in time")
            self._sock.settimeout(left)
            try:
                data = self._sock.recv(1 << 16)
            except TimeoutError:
                raise StoreTimeout(f"no reply from the store at {self.endpoint} in time") from None
            except OSError as exc:
                raise StoreConnectionError(f"lost the store at {self.endpoint}: {exc}") from None
            if not data:
                raise StoreConnectionError(f"the store at {self.endpoint} closed the connection")
            self._pending.extend(self._reader.feed(data))

    def _call(self, op: int, fields: Sequence[bytes], wait: float = 0.0) -> list[bytes]:
        """One request and its reply; ``wait`` is how long the server may hold the reply."""
        with self._lock:
            if self._sock is None:
                self._connect()
            try:
                self._send(wire.encode(op, fields))
                code, reply = self._receive(time.monotonic() + self.timeout + wait)
            except StoreError:
                self._drop()  # the reply may still come: this connection is out of step
                raise
        if code == wire.OK:
            return reply
        if code == wire.TIMEOUT:
            missing = ", ".join(k.decode(errors="replace") for k in reply)
            raise StoreTimeout(f"timed out waiting for keys: {missing}")
        raise StoreError(reply[0].decode(errors="replace") if reply else "store error")

    # -- the Store protocol ---------------------------------------------------------------------

    def get(self, key: str) -> Versioned:
        return _versioned(self._call(wire.GET, [key.encode()]))

    def set(self, key: str, value: bytes) -> int:
        return wire.to_int(self._call(wire.SET, [key.encode(), value])[0])

    def compare_set(self, key: str, expected_version: int, value: bytes) -> CasResult:
        reply = self._call(wire.CAS, [key.encode(), wire.from_int(expected_version), value])
        return CasResult(reply[0] == b"1", _versioned(reply[1:]))

    def add(self, key: str, amount: int) -> int:
        return wire.to_int(self._call(wire.ADD, [key.encode(), wire.from_int(amount)])[0])

    def delete(self, key: str) -> bool:
        return self._call(wire.DELETE, [key.encode()])[0] == b"1"

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        millis = wire.from_int(max(0, int(timeout * 1000)))
        self._call(wire.WAIT, [millis, *(k.encode() for k in keys)], wait=timeout)

    def watch(self, key: str, version: int, timeout: float) -> Versioned:
        millis = wire.from_int(max(0, int(timeout * 1000)))
        return _versioned(
            self._call(wire.WATCH, [key.encode(), wire.from_int(version), millis], wait=timeout)
        )

    def ping(self) -> None:
        self._call(wire.PING, [])

    def close(self) -> None:
        with self._lock:
            self._drop()

    def __enter__(self) -> TcpStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
