"""The one selector-thread helper every server runs on: sockets, timers, wake-ups, the accept
loop's cap and its back-off out of descriptors, and a failure reported, never silent."""

from __future__ import annotations

import errno
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from relaunch import runtime
from relaunch.server_loop import Listener, ServerLoop

pytestmark = pytest.mark.timeout(30)


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true in time"
        time.sleep(0.005)


@pytest.fixture
def loop() -> Iterator[ServerLoop]:
    served = ServerLoop()
    served.start("test-loop")
    yield served
    served.stop(10)
    served.close()
    assert served.thread is not None and not served.thread.is_alive()


def listening() -> socket.socket:
    sock = socket.create_server(("127.0.0.1", 0))
    return sock


def test_timers_run_in_order_and_a_cancelled_one_never() -> None:
    loop = ServerLoop()
    ran: list[str] = []
    now = loop.clock.monotonic()
    loop.call_at(now + 0.02, lambda: ran.append("second"))
    loop.call_at(now + 0.01, lambda: ran.append("first"))
    loop.call_at(now + 0.015, lambda: ran.append("never")).cancel()
    loop.call_at(now + 0.03, lambda: setattr(loop, "stopping", True))
    loop.run()
    assert ran == ["first", "second"]
    loop.close()


def test_the_heap_keeps_no_more_than_twice_the_live_timers() -> None:
    loop = ServerLoop()
    for _ in range(1000):
        loop.call_later(60, lambda: None).cancel()
        loop.call_at(loop.clock.monotonic() + 60, lambda: None, live=1).cancel()
    assert len(loop.timers) <= 2 * 1 + 64 + 1
    loop.close()


def test_a_wake_from_another_thread_runs_on_wake_on_the_loop(loop: ServerLoop) -> None:
    seen: list[threading.Thread] = []
    loop.on_wake = lambda: seen.append(threading.current_thread())
    loop.wake()
    wait_for(lambda: bool(seen))
    assert seen[0] is loop.thread


def test_a_listener_accepts_and_a_handler_serves(loop: ServerLoop) -> None:
    server = listening()
    got: list[bytes] = []

    def accept(sock: socket.socket, address: object) -> None:
        sock.setblocking(False)

        def read(mask: int) -> None:
            data = sock.recv(100)
            if data:
                got.append(data)
                sock.send(data.upper())
            else:
                loop.unregister(sock)
                sock.close()

        loop.register(sock, selectors.EVENT_READ, read)

    loop.call_soon(lambda: Listener(loop, server, accept))
    with socket.create_connection(server.getsockname(), timeout=5) as client:
        client.sendall(b"hello")
        assert client.recv(5) == b"HELLO"
    wait_for(lambda: got == [b"hello"])
    loop.call_soon(server.close)


def test_the_cap_rests_the_listener_until_resumed(loop: ServerLoop) -> None:
    server = listening()
    taken: list[socket.socket] = []
    closed: list[socket.socket] = []
    holder: list[Listener] = []

    def admit(now: float) -> bool:
        if len(taken) >= 2:
            holder[0].rest(None)
            return False
        return True

    loop.call_soon(
        lambda: holder.append(Listener(loop, server, lambda s, a: taken.append(s), admit=admit))
    )
    clients = [socket.create_connection(server.getsockname(), timeout=5) for _ in range(4)]
    wait_for(lambda: len(taken) == 2 and not holder[0].accepting)
    time.sleep(0.1)  # the two others wait in the kernel's queue (asserted below, not synced)
    assert len(taken) == 2

    def close_one() -> None:
        closed.append(taken.pop())
        closed[-1].close()
        holder[0].resume()

    loop.call_soon(close_one)
    wait_for(lambda: len(closed) == 1 and len(taken) == 2 and not holder[0].accepting)
    for sock in [*clients, *taken]:
        sock.close()
    loop.call_soon(server.close)


class _Exhausted:
    """A listening socket whose accept fails with EMFILE ``failures`` times."""

    def __init__(self, sock: socket.socket, failures: int) -> None:
        self.sock, self.failures = sock, failures

    def __getattr__(self, name: str) -> object:
        return getattr(self.sock, name)

    def accept(self) -> tuple[socket.socket, object]:
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self.sock.accept()


def test_out_of_descriptors_the_listener_rests_and_goes_on(loop: ServerLoop) -> None:
    server = listening()
    exhausted = _Exhausted(server, 3)
    taken: list[socket.socket] = []
    shortages: list[OSError] = []
    recovered: list[bool] = []
    made = threading.Event()

    def make() -> None:
        Listener(
            loop, exhausted, lambda s, a: taken.append(s), backoff=0.05,  # type: ignore[arg-type]
            short=shortages.append, recovered=lambda: recovered.append(True),
        )  # fmt: skip
        made.set()

    loop.call_soon(make)
    assert made.wait(5)
    client = socket.create_connection(server.getsockname(), timeout=5)
    wait_for(lambda: len(taken) == 1)
    wait_for(lambda: bool(recovered))
    assert len(shortages) == 1 and shortages[0].errno == errno.EMFILE  # said once an episode
    assert exhausted.failures == 0
    client.close()
    taken[0].close()
    loop.call_soon(server.close)


def test_a_failing_handler_is_a_reported_thread_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    failures: list[tuple[str, BaseException]] = []
    monkeypatch.setattr(
        runtime, "report_failure", lambda name, error: failures.append((name, error))
    )
    loop = ServerLoop()
    loop.call_soon(lambda: 1 / 0)
    thread = loop.start("test-failing-loop")
    thread.join(10)
    assert not thread.is_alive()
    assert [(name, type(error)) for name, error in failures] == [
        ("test-failing-loop", ZeroDivisionError)
    ]
    loop.close()
