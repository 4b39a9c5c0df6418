"""The built-in store's server under attack: garbage, malformed frames, bad tokens, idle clients.

The contract: a malformed, truncated or oversized frame closes THAT connection and never the
server; a client without the right token is refused (and logged); the token never crosses the
wire; the server goes on serving well-behaved clients throughout. Every test talks to a real
``TcpStoreServer`` on 127.0.0.1, the attacker side over raw sockets.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

import relaunch.store.server as store_server
from relaunch.store import (
    MemoryStore,
    StoreAuthError,
    StoreError,
    StoreProtocolError,
    TcpStore,
    TcpStoreServer,
    wire,
)
from relaunch.store.frames import PRE_AUTH_LIMIT

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"
IO_TIMEOUT = 5.0  # the most any single read from the server may take
TOKEN = "fuzz-token-" + uuid.uuid4().hex
FUZZ = settings(max_examples=60, deadline=None)
HANDLED_OPS = (
    wire.GET,
    wire.SET,
    wire.CAS,
    wire.ADD,
    wire.DELETE,
    wire.WAIT,
    wire.WATCH,
    wire.PING,
    wire.PROMOTE,  # a primary answers at once
    wire.GETS,
)
Reply = tuple[int, list[bytes]]


# -- helpers ------------------------------------------------------------------------------------


def frame(payload: bytes) -> bytes:
    """``payload`` behind a correct length prefix, whatever it holds."""
    return struct.pack(">I", len(payload)) + payload


def raw_payload(code: int, fields: list[bytes], count: int | None = None) -> bytes:
    """A payload like ``wire.encode`` makes, but with any field count byte."""
    head = bytes((code, len(fields) if count is None else count))
    return head + b"".join(struct.pack(">I", len(f)) + f for f in fields)


class Raw:
    """An attacker's raw connection: connects, reads the server's HELLO, then sends anything."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection((HOST, port), timeout=IO_TIMEOUT)
        self.reader = wire.FrameReader()
        self.pending: list[bytes] = []
        try:
            hello = self.receive()
            assert hello is not None, "the server closed the connection instead of HELLO"
            code, self.hello = hello
            assert code == wire.HELLO and self.hello[0] == wire.PROTOCOL and len(self.hello) == 3
        except BaseException:
            self.sock.close()
            raise

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        """Send ``data``; a server that already hung up is fine (it is allowed to)."""
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.sock.sendall(data)

    def receive(self, timeout: float = IO_TIMEOUT) -> Reply | None:
        """The next frame from the server, or None once it closes the connection."""
        deadline = time.monotonic() + timeout
        while not self.pending:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"no frame and no EOF from the server within {timeout}s")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                pytest.fail(f"no frame and no EOF from the server within {timeout}s")
            except ConnectionResetError:
                return None
            if not data:
                return None
            self.pending += self.reader.feed(data)
        return wire.decode_payload(self.pending.pop(0))

    def receive_until_closed(self, timeout: float = IO_TIMEOUT) -> list[Reply]:
        """Every frame the server sends until it closes the connection (within ``timeout``)."""
        deadline = time.monotonic() + timeout
        replies = []
        while (reply := self.receive(max(0.001, deadline - time.monotonic()))) is not None:
            replies.append(reply)
        return replies

    def still_open(self, timeout: float = 0.05) -> bool:
        """Whether the server leaves the connection open (and silent) for ``timeout`` seconds."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(1 << 16)
        except TimeoutError:
            return True
        except ConnectionResetError:
            return False
        assert not data, f"unexpected bytes from the server: {data[:40]!r}"
        return False

    def authenticate(self, proof: bytes = b"") -> Reply | None:
        self.send(wire.encode(wire.AUTH, [proof, b"client-nonce"]))
        return self.receive()

    def request(self, code: int, fields: list[bytes]) -> Reply | None:
        self.send(wire.encode(code, fields))
        return self.receive()


def assert_serving(server: TcpStoreServer) -> None:
    """The server thread lives and a fresh, well-behaved client can set and get."""
    assert server._thread is not None and server._thread.is_alive(), "the server thread died"
    key, value = f"health/{uuid.uuid4().hex}", uuid.uuid4().bytes
    with TcpStore(HOST, server.port, token=server._token, timeout=IO_TIMEOUT) as client:
        version = client.set(key, value)
        assert client.get(key) == (value, version)
        assert client.delete(key)


@contextlib.contextmanager
def running_server(token: str | None = None) -> Iterator[TcpStoreServer]:
    server = TcpStoreServer(HOST, 0, token=token).start()
    try:
        yield server
    finally:
        server.stop()
        assert server._thread is not None and not server._thread.is_alive()


@pytest.fixture(scope="module", autouse=True)
def no_thread_left_behind() -> Iterator[None]:
    """Every server (and proxy) thread the module starts is gone once it is done."""
    before = set(threading.enumerate())
    yield
    left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert not left, f"threads left running: {left}"


@pytest.fixture(scope="module")
def server() -> Iterator[TcpStoreServer]:
    with running_server() as srv:
        yield srv
        # Every connection the attacks opened was closed by one side or the other: none leak.
        wait_until(lambda: not srv._clients, timeout=IO_TIMEOUT, what="all connections to close")


@pytest.fixture(scope="module")
def token_server() -> Iterator[TcpStoreServer]:
    with running_server(TOKEN) as srv:
        yield srv


# -- 1. garbage before (or instead of) authentication -------------------------------------------


def predict_unauthenticated(data: bytes) -> str:
    """What the server must do with ``data`` as a fresh client's first bytes."""
    if len(data) >= 4 and struct.unpack(">I", data[:4])[0] > PRE_AUTH_LIMIT:
        return "close"  # a frame larger than authenticating takes, announced before it
    try:
        payloads = wire.FrameReader().feed(data)
    except StoreProtocolError:
        return "close"  # a length prefix over MAX_FRAME
    if not payloads:
        return "wait"  # an incomplete frame: the server waits for the rest (or the deadline)
    try:
        code, fields = wire.decode_payload(payloads[0])
    except StoreProtocolError:
        return "close"
    return "auth" if code == wire.AUTH and len(fields) == 2 else "close"


