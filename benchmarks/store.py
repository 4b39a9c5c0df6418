"""The built-in store under many connections: memory per idle connection, 4,096 clients, floods.

Run by hand: ``python -m benchmarks store [--quick]``. The server is ``relaunch store`` in a
subprocess (its RSS and CPU read from /proc); the clients are ``--procs`` client processes
(``python -c`` running ``clients_main`` below), each holding its share of the connections and
raising its own open-file limit. Measured, each on a fresh server:

- **memory per idle connection**: the server's RSS after N authenticated idle connections
  minus its RSS before (after one warm-up client), divided by N, for each of ``--sizes``;
- **connect + one request**: from "go" to the last of ``--clients`` TcpStore clients having
  connected, authenticated and answered one ``get`` (wall time), and the server's CPU for it;
- with those connections held: the p99 ``get`` round trip of one more client (``--samples``
  requests), idle; with every held connection parked in a ``watch`` (the p99 again, then the
  time until one ``set`` has woken them all); and while one client floods the store with
  pipelined 256 KiB ``set`` requests as fast as the server takes them.

Budgets: see ``BUDGETS``; benchmarks/README.md says why. Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from benchmarks import harness
from benchmarks.harness import BenchError, Check, fmt, log, percentile

LAUNCHERS = False
QUICK = {"sizes": [1024], "clients": 1024, "samples": 300}
HOST = "127.0.0.1"
START_TIMEOUT_S = 30.0
STEP_TIMEOUT_S = 120.0  # the most any one step of the clients may take
#: Settling time after the watches are sent, before latencies are taken with them parked.
PARK_SETTLE_S = 0.5
FLOOD_VALUE = 256 * 1024
#: The 4 KiB per idle connection: a 4,096-node job opens 12,288 connections to the agent that
#: hosts the store, so <= 48 MiB there (the figure is ~0.9 KiB: room for allocator noise).
#: Socket buffers are kernel memory, outside the RSS. The latencies fail the server before
#: this one (its loop scanned every client and waiter each turn: 8.6 ms p99 with 4,096
#: parked watchers).
BUDGETS = {
    "bytes per idle connection": 4096,
    "connect + request s": 5.0,  # per 4,096 clients (scaled with --clients)
    "server CPU s": 2.0,  # per 4,096 clients
    "p99 ms": 5.0,  # others idle, or 4,096 watches parked
    "flood p99 ms": 10.0,
    "wake s": 0.5,
}


# -- the client processes -----------------------------------------------------------------------


def clients_main(argv: Sequence[str]) -> int:
    """A client process: ``PORT COUNT``, then commands on stdin, one answer line each.

    ``connect [get]``: open COUNT TcpStore connections (each doing one ``get``) -> ``done S``;
    ``watch V``: park a watch of ``bench/topic`` at version V on each -> ``parked``, then
    ``woken`` once every watch has its reply; ``flood``: pipeline 256 KiB sets on the first
    connection as fast as the server takes them -> ``flooding`` once under way; ``stop`` ->
    ``flooded N``; ``close`` -> ``closed``.
    """
    from relaunch.runtime import raise_open_file_limit
    from relaunch.store import TcpStore, wire

    port, count = int(argv[0]), int(argv[1])
    raise_open_file_limit(count + 256)
    stores: list[TcpStore] = []
    flood: Flood | None = None

    def answer(line: str) -> None:
        print(line, flush=True)

    answer("ready")
    for line in sys.stdin:
        command = line.split()
        if command[0] == "connect":
            started = time.perf_counter()
            for _ in range(count):
                store = TcpStore(HOST, port, timeout=STEP_TIMEOUT_S)
                stores.append(store)
                if "get" in command:
                    store.get("bench/key")
            answer(f"done {time.perf_counter() - started:.6f}")
        elif command[0] == "watch":
            # A raw WATCH on each connection's socket: a TcpStore would block a thread each.
            request = wire.encode(wire.WATCH, [b"bench/topic", command[1].encode(), b"600000"])
            socks = [store._sock for store in stores if store._sock is not None]
            for sock in socks:
                sock.sendall(request)
            answer("parked")
            for sock in socks:
                reader, frames = wire.FrameReader(), list[bytes]()
                sock.settimeout(STEP_TIMEOUT_S)
                while not frames:
                    data = sock.recv(1 << 16)
                    if not data:
                        raise SystemExit("the store closed a watching connection")
                    frames = reader.feed(data)
                if wire.decode_payload(frames[0])[0] != wire.OK:
                    raise SystemExit("a watch failed")
            answer("woken")
        elif command[0] == "flood":
            flood = Flood(stores[0]._sock)  # type: ignore[arg-type]
            flood.start()
            flood.wait_started()
            answer("flooding")
        elif command[0] == "stop" and flood is not None:
            answer(f"flooded {flood.stop()}")
        elif command[0] == "close":
            for store in stores:
                store.close()
            stores.clear()
            answer("closed")
    return 0


class Flood:
    """Pipelined 256 KiB sets on ``sock`` as fast as the server takes them; replies drained."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.replies = 0
        self._stopping = threading.Event()
        self._started = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        from relaunch.store import wire

        value = b"f" * FLOOD_VALUE
        batch = b"".join(wire.encode(wire.SET, [b"flood/%d" % i, value]) for i in range(16))
        self.sock.settimeout(None)

        def send() -> None:
            with contextlib.suppress(OSError):
                while not self._stopping.is_set():
                    self.sock.sendall(batch)

        def drain() -> None:
            reader = wire.FrameReader()
            with contextlib.suppress(OSError):
                while data := self.sock.recv(1 << 16):
                    self.replies += len(reader.feed(data))
                    if self.replies >= 32:
                        self._started.set()

        self._threads = [threading.Thread(target=f, daemon=True) for f in (send, drain)]
        for thread in self._threads:
            thread.start()

    def wait_started(self) -> None:
        if not self._started.wait(STEP_TIMEOUT_S):
            raise SystemExit("the flood did not get going")

    def stop(self) -> int:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(STEP_TIMEOUT_S)
        return self.replies


