"""The lighthouse relay against whoever reaches its port: loopback only, a connection cap (the
rest wait in the kernel's queue and are served once one closes), a deadline to reach the
lighthouse, bytes held bounded when a side does not read, and nothing forwarded without a
target, nor to a forged address in the store."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator

import pytest
from conftest import wait_until

from relaunch.agent.lighthouse_relay import CHUNK, LighthouseRelay
from relaunch.core.run.lighthouse import announcement
from relaunch.store.memory import MemoryStore

pytestmark = pytest.mark.timeout(60)


class Echo:
    """A loopback TCP server that echoes each connection, a thread each."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.target = ("127.0.0.1", int(self.sock.getsockname()[1]))
        self.accepted = 0
        self._threads: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._serve)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            thread = threading.Thread(target=self._echo, args=(conn,))
            self._threads.append(thread)
            thread.start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(CHUNK):
                    conn.sendall(data)
            except OSError:
                pass

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(10)
        for thread in self._threads:
            thread.join(10)


@pytest.fixture
def echo() -> Iterator[Echo]:
    server = Echo()
    yield server
    server.close()


def roundtrip(port: int, data: bytes = b"ping") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        got = b""
        while len(got) < len(data):
            chunk = sock.recv(CHUNK)
            if not chunk:
                break
            got += chunk
        return got


def aim(relay: LighthouseRelay, target: tuple[str, int]) -> None:
    """Set the relay's target and wait until its loop took it."""
    relay.set_target(target)
    wait_until(lambda: relay.target == target, 10, "the relay took its target")


def test_it_listens_on_loopback_only() -> None:
    relay = LighthouseRelay()
    with pytest.raises(ValueError, match="listens on loopback only"):
        relay.start("0.0.0.0")
    relay.loop.close()


def test_without_a_target_a_connection_is_closed_at_once(echo: Echo) -> None:
    relay = LighthouseRelay()
    port = relay.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            assert sock.recv(16) == b""
        aim(relay, echo.target)
        assert roundtrip(port) == b"ping"
        assert echo.accepted >= 1
    finally:
        relay.close()


def test_connections_over_the_cap_wait_and_are_served_once_one_closes(echo: Echo) -> None:
    relay = LighthouseRelay(max_connections=4)
    port = relay.start()
    aim(relay, echo.target)
    held = []
    try:
        assert roundtrip(port) == b"ping"
        for _ in range(4):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(b"x")
            assert sock.recv(1) == b"x"
            held.append(sock)
        late = socket.create_connection(("127.0.0.1", port), timeout=10)  # in the queue
        late.sendall(b"late")
        late.settimeout(0.3)
        with pytest.raises(TimeoutError):
            late.recv(4)  # not served while four are open
        assert relay.open_connections == 4
        held.pop().close()
        late.settimeout(10)
        assert late.recv(4) == b"late"
        late.close()
    finally:
        for sock in held:
            sock.close()
        relay.close()


def test_a_lighthouse_that_cannot_be_reached_in_time_is_given_up(echo: Echo) -> None:
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)  # never accepts: once its queue is full, a connect hangs
    fillers = []
    relay = LighthouseRelay(connect_timeout=0.5)
    try:
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(full.getsockname())
            fillers.append(filler)
        port = relay.start()
        aim(relay, full.getsockname())
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.settimeout(10)
            assert sock.recv(16) == b""  # closed at the deadline, not held
        wait_until(lambda: relay.open_connections == 0, 10, "the connection dropped")
        assert relay.relayed == 0
    finally:
        relay.close()
        for filler in fillers:
            filler.close()
        full.close()


def test_a_client_that_does_not_read_holds_a_bounded_amount(echo: Echo) -> None:
    relay = LighthouseRelay()
    port = relay.start()
    aim(relay, echo.target)
    try:
        assert roundtrip(port) == b"ping"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.setblocking(False)
            sent = 0
            blob = os.urandom(CHUNK)
            try:
                while sent < 256 * CHUNK:  # far more than the kernel buffers and the relay's
                    sent += sock.send(blob)
            except BlockingIOError:
                pass
            assert sent < 256 * CHUNK  # the relay stopped reading: the sender is pushed back
            assert roundtrip(port) == b"ping"  # others are served meanwhile
    finally:
        relay.close()


def test_a_large_exchange_arrives_whole_both_ways(echo: Echo) -> None:
    relay = LighthouseRelay()
    port = relay.start()
    aim(relay, echo.target)
    data = os.urandom(4_000_000)
    try:
        assert roundtrip(port) == b"ping"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sender = threading.Thread(target=sock.sendall, args=(data,))
            sender.start()
            got = bytearray()
            while len(got) < len(data):
                chunk = sock.recv(1 << 20)
                assert chunk
                got += chunk
            sender.join(10)
        assert bytes(got) == data
    finally:
        relay.close()


def test_a_forged_address_in_the_store_leaves_the_relay_without_a_target(
    echo: Echo, caplog: pytest.LogCaptureFixture
) -> None:
    store = MemoryStore()
    relay = LighthouseRelay()
    port = relay.start()
    relay.follow(store, "relaunch/job/lighthouse")
    try:
        store.set("relaunch/job/lighthouse", announcement(*echo.target))
        wait_until(lambda: relay.target == echo.target, 10, "the relay follows the store")
        assert roundtrip(port) == b"ping"
        store.set("relaunch/job/lighthouse", b"evil\nhost:1")
        wait_until(lambda: relay.target is None, 10, "the forged address dropped")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            assert sock.recv(16) == b""  # closed: forwarded nowhere
        said = [r.getMessage() for r in caplog.records if "lighthouse's address" in r.getMessage()]
        assert said == ["the lighthouse's address in the store is no HOST:PORT: 'evil\\nhost:1'"]
    finally:
        relay.close()
        store.close()