garbage = st.one_of(
    st.binary(min_size=1, max_size=300),
    # A plausible length prefix (small, huge, or anything) then anything: complete frames too.
    st.builds(
        lambda size, rest: struct.pack(">I", size) + rest,
        st.one_of(
            st.integers(0, 64),
            st.integers(wire.MAX_FRAME + 1, 2**32 - 1),
            st.integers(0, 2**32 - 1),
        ),
        st.binary(max_size=80),
    ),
)


@FUZZ
@given(data=garbage)
def test_garbage_before_authentication_closes_that_connection(
    server: TcpStoreServer, data: bytes
) -> None:
    outcome = predict_unauthenticated(data)
    with Raw(server.port) as raw:
        raw.send(data)
        if outcome == "close":
            assert raw.receive_until_closed() == []
        elif outcome == "wait":
            assert raw.still_open()
        else:
            assert raw.receive() is not None  # random bytes that happen to make a valid AUTH
    assert_serving(server)


# -- 2. malformed requests after a correct handshake --------------------------------------------


@pytest.fixture
def raw(server: TcpStoreServer) -> Iterator[Raw]:
    with Raw(server.port) as conn:
        assert conn.hello[1] == b"0"
        assert conn.authenticate() == (wire.OK, [b""])
        yield conn
    assert_serving(server)


CLOSES = {
    # Malformed payloads behind a correct length prefix.
    "empty payload": frame(b""),
    "one-byte payload": frame(bytes((wire.PING,))),
    "count says 2, one field": frame(raw_payload(wire.GET, [b"k"], count=2)),
    "field length past the end": frame(bytes((wire.GET, 1)) + struct.pack(">I", 99) + b"k"),
    "trailing bytes": frame(raw_payload(wire.PING, []) + b"\x00"),
    "truncated field length": frame(bytes((wire.GET, 1, 0, 0))),
    # Oversized frames: only the length prefix is ever sent.
    "length MAX_FRAME + 1": struct.pack(">I", wire.MAX_FRAME + 1),
    "length 2**32 - 1": struct.pack(">I", 2**32 - 1),
    # Unknown operations (and the handshake's own, out of place).
    "op 0": wire.encode(0, [b"k"]),
    "op HELLO": wire.encode(wire.HELLO, [wire.PROTOCOL, b"0", b"n"]),
    "op AUTH again": wire.encode(wire.AUTH, [b"", b"n"]),
    "op 99": wire.encode(99, []),
    "op 255": wire.encode(255, [b"k", b"v"]),
    # Keys that are not UTF-8.
    "GET non-UTF-8 key": wire.encode(wire.GET, [b"\xff\xfe"]),
    "SET non-UTF-8 key": wire.encode(wire.SET, [b"\xc3(", b"v"]),
    "DELETE non-UTF-8 key": wire.encode(wire.DELETE, [b"\x80"]),
    "WAIT non-UTF-8 key": wire.encode(wire.WAIT, [b"10", b"ok", b"\xed\xa0\x80"]),
    # Integers that are not.
    "CAS version 'one'": wire.encode(wire.CAS, [b"k", b"one", b"v"]),
    "ADD amount 1.5": wire.encode(wire.ADD, [b"k", b"1.5"]),
    "ADD empty amount": wire.encode(wire.ADD, [b"k", b""]),
    "WAIT timeout 'soon'": wire.encode(wire.WAIT, [b"soon", b"k"]),
    "WATCH version 'v1'": wire.encode(wire.WATCH, [b"k", b"v1", b"10"]),
    "WATCH timeout 'ten'": wire.encode(wire.WATCH, [b"k", b"1", b"ten"]),
}

