"""The built-in store's client: one connection, one request at a time, deadlines on everything.

Each request (sending it, and its whole reply) and each connection (with its handshake) is
bounded as a whole by a ``deadline.Deadline``, however the server trickles its bytes; an
enclosing ``deadline.limit`` narrows them (``relaunch status`` bounds its whole read so). A reply
of the wrong shape is a ``StoreProtocolError``, never an exception of another kind.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Sequence

import relaunch.store.auth as auth
import relaunch.store.wire as wire
from relaunch.core.durations import seconds
from relaunch.runtime import SYSTEM_CLOCK, Clock
from relaunch.store.api import (
    CasResult,
    StoreAuthError,
    StoreConnectionError,
    StoreError,
    StoreFenced,
    StoreProtocolError,
    StoreRedirect,
    StoreRefused,
    StoreTimeout,
    Versioned,
)
from relaunch.store.deadline import Deadline
from relaunch.store.retry import Backoff

#: Extra seconds a client waits beyond a server-side deadline for the reply to arrive.
REPLY_MARGIN = 5.0
#: How long a follower's stream may stay quiet: as long as its connection lives.
_FOREVER = 365 * 86400.0


def _fields(reply: list[bytes], count: int) -> list[bytes]:
    """``reply`` when it has ``count`` fields; else ``StoreProtocolError``."""
    if len(reply) != count:
        raise StoreProtocolError(f"expected a reply of {count} field(s), got {len(reply)}")
    return reply


def _versioned(fields: list[bytes]) -> Versioned:
    present, value, version = _fields(fields, 3)
    if present not in (b"0", b"1"):
        raise StoreProtocolError(f"expected a presence flag, got {present[:20]!r}")
    return Versioned(value if present == b"1" else None, wire.to_int(version))


class TcpStore:
    """A ``Store`` served by a ``TcpStoreServer`` at ``host:port``.

    Connecting retries (with backoff) for up to ``connect_timeout`` seconds, so agents may start
    before the node that hosts the store, and its host's name may resolve only later (a
    cluster's DNS); ``on_wait`` (given the endpoint, that time and what is awaited, if not the
    store's answer) is called once, when the first attempt fails and the retrying begins.
    Every call has a deadline (``timeout`` by default), kept on ``clock``; a call that times
    out drops the connection, and the next call reconnects.
    """

    def __init__(
        self,
        host: str,
        port: int,
        token: str | None = None,
        timeout: float = 30.0,
        connect_timeout: float | None = None,
        on_wait: Callable[[str, float, str], None] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._address = (host, port)
        self.timeout = timeout
        self._clock = clock
        self._token = token or None
        self._connect_timeout = timeout if connect_timeout is None else connect_timeout
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._reader = wire.FrameReader()
        self._pending: list[bytes] = []
        self._suspended = False
        with self._lock:
            self._connect(on_wait)

    @property
    def host(self) -> str:
        return self._address[0]

    @property
    def port(self) -> int:
        return self._address[1]

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def move_to(self, host: str, port: int) -> None:
        """Serve every call from now on from the store at ``host:port`` (the job's store moved
        there: ``rendezvous.failover``). A call waiting on the old store, in another thread,
        ends with ``StoreConnectionError``; the next call connects to the new one."""
        self._address = (host, port)
        self._suspended = False
        self.interrupt()

    def suspend(self) -> None:
        """The store was lost and may move: end the call in flight, and fail every call with
        ``StoreConnectionError`` at once (none reconnects to a silent host) until ``resume``
        or ``move_to``."""
        self._suspended = True
        self.interrupt()

    def resume(self) -> None:
        self._suspended = False

    def interrupt(self) -> None:
        """End the call another thread waits in (``StoreConnectionError``); an idle connection
        is closed. Either way the next call connects afresh."""
        if self._lock.acquire(blocking=False):
            try:
                self._drop()
            finally:
                self._lock.release()
        else:
            self.abort()

    # -- connection -----------------------------------------------------------------------------

    def _connect(self, on_wait: Callable[[str, float, str], None] | None = None) -> None:
        """Connect and shake hands within the connect timeout. A connection reset or closed
        before the handshake ends is tried again, as a refused one is: a store whose host is
        dying may still take a connection into its backlog, then reset it, and the next try is
        refused (``StoreRefused``: the store is gone, not merely out of reach)."""
        deadline = Deadline(self._connect_timeout, self._clock)
        backoff = Backoff(deadline.at, self._clock)
        while True:
            try:
                sock = socket.create_connection(self._address, timeout=max(0.01, deadline.left()))
            except OSError as exc:
                # A name that does not resolve is waited for like a store that does not answer:
                # a cluster's DNS may publish the store's host after this node starts.
                unresolved = isinstance(exc, socket.gaierror)
                if on_wait is not None:
                    reason = (
                        f"its host cannot be resolved yet: {exc.strerror}" if unresolved else ""
                    )
                    on_wait(self.endpoint, self._connect_timeout, reason)
                    on_wait = None
                if not backoff.pause():
                    problem = "resolve the host of" if unresolved else "reach"
                    refused = isinstance(exc, ConnectionRefusedError)
                    raise (StoreRefused if refused else StoreConnectionError)(
                        f"cannot {problem} the store at {self.endpoint} within "
                        f"{seconds(self._connect_timeout)}: {exc.strerror or exc}"
                    ) from None
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock, self._reader, self._pending = sock, wire.FrameReader(), []
            try:
                self._handshake(deadline)
                return
            except BaseException as exc:
                self._drop()
                # Reset or closed before the hello ended: tried again (a wrong token is not).
                cut = isinstance(exc, StoreConnectionError) and not isinstance(exc, StoreAuthError)
                if not (cut and backoff.pause()):
                    raise

    def _handshake(self, deadline: Deadline) -> None:
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
        self._send(wire.encode(wire.AUTH, [answer, my_nonce]), deadline)
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

    def _send(self, frame: bytes, deadline: Deadline) -> None:
        assert self._sock is not None
        try:
            self._sock.settimeout(deadline.timeout())  # sendall as a whole, not each send
            self._sock.sendall(frame)
        except TimeoutError:
            raise StoreTimeout(
                f"the store at {self.endpoint} took no request in {seconds(deadline.seconds)}"
            ) from None
        except OSError as exc:
            raise StoreConnectionError(f"lost the store at {self.endpoint}: {exc}") from None

    def _receive(self, deadline: Deadline) -> tuple[int, list[bytes]]:
        assert self._sock is not None
        while True:
            if self._pending:
                return wire.decode_payload(self._pending.pop(0))
            try:
                self._sock.settimeout(deadline.timeout())
                data = self._sock.recv(1 << 16)
            except TimeoutError:
                raise StoreTimeout(
                    f"no complete reply from the store at {self.endpoint} "
                    f"within {seconds(deadline.seconds)}"
                ) from None
            except OSError as exc:
                raise StoreConnectionError(f"lost the store at {self.endpoint}: {exc}") from None
            if not data:
                raise StoreConnectionError(f"the store at {self.endpoint} closed the connection")
            self._pending.extend(self._reader.feed(data))

    def _call(self, op: int, fields: Sequence[bytes], wait: float = 0.0) -> list[bytes]:
        """One request and its reply; ``wait`` is how long the server may hold the reply."""
        if self._suspended:
            raise StoreConnectionError(f"the store at {self.endpoint} was lost; it may move")
        with self._lock:
            if self._sock is None:
                self._connect()
            deadline = Deadline(self.timeout + wait, self._clock)
            try:
                self._send(wire.encode(op, fields), deadline)
                code, reply = self._receive(deadline)
            except StoreError:
                self._drop()  # the reply may still come: this connection is out of step
                raise
        if code == wire.OK:
            return reply
        if code == wire.TIMEOUT:
            missing = ", ".join(k.decode(errors="replace") for k in reply)
            raise StoreTimeout(f"timed out waiting for keys: {missing}")
        if code == wire.ERROR:
            raise StoreError(reply[0].decode(errors="replace")[:1000] if reply else "store error")
        if code == wire.REDIRECT and len(reply) == 1:
            primary = reply[0].decode(errors="replace")[:300]
            raise StoreRedirect(f"the store at {self.endpoint} is a standby of {primary}", primary)
        if code == wire.FENCED:
            raise StoreFenced(
                f"the store at {self.endpoint} lost the job's majority: it serves nobody"
            )
        raise StoreProtocolError(f"the store at {self.endpoint} answered with status {code}")

    # -- the Store protocol ---------------------------------------------------------------------

    def get(self, key: str) -> Versioned:
        return _versioned(self._call(wire.GET, [key.encode()]))

    def get_many(self, keys: Sequence[str]) -> list[Versioned]:
        """The value and version of each of ``keys``, a request per ``wire.MAX_GETS`` keys
        (the lead of a round reads every member's record so). For small values: a reply must
        fit in one frame."""
        found: list[Versioned] = []
        for start in range(0, len(keys), wire.MAX_GETS):
            chunk = keys[start : start + wire.MAX_GETS]
            reply = _fields(self._call(wire.GETS, [k.encode() for k in chunk]), 3 * len(chunk))
            found += [_versioned(reply[at : at + 3]) for at in range(0, len(reply), 3)]
        return found

    def set(self, key: str, value: bytes) -> int:
        return wire.to_int(_fields(self._call(wire.SET, [key.encode(), value]), 1)[0])

    def compare_set(self, key: str, expected_version: int, value: bytes) -> CasResult:
        reply = self._call(wire.CAS, [key.encode(), wire.from_int(expected_version), value])
        return CasResult(_fields(reply, 4)[0] == b"1", _versioned(reply[1:]))

    def add(self, key: str, amount: int) -> int:
        reply = self._call(wire.ADD, [key.encode(), wire.from_int(amount)])
        return wire.to_int(_fields(reply, 1)[0])

    def delete(self, key: str) -> bool:
        return _fields(self._call(wire.DELETE, [key.encode()]), 1)[0] == b"1"

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

    def promote(self, voter: str, timeout: float) -> bool:
        """As ``voter``, ask a standby to take over from its primary (it does once a quorum of
        the voters it knows asked at once): whether it serves as the primary within
        ``timeout`` seconds (a primary says so at once)."""
        millis = wire.from_int(max(0, int(timeout * 1000)))
        try:
            self._call(wire.PROMOTE, [voter.encode(), millis], timeout)
        except StoreTimeout:
            return False
        return True

    def replicate(self, apply: Callable[[list[bytes]], None]) -> None:
        """Follow every change of this store, as a standby does: ``apply`` gets each record of
        the stream (``wire.RECORD_*``: a snapshot, its end, then each change) until the
        connection ends (``StoreConnectionError``), ``abort`` is called, or ``apply`` raises.
        The stream may be quiet for long: no deadline but the connection's."""
        with self._lock:
            if self._sock is None:
                self._connect()
            self._send(wire.encode(wire.REPLICATE, []), Deadline(self.timeout, self._clock))
            try:
                while True:
                    code, fields = self._receive(Deadline(_FOREVER, self._clock))
                    if code != wire.OK:
                        raise StoreProtocolError(f"{self.endpoint} will not be followed ({code})")
                    apply(fields)
            finally:
                self._drop()

    def abort(self) -> None:
        """End the connection under a call another thread runs (a ``replicate``, a watch)."""
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            self._drop()

    def __enter__(self) -> TcpStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
