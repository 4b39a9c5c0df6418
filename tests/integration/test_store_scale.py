"""The built-in store holds its connections: 4,096 clients at once, the open-file limit (raised
when it can be, the listener resting when out of descriptors), a flood and a slow reader.

Every server here is ``relaunch store`` in a subprocess, so that its descriptors, CPU and memory
are its own and can be read from /proc.
"""

from __future__ import annotations

import contextlib
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import LeakCheck, wait_until

from relaunch.runtime import raise_open_file_limit
from relaunch.store import StoreTimeout, TcpStore, wire
from relaunch.store.server import OUT_HIGH_WATER, TcpStoreServer

HOST = "127.0.0.1"
IO_TIMEOUT = 10.0
Reply = tuple[int, list[bytes]]


# -- helpers ------------------------------------------------------------------------------------


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    stderr_path: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        with open(self.stderr_path, errors="replace") as file:
            return file.read()

    def cpu_seconds(self) -> float:
        """User + system CPU the server has used so far."""
        with open(f"/proc/{self.pid}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss(self) -> int:
        """The server's resident memory, in bytes."""
        with open(f"/proc/{self.pid}/status") as file:
            for line in file:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def descriptors(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def soft_nofile(self) -> int:
        return resource.prlimit(self.pid, resource.RLIMIT_NOFILE)[0]


@contextlib.contextmanager
def store_server(
    leaks: LeakCheck, tmp_path: Path, nofile: tuple[int, int] | None = None, token: str = ""
) -> Iterator[Server]:
    """``relaunch store --port 0`` in a subprocess (started with RLIMIT_NOFILE ``nofile``, with
    ``token`` if one is given); SIGTERMed at the end, which it must survive to exit 0."""

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

    stderr_path = os.path.join(tmp_path, "store.stderr")
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "relaunch", "store", "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=err,
            env=leaks.process_env(LOGLEVEL="INFO", RELAUNCH_RDZV_TOKEN=token),
            preexec_fn=limit,
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        if not line.startswith("relaunch store: serving on"):
            pytest.fail(f"the store did not start: {line}{Server(proc, 0, stderr_path).stderr()}")
        yield Server(proc, int(line.rsplit(":", 1)[1]), stderr_path)
        assert proc.poll() is None, "the server died"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()  # by pid: only the process this test started
            proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]


class Raw:
    """A connection speaking the wire format by hand: for what TcpStore will not do (pipeline
    requests, never read, park without blocking a thread)."""

    def __init__(self, port: int, rcvbuf: int | None = None, sndbuf: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:  # before connecting: the window is agreed then
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        if sndbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        self.sock.settimeout(IO_TIMEOUT)
        self.sock.connect((HOST, port))
        self.reader = wire.FrameReader()
        self.pending: list[bytes] = []

    def handshake(self) -> None:
        code, hello = self.receive()
        assert code == wire.HELLO and hello[0] == wire.PROTOCOL
        self.sock.sendall(wire.encode(wire.AUTH, [b"", b"raw-nonce"]))
        assert self.receive() == (wire.OK, [b""])

    def receive(self, timeout: float = IO_TIMEOUT) -> Reply:
        """The next reply frame (fails the test on EOF or after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while not self.pending:
            self.sock.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                pytest.fail(f"no reply from the store within {timeout}s")
            assert data, "the store closed the connection"
            self.pending += self.reader.feed(data)
        return wire.decode_payload(self.pending.pop(0))

    def has_data(self) -> bool:
        """Whether a reply (or EOF) is waiting to be read, without waiting."""
        with selectors.DefaultSelector() as selector:
            selector.register(self.sock, selectors.EVENT_READ)
            return bool(self.pending or selector.select(0))

    def close(self) -> None:
        self.sock.close()


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[max(0, int(len(ordered) * 0.99 + 0.999999) - 1)]


def round_trips(store: TcpStore, count: int, key: str) -> list[float]:
    """Seconds per set + get round trip pair, ``count`` times, checking every answer."""
    latencies = []
    for i in range(count):
        started = time.perf_counter()
        version = store.set(key, b"%d" % i)
        assert store.get(key) == (b"%d" % i, version)
        latencies.append(time.perf_counter() - started)
    return latencies


# -- the open-file limit ------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_server_raises_a_low_soft_open_file_limit_to_the_hard_limit(
    leaks: LeakCheck, tmp_path: Path
) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 4096 + 512:
        pytest.skip(f"the hard open-file limit ({hard}) cannot hold 4,096 clients anyway")
    with store_server(leaks, tmp_path, nofile=(256, hard)) as server:
        assert server.soft_nofile() == hard
    assert "open-file limit" not in server.stderr()


LOW_LIMIT = 40  # descriptors: the server's own few, then ~30 clients
TOKEN = "scale-token"


@pytest.mark.timeout(60)
def test_out_of_descriptors_the_server_rests_serves_its_clients_and_accepts_again(
    leaks: LeakCheck, tmp_path: Path
) -> None:
    # With a token: a store without one holds only a share of its descriptors (the test of
    # that is tests/hostile/test_store_descriptors.py), so it never runs out.
    with store_server(leaks, tmp_path, nofile=(LOW_LIMIT, LOW_LIMIT), token=TOKEN) as server:
        # One clear warning at start: how many fit, how many may come, what to do.
        warning = [line for line in server.stderr().splitlines() if "open-file limit" in line]
        assert len(warning) == 1 and "room for about" in warning[0]
        assert "up to 4096 may come" in warning[0] and "ulimit -n" in warning[0]
        assert "LimitNOFILE" in warning[0]

        held: list[TcpStore] = []
        pending: socket.socket | None = None
        try:
            while server.descriptors() < LOW_LIMIT:
                held.append(TcpStore(HOST, server.port, TOKEN, timeout=IO_TIMEOUT))
                assert len(held) < LOW_LIMIT, "more clients than the limit allows"
            assert len(held) > LOW_LIMIT // 2

            # Saturated: a new client is queued by the kernel, but gets no HELLO ...
            pending = socket.create_connection((HOST, server.port), timeout=IO_TIMEOUT)
            wait_until(
                lambda: "cannot accept more connections" in server.stderr(),
                what="the server to notice it is out of descriptors",
            )
            cpu_before = server.cpu_seconds()
            pending.settimeout(1.0)
            with pytest.raises(TimeoutError):
                pending.recv(1)  # ... for a whole second, during which the server idles
            cpu = server.cpu_seconds() - cpu_before
            assert cpu < 0.3, f"the saturated server burnt {cpu:.2f} s of CPU in 1 s"

            # The clients it holds are served all along.
            for i, store in enumerate(held):
                store.set(f"held/{i}", b"%d" % i)
            for i, store in enumerate(held):
                j = (i + 1) % len(held)
                assert store.get(f"held/{j}").value == b"%d" % j

            # A connection closes: the queued client is taken at once.
            held.pop().close()
            pending.settimeout(IO_TIMEOUT)
            reader = wire.FrameReader()
            frames: list[bytes] = []
            while not frames:
                data = pending.recv(1 << 16)
                assert data, "the server closed the queued connection"
                frames = reader.feed(data)
            code, hello = wire.decode_payload(frames[0])
            assert code == wire.HELLO and hello[0] == wire.PROTOCOL
            pending.close()
            pending = None
            # Its descriptor comes back once the server sees it gone: a full client fits.
            wait_until(lambda: server.descriptors() < LOW_LIMIT, what="a free descriptor")
            with TcpStore(HOST, server.port, TOKEN, timeout=IO_TIMEOUT) as late:
                late.set("late", b"1")
                assert held[0].get("late").value == b"1"
        finally:
            for store in held:
                store.close()
            if pending is not None:
                pending.close()
    episodes = server.stderr().count("cannot accept more connections")
    assert episodes == 1, f"logged {episodes} times for one episode:\n{server.stderr()}"
    assert "accepting connections again" in server.stderr()


# -- a flood and a slow reader ------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_a_flood_of_pipelined_large_sets_does_not_stall_other_clients(
    leaks: LeakCheck, tmp_path: Path
) -> None:
    value = b"f" * (256 * 1024)
    batch = b"".join(wire.encode(wire.SET, [b"flood/%d" % i, value]) for i in range(16))
    stop = threading.Event()
    replies = [0]

    with store_server(leaks, tmp_path) as server:
        flooder = Raw(server.port)
        flooder.handshake()

        def send() -> None:
            with contextlib.suppress(OSError):
                while not stop.is_set():
                    flooder.sock.sendall(batch)  # as fast as the server takes them

        def drain() -> None:
            reader = wire.FrameReader()
            with contextlib.suppress(OSError):
                while data := flooder.sock.recv(1 << 16):
                    replies[0] += len(reader.feed(data))

        flooder.sock.settimeout(None)
        threads = [threading.Thread(target=f, daemon=True) for f in (send, drain)]
        for thread in threads:
            thread.start()
        try:
            wait_until(lambda: replies[0] >= 64, what="the flood to get going")
            with TcpStore(HOST, server.port, timeout=IO_TIMEOUT) as other:
                latencies = round_trips(other, 300, "other")
            flooded = replies[0]
        finally:
            stop.set()
            flooder.sock.shutdown(socket.SHUT_RDWR)
            for thread in threads:
                thread.join(timeout=IO_TIMEOUT)
            flooder.close()
        assert not any(thread.is_alive() for thread in threads)
    worst = p99(latencies)
    assert flooded >= 128, f"the flood hardly ran ({flooded} SETs answered)"
    assert worst < 0.5, f"p99 round trip {worst * 1000:.0f} ms during the flood"


@pytest.mark.timeout(90)
def test_a_client_that_never_reads_is_paused_not_buffered_and_others_are_served(
    leaks: LeakCheck, tmp_path: Path
) -> None:
    big = b"b" * (64 * 1024)
    gets = 4 * OUT_HIGH_WATER // len(big)  # replies worth 4x the cap on unsent bytes
    pad = wire.encode(wire.SET, [b"pad", big])
    with (
        store_server(leaks, tmp_path) as server,
        TcpStore(HOST, server.port, timeout=IO_TIMEOUT) as other,
    ):
        other.set("big", big)
        rss_before = server.rss()
        slow = Raw(server.port, rcvbuf=4096, sndbuf=16384)
        try:
            slow.handshake()
            slow.sock.setblocking(False)
            # GETs whose replies the client never reads, then large SETs: the server must
            # stop reading it, which the client sees as its sends blocking.
            stream = [wire.encode(wire.GET, [b"big"])] * gets
            sent_frames, blocked, total = 0, False, 0
            partial = b""
            with selectors.DefaultSelector() as selector:
                selector.register(slow.sock, selectors.EVENT_WRITE)
                while not blocked and total < 64 * 1024 * 1024:
                    frame = stream[sent_frames] if sent_frames < len(stream) else pad
                    view = memoryview(frame)
                    while view and not blocked:
                        try:
                            count = slow.sock.send(view)
                            view, total = view[count:], total + count
                        except BlockingIOError:
                            blocked = not selector.select(timeout=2.0)
                    partial = bytes(view)
                    sent_frames += 1
            assert blocked, f"the server read all {total} bytes of a client that reads none"

            # Bounded: the cap plus a reply or so, not the 4 MiB of GET replies and more.
            grown = server.rss() - rss_before
            assert grown < 16 * 1024 * 1024, f"server RSS grew {grown / 2**20:.1f} MiB"
            # The others are served meanwhile.
            assert p99(round_trips(other, 100, "other")) < 0.5

            # The slow client reads at last: every request gets its reply, in order.
            slow.sock.setblocking(True)
            received: list[Reply] = []

            def read_all() -> None:
                while len(received) < sent_frames:
                    received.append(slow.receive(timeout=30))

            reader = threading.Thread(target=read_all, daemon=True)
            reader.start()
            slow.sock.sendall(partial)  # the rest of the frame cut short
            reader.join(timeout=60)
            assert not reader.is_alive(), f"{len(received)} of {sent_frames} replies came"
        finally:
            slow.close()
    assert len(received) == sent_frames
    assert all(code == wire.OK for code, _ in received)
    assert all(fields[1] == big for _, fields in received[:gets])
    assert all(len(fields) == 1 for _, fields in received[gets:])


# -- 4,096 clients at once ----------------------------------------------------------------------

CLIENTS = 4096
WATCHERS = 128


@pytest.mark.timeout(180)
def test_4096_clients_at_once_each_set_and_get_and_parked_watchers_wake(
    leaks: LeakCheck, tmp_path: Path
) -> None:
    needed = CLIENTS + WATCHERS + 512
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"the hard open-file limit ({hard}) is below the {needed} this test needs")
    raise_open_file_limit(needed)
    clients: list[TcpStore] = []
    watchers: list[Raw] = []
    with store_server(leaks, tmp_path) as server:
        try:
            started = time.monotonic()
            for _ in range(CLIENTS):
                clients.append(TcpStore(HOST, server.port, timeout=30))
            connected = time.monotonic()
            for i, store in enumerate(clients):
                store.set(f"k/{i}", b"%d" % i)
            for i, store in enumerate(clients):
                j = (i + 1) % CLIENTS
                assert store.get(f"k/{j}").value == b"%d" % j
            answered = time.monotonic()
            assert server.descriptors() >= CLIENTS

            # Parked watchers, woken by one set.
            version = clients[0].set("topic", b"before")
            for _ in range(WATCHERS):
                watcher = Raw(server.port)
                watchers.append(watcher)
                watcher.handshake()
                watcher.sock.sendall(wire.encode(wire.WATCH, [b"topic", b"%d" % version, b"60000"]))
            assert not any(w.has_data() for w in watchers), "a watcher returned unchanged"
            new_version = clients[-1].set("topic", b"after")
            for watcher in watchers:
                assert watcher.receive() == (wire.OK, [b"1", b"after", b"%d" % new_version])
        finally:
            for store in clients:
                store.close()
            for watcher in watchers:
                watcher.close()
        wait_until(lambda: server.descriptors() < 64, what="the server to close every connection")
        with TcpStore(HOST, server.port, timeout=IO_TIMEOUT) as last:
            assert last.get("k/0").value == b"0"
    print(
        f"\n{CLIENTS} clients: connected in {connected - started:.2f} s, "
        f"set + get in {answered - connected:.2f} s"
    )


# -- the deadline heap --------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_deadlines_of_woken_watchers_do_not_pile_up_and_expiry_still_works() -> None:
    """A watcher woken again and again leaves a dead heap entry each time (lazy deletion):
    they are swept, so the heap stays O(clients); a parked wait still times out on time."""
    server = TcpStoreServer(HOST, 0, expected_clients=16).start()
    watcher, parked = Raw(server.port), Raw(server.port)
    try:
        with TcpStore(HOST, server.port, timeout=IO_TIMEOUT) as setter:
            watcher.handshake()
            parked.handshake()
            # A live entry due before the watches' keeps them from leaving by the heap's top.
            parked.sock.sendall(wire.encode(wire.WAIT, [b"3000000", b"never/parked"]))
            version = setter.set("w", b"0")
            for i in range(1, 400):
                watcher.sock.sendall(wire.encode(wire.WATCH, [b"w", b"%d" % version, b"3600000"]))
                # Parked before the change (not by luck of thread scheduling): each leaves an entry.
                wait_until(lambda: "w" in server._waiters, IO_TIMEOUT, "the watch to park")
                version = setter.set("w", b"%d" % i)
                assert watcher.receive() == (wire.OK, [b"1", b"%d" % i, b"%d" % version])
            scheduled = next(server._sequence)  # deadlines ever pushed: most watches parked
            assert scheduled > 399
            assert len(server._deadlines) <= 2 * len(server._clients) + 64
            started = time.monotonic()
            with pytest.raises(StoreTimeout, match="never"):
                setter.wait(["never"], timeout=0.2)
            assert 0.15 < time.monotonic() - started < 5
            assert not parked.has_data()
    finally:
        watcher.close()
        parked.close()
        server.stop()