ERRORS = {
    # Too few (or, for GET, too many) fields for a known operation: an ERROR reply, and the
    # connection stays in step.
    "GET no key": wire.encode(wire.GET, []),
    "GET two keys": wire.encode(wire.GET, [b"k", b"j"]),
    "SET no value": wire.encode(wire.SET, [b"k"]),
    "SET nothing": wire.encode(wire.SET, []),
    "CAS no value": wire.encode(wire.CAS, [b"k", b"0"]),
    "ADD no amount": wire.encode(wire.ADD, [b"k"]),
    "DELETE nothing": wire.encode(wire.DELETE, []),
    "WAIT nothing": wire.encode(wire.WAIT, []),
    "WATCH key only": wire.encode(wire.WATCH, [b"k"]),
    "WATCH no timeout": wire.encode(wire.WATCH, [b"k", b"0"]),
}


@pytest.mark.parametrize("attack", list(CLOSES.values()), ids=list(CLOSES))
def test_a_malformed_request_closes_that_connection(raw: Raw, attack: bytes) -> None:
    raw.send(attack)
    assert raw.receive_until_closed() == []


@pytest.mark.parametrize("attack", list(ERRORS.values()), ids=list(ERRORS))
def test_a_request_with_missing_fields_gets_an_error(raw: Raw, attack: bytes) -> None:
    raw.send(attack)
    code, fields = raw.receive() or (None, [])
    assert code == wire.ERROR and len(fields) == 1
    assert raw.request(wire.PING, []) == (wire.OK, [])


def predict_authenticated(payload: bytes) -> str:
    try:
        code, _ = wire.decode_payload(payload)
    except StoreProtocolError:
        return "close"
    if code == wire.REPLICATE:
        return "stream"
    if code not in HANDLED_OPS:
        return "close"
    return "may park" if code in (wire.WAIT, wire.WATCH) else "reply or close"


field = st.one_of(
    st.binary(max_size=24),
    st.sampled_from([b"", b"0", b"1", b"-1", b"10", b" 7 ", b"1_0", b"9" * 30, b"\xff", b"k"]),
)
payloads = st.one_of(
    st.binary(max_size=200),
    st.builds(
        lambda code, fields, delta, tail: (
            raw_payload(code, fields, max(0, len(fields) + delta)) + tail
        ),
        st.one_of(st.sampled_from(HANDLED_OPS), st.integers(0, 255)),
        st.lists(field, max_size=5),
        st.sampled_from([0, 0, 0, -1, 1, 2]),
        st.sampled_from([b"", b"", b"", b"\x00", b"\x00\x00\x00\x09"]),
    ),
)