# -- this side: the server and the client processes ---------------------------------------------


class Proc:
    """A child process spoken to in lines (stdin) and answering in lines (stdout)."""

    def __init__(self, argv: list[str], env: dict[str, str], what: str) -> None:
        self.what = what
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=harness.ROOT,
            text=True,
        )
        self._selector = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self._selector.register(self.proc.stdout, selectors.EVENT_READ)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, prefix: str, timeout: float = STEP_TIMEOUT_S) -> str:
        """The next line, which must start with ``prefix``; BenchError otherwise or if none
        comes within ``timeout`` seconds."""
        assert self.proc.stdout is not None
        if not self._selector.select(timeout):
            raise BenchError(f"{self.what}: no {prefix!r} within {timeout:g} s")
        line = self.proc.stdout.readline()
        if not line.startswith(prefix):
            err = self.stop()
            raise BenchError(f"{self.what}: expected {prefix!r}, got {line!r}: {err[-300:]}")
        return line.strip()

    def stop(self) -> str:
        """End it (SIGTERM, then SIGKILL by pid); its stderr."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            _, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            harness.kill_pid(self.pid)
            _, err = self.proc.communicate()
        self._selector.close()
        return err or ""


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as file:
        fields = file.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss(pid: int) -> int:
    """Resident bytes of ``pid``."""
    with open(f"/proc/{pid}/status") as file:
        for line in file:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise BenchError(f"no VmRSS for pid {pid}")


@contextlib.contextmanager
def server(env: dict[str, str]) -> Iterator[tuple[Proc, int]]:
    """A fresh ``relaunch store --port 0``: (the process, its port); stopped at the end."""
    proc = Proc([sys.executable, "-m", "relaunch", "store", "--port", "0"], env, "store")
    try:
        line = proc.expect("relaunch store: serving on", START_TIMEOUT_S)
        port = int(line.rsplit(":", 1)[1])
        from relaunch.store import TcpStore

        with TcpStore(HOST, port, timeout=10) as warm:  # the code paths a client takes, loaded
            warm.set("bench/key", b"v")
            warm.get("bench/key")
        yield proc, port
    finally:
        err = proc.stop()
        if proc.proc.returncode not in (0, None):
            log(f"  store exited {proc.proc.returncode}: {err[-300:]}")


@contextlib.contextmanager
def client_procs(env: dict[str, str], port: int, total: int, procs: int) -> Iterator[list[Proc]]:
    """``procs`` client processes sharing ``total`` connections, each ready."""
    code = (
        "import sys; from benchmarks.store import clients_main; "
        "sys.exit(clients_main(sys.argv[1:]))"
    )
    started: list[Proc] = []
    try:
        for index in range(procs):
            share = total // procs + (1 if index < total % procs else 0)
            started.append(
                Proc([sys.executable, "-c", code, str(port), str(share)], env, f"clients {index}")
            )
        for proc in started:
            proc.expect("ready", START_TIMEOUT_S)
        yield started
    finally:
        for proc in started:
            proc.stop()


def everyone(procs: list[Proc], command: str, answer: str) -> list[str]:
    """Send ``command`` to every client process, then collect their ``answer`` lines."""
    for proc in procs:
        proc.send(command)
    return [proc.expect(answer) for proc in procs]


def latencies(port: int, samples: int) -> list[float]:
    """Seconds per ``get`` round trip of one more client, ``samples`` times."""
    from relaunch.store import TcpStore

    with TcpStore(HOST, port, timeout=30) as store:
        out = []
        for _ in range(samples):
            started = time.perf_counter()
            store.get("bench/key")
            out.append(time.perf_counter() - started)
    return out


@dataclass
class Latency:
    p50_ms: float
    p99_ms: float

    @classmethod
    def of(cls, samples: list[float]) -> Latency:
        return cls(percentile(samples, 0.5) * 1000, percentile(samples, 0.99) * 1000)


# -- the measurements ---------------------------------------------------------------------------


def idle_memory(env: dict[str, str], size: int, procs: int) -> tuple[int, int]:
    """(server RSS before, RSS growth) for ``size`` authenticated idle connections."""
    with server(env) as (store, port), client_procs(env, port, size, procs) as clients:
        before = proc_rss(store.pid)
        everyone(clients, "connect", "done")
        grown = proc_rss(store.pid) - before
        everyone(clients, "close", "closed")
    return before, grown


def run(ctx: harness.Context) -> list[Check]:
    opts = ctx.opts
    env = ctx.env
    checks: list[Check] = []
    budget = BUDGETS["bytes per idle connection"]

    print("\nserver memory per idle authenticated connection (RSS growth / N)")
    print(f"{'N':>6} {'RSS before':>11} {'growth':>9} {'bytes/conn':>10}")
    for size in opts.sizes:
        log(f"store: {size} idle connections")
        try:
            before, grown = idle_memory(env, size, opts.procs)
        except BenchError as exc:
            log(f"  {exc}")
            checks.append(Check(f"bytes per idle connection, N={size}", "-", "", None))
            continue
        per = grown / size
        print(f"{size:>6} {before / 2**20:>9.1f} Mi {grown / 2**20:>6.1f} Mi {per:>10.0f}")
        ctx.data[f"idle_{size}"] = {"rss_before": before, "growth": grown, "per_conn": per}
        checks.append(
            Check(
                f"bytes per idle connection, N={size}", f"{per:.0f}", f"<= {budget}", per <= budget
            )
        )

    n = opts.clients
    log(f"store: {n} clients connect and request, then latencies")
    try:
        checks += crowd(ctx, n)
    except BenchError as exc:
        log(f"  {exc}")
        checks.append(Check(f"{n} clients: connect + request", "-", "", None))
    return checks


def crowd(ctx: harness.Context, n: int) -> list[Check]:
    """``n`` clients connect and request; then latencies idle, parked and flooded."""
    opts, env = ctx.opts, ctx.env
    with server(env) as (store, port), client_procs(env, port, n, opts.procs) as clients:
        cpu = proc_cpu(store.pid)
        started = time.perf_counter()
        everyone(clients, "connect get", "done")
        wall = time.perf_counter() - started
        cpu = proc_cpu(store.pid) - cpu
        rss = proc_rss(store.pid)
        print(f"\n{n} clients from {opts.procs} processes: connect + authenticate + one get")
        print(f"  wall {wall:.2f} s, server CPU {cpu:.2f} s, server RSS {rss / 2**20:.1f} MiB")

        idle = Latency.of(latencies(port, opts.samples))
        everyone(clients, "watch 0", "parked")  # bench/topic does not exist: version 0
        time.sleep(PARK_SETTLE_S)  # the measurement's settling time: the watches get parked
        parked = Latency.of(latencies(port, opts.samples))
        from relaunch.store import TcpStore

        with TcpStore(HOST, port, timeout=30) as setter:
            woke = time.perf_counter()
            setter.set("bench/topic", b"go")
            for proc in clients:
                proc.expect("woken")
            wake = time.perf_counter() - woke

        with client_procs(env, port, 1, 1) as (flooder,):
            flooder.send("connect")
            flooder.expect("done")
            flooder.send("flood")
            flooder.expect("flooding")
            flood_cpu = proc_cpu(store.pid)
            flood_started = time.perf_counter()
            flooded = Latency.of(latencies(port, opts.samples))
            flood_s = time.perf_counter() - flood_started
            flood_cpu = proc_cpu(store.pid) - flood_cpu
            flooder.send("stop")
            sets = int(flooder.expect("flooded").split()[1])
        everyone(clients, "close", "closed")

    print(f"\nget round trips of one more client ({opts.samples} each), {n} connections held")
    print(f"{'while':<32} {'p50 ms':>7} {'p99 ms':>7}")
    for what, lat in (
        ("the others idle", idle),
        (f"{n} watches parked", parked),
        ("one client floods 256 KiB sets", flooded),
    ):
        print(f"{what:<32} {lat.p50_ms:>7.2f} {lat.p99_ms:>7.2f}")
    rate = sets * FLOOD_VALUE / 2**20 / flood_s
    print(f"one set woke {n} watchers in {wake * 1000:.0f} ms")
    print(f"the flood: {sets} sets answered, {rate:.0f} MiB/s, server CPU {flood_cpu:.2f} s")
    ctx.data["crowd"] = {
        "clients": n,
        "wall_s": wall,
        "server_cpu_s": cpu,
        "server_rss": rss,
        "idle": vars(idle),
        "parked": vars(parked),
        "flood": vars(flooded),
        "flood_sets": sets,
        "wake_s": wake,
    }
    p99 = BUDGETS["p99 ms"]
    wall_budget = BUDGETS["connect + request s"] * max(n / 4096, 1)
    cpu_budget = BUDGETS["server CPU s"] * max(n / 4096, 1)
    return [
        Check(
            f"{n} clients: connect + request (s)",
            f"{wall:.2f}",
            f"<= {wall_budget:g}",
            wall <= wall_budget,
        ),
        Check(
            f"{n} clients: server CPU (s)",
            f"{cpu:.2f}",
            f"<= {cpu_budget:g}",
            cpu <= cpu_budget,
        ),
        Check(
            "p99 get, others idle (ms)", fmt(idle.p99_ms, ".2f"), f"<= {p99:g}", idle.p99_ms <= p99
        ),
        Check(
            f"p99 get, {n} watches parked (ms)",
            fmt(parked.p99_ms, ".2f"),
            f"<= {p99:g}",
            parked.p99_ms <= p99,
        ),
        Check(
            f"one set wakes {n} watchers (s)",
            f"{wake:.2f}",
            f"<= {BUDGETS['wake s']:g}",
            wake <= BUDGETS["wake s"],
        ),
        Check(
            "p99 get, one client flooding (ms)",
            fmt(flooded.p99_ms, ".2f"),
            f"<= {BUDGETS['flood p99 ms']:g}",
            flooded.p99_ms <= BUDGETS["flood p99 ms"],
        ),
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[1024, 4096],
        help="idle connections for the memory figure (default: 1024 4096)",
    )
    parser.add_argument(
        "--clients", type=int, default=4096, help="clients that connect and request (4096)"
    )
    parser.add_argument("--procs", type=int, default=4, help="client processes (default 4)")
    parser.add_argument(
        "--samples", type=int, default=1000, help="round trips per latency figure (1000)"
    )
