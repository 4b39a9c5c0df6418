"""torch's store served by the agent (``store.torch_wire``) against hostile clients: its port
is open on every run now. A bad handshake, an unknown query, a field past a cap, a request too
slow, a second wait and a store over its bytes each close that connection only; a wait that
never ends and a full house of connections hold up nobody else.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from conftest import wait_until

import relaunch.store.torch_wire as torch_wire
import relaunch.store.torch_wire_shapes as wire
from relaunch.store.torch_wire import TorchWireServer, listen

pytestmark = pytest.mark.timeout(60)

HELLO = bytes([wire.VALIDATE]) + wire.nonce(wire.MAGIC)


@pytest.fixture
def server() -> Iterator[TorchWireServer]:
    listener, why = listen(0, "127.0.0.1")
    assert listener is not None, why
    served = TorchWireServer(listener, 4).start()
    try:
        yield served
    finally:
        served.stop()


def connect(server: TorchWireServer, hello: bytes = HELLO) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(hello)
    return sock


def ping(sock: socket.socket, nonce: int = 42) -> bytes:
    sock.sendall(bytes([wire.PING]) + wire.nonce(nonce))
    return receive(sock, 4)


def receive(sock: socket.socket, size: int) -> bytes:
    got = b""
    while len(got) < size:
        piece = sock.recv(size - len(got))
        if not piece:
            break
        got += piece
    return got


def closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (its read ends, or is reset)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def still_serves(server: TorchWireServer) -> None:
    with connect(server) as sock:
        assert ping(sock, 9) == wire.nonce(9)


@pytest.mark.parametrize(
    "sent",
    [
        pytest.param(bytes([wire.VALIDATE]) + wire.nonce(1), id="wrong-magic"),
        pytest.param(bytes([wire.PING]) + wire.nonce(1), id="no-validation-first"),
        pytest.param(b"GET / HTTP/1.1\r\n\r\n", id="http"),
        pytest.param(HELLO + bytes([200]), id="unknown-query"),
        pytest.param(HELLO + HELLO, id="second-validation"),
        pytest.param(HELLO + bytes([wire.SET]) + wire.int64(wire.MAX_KEY + 1), id="long-key"),
        pytest.param(
            HELLO + bytes([wire.SET]) + wire.blob(b"k") + wire.int64(wire.MAX_VALUE + 1),
            id="long-value",
        ),
        pytest.param(HELLO + bytes([wire.WAIT]) + wire.int64(wire.MAX_KEYS + 1), id="many-keys"),
        pytest.param(
            HELLO
            + bytes([wire.SET])
            + wire.blob(b"n")
            + wire.blob(b"x")
            + bytes([wire.ADD])
            + wire.blob(b"n")
            + wire.int64(1),
            id="add-to-no-number",
        ),
        pytest.param(
            HELLO
            + bytes([wire.WAIT])
            + wire.int64(1)
            + wire.blob(b"a")
            + bytes([wire.WAIT])
            + wire.int64(1)
            + wire.blob(b"b"),
            id="two-waits",
        ),
    ],
)
def test_a_bad_request_closes_its_connection_only(server: TorchWireServer, sent: bytes) -> None:
    """Closed as soon as it is seen: a cap's length closes before its bytes come; the server
    holds nothing of it after (but the key set before a bad ``ADD``)."""
    kept = 1 + 1 + torch_wire.ENTRY_COST if bytes([wire.ADD]) in sent else 0
    with connect(server) as good, connect(server, sent) as bad:
        assert ping(good) == wire.nonce(42)
        assert closed(bad)
        assert ping(good, 43) == wire.nonce(43)
    wait_until(lambda: server.held == kept, 10, "the closed connection's bytes to be let go")


def test_a_silent_or_slow_client_is_cut_off_at_its_deadline(
    server: TorchWireServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No handshake, or a request begun and never finished (a byte at a time would do the
    same): closed at the deadline, while an idle validated client is kept."""
    monkeypatch.setattr(torch_wire, "HANDSHAKE_TIMEOUT", 0.3)
    monkeypatch.setattr(torch_wire, "REQUEST_TIMEOUT", 0.3)
    silent, slow = connect(server, b""), connect(server, HELLO + bytes([wire.SET]))
    with silent, slow, connect(server) as idle:
        assert closed(silent)
        assert closed(slow)
        assert ping(idle) == wire.nonce(42)


def test_a_wait_that_never_ends_blocks_nobody(server: TorchWireServer) -> None:
    waiting = connect(server, HELLO + bytes([wire.WAIT]) + wire.int64(1) + wire.blob(b"never"))
    with waiting, connect(server) as other:
        wait_until(lambda: server.waiting == 1, 10, "the wait to be held")
        other.sendall(bytes([wire.SET]) + wire.blob(b"k") + wire.blob(b"v"))
        other.sendall(bytes([wire.GET]) + wire.blob(b"k"))
        assert receive(other, 9) == wire.blob(b"v")
        waiting.sendall(bytes([wire.CANCEL_WAIT]))
        assert receive(waiting, 1) == bytes([wire.WAIT_CANCELED])
        assert ping(waiting) == wire.nonce(42)
    wait_until(lambda: server.held == 1 + 1 + torch_wire.ENTRY_COST, 10, "the waits let go")


def test_the_bytes_held_are_capped(
    server: TorchWireServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A value that would take the store past ``MAX_HELD`` closes its connection; what was
    kept stays, and the store serves on."""
    monkeypatch.setattr(torch_wire, "MAX_HELD", 1 << 20)
    with connect(server) as sock:
        sock.sendall(bytes([wire.SET]) + wire.blob(b"small") + wire.blob(b"v"))
        sock.sendall(bytes([wire.SET]) + wire.blob(b"big") + wire.blob(b"x" * (2 << 20)))
        assert closed(sock)
    with connect(server) as sock:
        sock.sendall(bytes([wire.GET]) + wire.blob(b"small"))
        assert receive(sock, 9) == wire.blob(b"v")


def test_past_the_connection_cap_newcomers_wait_until_one_closes(
    server: TorchWireServer,
) -> None:
    """Four at most (the fixture's cap): a fifth waits in the kernel's queue, unanswered, and
    is served once one of the four closes."""
    held = [connect(server) for _ in range(4)]
    try:
        for sock in held:
            assert ping(sock) == wire.nonce(42)
        with connect(server) as fifth:
            fifth.settimeout(0.5)
            fifth.sendall(bytes([wire.PING]) + wire.nonce(5))
            with pytest.raises(TimeoutError):
                fifth.recv(4)
            held.pop().close()
            fifth.settimeout(10)
            assert receive(fifth, 4) == wire.nonce(5)
    finally:
        for sock in held:
            sock.close()
    still_serves(server)