@FUZZ
@given(payload=payloads)
def test_random_payloads_get_a_reply_or_a_closed_connection(
    server: TcpStoreServer, payload: bytes
) -> None:
    outcome = predict_authenticated(payload)
    with Raw(server.port) as raw:
        assert raw.authenticate() == (wire.OK, [b""])
        if outcome == "may park":
            # WAIT and WATCH may legitimately hold their reply: hang up our side, and see at most
            # one reply before the server closes.
            raw.send(frame(payload))
            raw.sock.shutdown(socket.SHUT_WR)
            replies = raw.receive_until_closed()
            assert len(replies) <= 1
            assert all(code in (wire.OK, wire.ERROR, wire.TIMEOUT) for code, _ in replies)
        elif outcome == "stream":
            # A standby's stream: the snapshot's records; a request after it closes it.
            raw.send(frame(payload) + wire.encode(wire.PING, []))
            replies = raw.receive_until_closed()
            assert replies and all(code == wire.OK for code, _ in replies)
            assert replies[-1][1][0] == wire.RECORD_SYNCED
        else:
            # Pipeline a PING: the server closes the connection, or answers both, in order.
            raw.send(frame(payload) + wire.encode(wire.PING, []))
            reply = raw.receive()
            if reply is not None:
                assert outcome == "reply or close", f"{outcome}, yet a reply: {reply}"
                assert reply[0] in (wire.OK, wire.ERROR)
                assert raw.receive() == (wire.OK, [])
                assert raw.still_open()
    assert_serving(server)


@FUZZ
@given(
    request=st.tuples(st.sampled_from(HANDLED_OPS), st.lists(field, max_size=4)).map(
        lambda r: wire.encode(*r)
    ),
    cut=st.floats(0.0, 1.0, exclude_max=True),
)
def test_a_truncated_frame_then_hanging_up_leaves_the_server_serving(
    server: TcpStoreServer, request: bytes, cut: float
) -> None:
    with Raw(server.port) as raw:
        assert raw.authenticate() == (wire.OK, [b""])
        raw.send(request[: int(len(request) * cut)])
        assert raw.still_open(0.001)  # an incomplete frame is not an error: the server waits
    assert_serving(server)


def test_huge_or_far_away_wait_timeouts_do_not_kill_the_server(
    server: TcpStoreServer, raw: Raw
) -> None:
    # Regression: a timeout over ~24.8 days overflowed epoll's timeout, and one over ~1e308 ms
    # overflowed float division, both killing the server thread.
    for millis in (str(30 * 86400 * 1000).encode(), b"1" + b"0" * 400, b"-" + b"9" * 400):
        key = f"never/{uuid.uuid4().hex}"
        with Raw(server.port) as conn:
            assert conn.authenticate() == (wire.OK, [b""])
            conn.send(wire.encode(wire.WAIT, [millis, key.encode()]))
            if not millis.startswith(b"-"):
                wait_until(lambda k=key: k in server._waiters, IO_TIMEOUT, "the WAIT to park")
            assert raw.request(wire.PING, []) == (wire.OK, [])  # the loop went round again
            assert_serving(server)
            if millis.startswith(b"-"):
                assert conn.receive() == (wire.TIMEOUT, [key.encode()])


def test_a_value_too_big_for_a_reply_is_refused_not_a_crash(server: TcpStoreServer) -> None:
    # Regression: a SET frame of exactly MAX_FRAME used to be accepted although no reply could
    # carry the value back; a WATCH expiring on it raised out of the server's loop. Now the
    # store refuses such a value up front, and every value it keeps can be read back.
    key = "big"  # short: the reply's header is then longer than the request's
    with TcpStore(HOST, server.port, timeout=IO_TIMEOUT) as client:
        with pytest.raises(StoreError, match="exceeds the limit"):
            client.set(key, b"x" * (wire.MAX_FRAME - 10 - len(key.encode())))
        assert_serving(server)
        version = client.set(key, b"x" * wire.MAX_VALUE)
        assert client.get(key).version == version
        assert client.watch(key, version, 0.01).version == version
        client.delete(key)
    assert_serving(server)


# -- 3. a request while a WAIT or WATCH is parked on the same connection ------------------------


PARKED = {
    "wait": wire.encode(wire.WAIT, [b"60000", b"absent/wait"]),
    "watch": wire.encode(wire.WATCH, [b"absent/watch", b"0", b"60000"]),
}
FOLLOW_UPS = {
    "get": wire.encode(wire.GET, [b"absent/wait"]),
    "ping": wire.encode(wire.PING, []),
    "set": wire.encode(wire.SET, [b"absent/unrelated", b"v"]),
    "wait": wire.encode(wire.WAIT, [b"10", b"absent/other"]),
}


@pytest.mark.parametrize("parked", list(PARKED.values()), ids=list(PARKED))
@pytest.mark.parametrize("follow_up", list(FOLLOW_UPS.values()), ids=list(FOLLOW_UPS))
@pytest.mark.parametrize("together", [True, False], ids=["one-packet", "after-parking"])
def test_a_request_while_another_is_parked_closes_that_connection(
    server: TcpStoreServer, raw: Raw, parked: bytes, follow_up: bytes, together: bool
) -> None:
    if together:
        raw.send(parked + follow_up)
    else:
        raw.send(parked)
        wait_until(
            lambda: any(k.startswith("absent/") for k in list(server._waiters)),
            IO_TIMEOUT,
            "the request to park",
        )
        raw.send(follow_up)
    assert raw.receive_until_closed() == []
    # The parked waiter went with the connection (it is unparked before the socket closes).
    assert not any(k.startswith("absent/") for k in list(server._waiters))


def test_a_wait_on_the_same_key_twice_replies_once(server: TcpStoreServer, raw: Raw) -> None:
    # Regression: the waiter was parked twice on the key, and a change replied twice, putting
    # the connection out of step with its requests.
    key = f"twice/{uuid.uuid4().hex}"
    raw.send(wire.encode(wire.WAIT, [b"60000", key.encode(), key.encode()]))
    wait_until(lambda: key in server._waiters, timeout=IO_TIMEOUT, what="the WAIT to park")
    with TcpStore(HOST, server.port, timeout=IO_TIMEOUT) as client:
        version = client.set(key, b"v")
        assert raw.receive() == (wire.OK, [])
        assert raw.request(wire.GET, [key.encode()]) == (wire.OK, [b"1", b"v", b"%d" % version])
        client.delete(key)


# -- 4. tokens ----------------------------------------------------------------------------------


def test_a_wrong_or_missing_token_is_refused_and_logged(
    token_server: TcpStoreServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="relaunch.store.server")
    with pytest.raises(StoreAuthError):
        TcpStore(HOST, token_server.port, token="not-" + TOKEN, timeout=IO_TIMEOUT)
    assert any("refused" in r.getMessage() for r in caplog.records)
    with pytest.raises(StoreAuthError):
        TcpStore(HOST, token_server.port, timeout=IO_TIMEOUT)
    assert_serving(token_server)


@FUZZ
@given(proof=st.binary(max_size=40), client_nonce=st.binary(max_size=40))
def test_a_bad_proof_gets_an_error_then_eof(
    token_server: TcpStoreServer, proof: bytes, client_nonce: bytes
) -> None:
    with Raw(token_server.port) as raw:
        assert raw.hello[1] == b"1"
        raw.send(wire.encode(wire.AUTH, [proof, client_nonce]) + wire.encode(wire.PING, []))
        replies = raw.receive_until_closed()
    assert len(replies) == 1 and replies[0][0] == wire.ERROR
    assert_serving(token_server)


def test_requests_before_authenticating_to_a_token_server_close_the_connection(
    token_server: TcpStoreServer,
) -> None:
    for attack in (wire.encode(wire.GET, [b"k"]), wire.encode(wire.AUTH, [b"only one field"])):
        with Raw(token_server.port) as raw:
            raw.send(attack)
            assert raw.receive_until_closed() == []
    assert_serving(token_server)


class RecordingProxy:
    """Relays one connection between a client and ``upstream``, recording both directions."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server((HOST, 0))
        self.port = self.listener.getsockname()[1]
        self.recorded = bytearray()
        self.thread = threading.Thread(target=self._run, name="recording-proxy")
        self.thread.start()

    def _run(self) -> None:
        with self.listener:
            self.listener.settimeout(IO_TIMEOUT)
            downstream, _ = self.listener.accept()
        with downstream, socket.create_connection((HOST, self.upstream_port)) as upstream:
            peers = {downstream: upstream, upstream: downstream}
            with selectors.DefaultSelector() as selector:
                for sock in peers:
                    selector.register(sock, selectors.EVENT_READ)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    for key, _ in selector.select(1.0):
                        sock = key.fileobj
                        assert isinstance(sock, socket.socket)
                        try:
                            data = sock.recv(1 << 16)
                        except OSError:
                            data = b""
                        if not data:  # either side hung up: so does the proxy
                            return
                        self.recorded += data
                        peers[sock].sendall(data)

    def join(self) -> bytes:
        self.thread.join(IO_TIMEOUT)
        assert not self.thread.is_alive()
        return bytes(self.recorded)


def test_the_token_never_crosses_the_wire(token_server: TcpStoreServer) -> None:
    proxy = RecordingProxy(token_server.port)
    marker = b"marker-" + uuid.uuid4().hex.encode()
    try:
        with TcpStore(HOST, proxy.port, token=TOKEN, timeout=IO_TIMEOUT) as client:
            version = client.set("secret/key", marker)
            assert client.get("secret/key") == (marker, version)
            assert client.compare_set("secret/key", version, b"next").succeeded
            assert client.delete("secret/key")
    finally:
        recorded = proxy.join()
    assert marker in recorded  # the proxy did see the conversation ...
    assert TOKEN.encode() not in recorded  # ... and never the token
    assert TOKEN.encode().hex().encode() not in recorded


def test_a_client_with_a_token_refuses_a_server_without_one(server: TcpStoreServer) -> None:
    with pytest.raises(StoreAuthError):
        TcpStore(HOST, server.port, token=TOKEN, timeout=IO_TIMEOUT)
    assert_serving(server)


# -- 5. the handshake deadline ------------------------------------------------------------------


@pytest.fixture
def impatient_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[TcpStoreServer]:
    monkeypatch.setattr(store_server, "HANDSHAKE_TIMEOUT", 0.3)
    with running_server() as srv:
        yield srv


def test_a_client_that_never_authenticates_is_closed_after_the_deadline(
    impatient_server: TcpStoreServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="relaunch.store.server")
    port = impatient_server.port
    with Raw(port) as ok:
        assert ok.authenticate() == (wire.OK, [b""])
        started = time.monotonic()
        with Raw(port) as idle, Raw(port) as partial:
            partial.send(wire.encode(wire.AUTH, [b"", b"nonce"])[:-3])  # never completed
            assert idle.receive_until_closed() == []
            assert partial.receive_until_closed() == []
        assert time.monotonic() - started >= 0.29
        # The deadline has passed, and the client that authenticated in time is still served.
        assert ok.request(wire.PING, []) == (wire.OK, [])
    # The first is logged in full, the second is left to the summary at the interval's end.
    assert sum("no authentication within" in r.getMessage() for r in caplog.records) == 1
    assert impatient_server.refused == 2
    assert_serving(impatient_server)


# -- 6. the TCP store behaves exactly like the in-memory one ------------------------------------

keys = st.sampled_from(["a", "b", "c/d", "ключ"])
values = st.one_of(
    st.binary(max_size=6), st.integers(-100, 100).map(lambda i: str(i).encode()), st.just(b"x")
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("set"), keys, values),
        st.tuples(st.just("add"), keys, st.integers(-(10**12), 10**12)),
        st.tuples(st.just("compare_set"), keys, st.integers(0, 12), values),
        st.tuples(st.just("cas_current"), keys, values),
        st.tuples(st.just("delete"), keys),
        st.tuples(st.just("get"), keys),
        st.tuples(st.just("wait"), st.lists(keys, max_size=3)),
        st.tuples(st.just("watch"), keys, st.integers(0, 12)),
    ),
    max_size=30,
)


def apply(store: Any, reference: MemoryStore, op: tuple[Any, ...]) -> tuple[str, object]:
    """Run ``op`` on ``store``: its result, or the type of the StoreError it raised."""
    name, *args = op
    try:
        if name == "cas_current":  # compare_set against the version the reference holds now
            key, value = args
            return "ok", store.compare_set(key, reference.get(key).version, value)
        if name == "wait":
            return "ok", store.wait(args[0], 0.0)
        if name == "watch":
            return "ok", store.watch(*args, 0.0)
        return "ok", getattr(store, name)(*args)
    except StoreError as exc:
        return "error", type(exc)


@settings(max_examples=80, deadline=None)
@given(ops=operations)
def test_the_tcp_store_matches_the_memory_store_step_by_step(ops: list[tuple[Any, ...]]) -> None:
    reference = MemoryStore()
    with running_server() as server, TcpStore(HOST, server.port, timeout=IO_TIMEOUT) as client:
        for step, op in enumerate(ops):
            over_tcp = apply(client, reference, op)  # first: "cas_current" reads the reference
            in_memory = apply(reference, reference, op)
            assert over_tcp == in_memory, f"step {step}: {op}"
        for key in ("a", "b", "c/d", "ключ"):
            assert client.get(key) == reference.get(key)
