"""Expiry timers, relaunch.timer vs torch.distributed.elastic.timer: deadline-to-death latency,
1,000 live timers across 8 workers, and the cost of one ``expires()``.

Run by hand (not part of the test suite): ``python -m benchmarks timers [--quick]``.

Three measurements, relaunch and torch side by side in one run:

1. **latency**: a worker enters ``with expires(after=0.2 + phase):`` and sleeps, where the
   phase spreads the deadlines over one ``max_interval``; the time from the deadline it sent
   (``time.time()`` based) to the moment the benchmark sees it dead (its pidfd turns readable),
   and to the server's reap call. For ``LocalTimerServer`` (in this process; workers started
   with multiprocessing's ``spawn``, over an ``mp.Queue``) and ``FileTimerServer`` (server and
   workers forked from a helper process per implementation, over the FIFO), at
   ``max_interval`` 0.01 and 0.1, the two implementations alternating. Budget (relaunch):
   median <= max_interval + 10 ms, every worker SIGKILLed.
2. **many**: 8 workers hold 125 timers each (1,000 live timers on one ``FileTimerServer``),
   deadlines spread over 2 s; each releases every timer 50 ms before its deadline except one
   "late" scope. Budget (relaunch): each worker reaped for its late scope and nothing else,
   within ``max_interval`` + 10 ms of that scope's deadline. torch runs the same, then with
   paced acquires, then with releases 150 ms early (the first two fail on torch 2.13).
3. **cost**: microseconds per ``with expires(...): pass`` in a worker, for both file clients.

Standard library only, plus torch for the comparison side (skipped where ``import torch``
fails, or with ``--no-torch``). Only relaunch is held to budgets; the exit status is 0 when
every relaunch budget was measured and holds. See benchmarks/README.md for what each
measurement means.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks import harness
from benchmarks.harness import BenchError, Check, fmt, log

RELAUNCH = "relaunch"
TORCH = "torch"
LOCAL, FILE = "Local", "File"

AFTER_S = 0.2  # expires(after=...) of the latency worker
INTERVALS = (0.01, 0.1)  # max_interval of the servers
LATENCY_SLACK_S = 0.010  # relaunch's budget: median deadline -> death <= max_interval + this
FLOOR_REPS = 5  # SIGKILL -> exit of an idle worker, per server kind and implementation
REAP_BOUND_S = 5.0  # past deadline + max_interval: the worker was not reaped at all
MANY_WORKERS = 8
MANY_TIMERS = 125  # per worker
MANY_SPREAD_S = 2.0  # the deadlines of one worker span this
MANY_LEAD_S = 1.5  # the first deadline comes this long after the workers were started
MANY_MARGIN_S = 0.05  # a worker releases a timer this long before its deadline
MANY_INTERVAL = 0.1  # max_interval of the server in the "many" run
#: The settings of the "many" runs, (seconds between a worker's acquires, release margin):
#: relaunch gets the first; torch gets all three (see the README: the first two fail on torch).
MANY_SETTINGS = {
    RELAUNCH: [(0.0, MANY_MARGIN_S)],
    TORCH: [(0.0, MANY_MARGIN_S), (0.004, MANY_MARGIN_S), (0.004, 0.15)],
}
COST_BATCHES = 9
COST_CALLS = 200  # per batch: 400 requests of about 110 bytes fit in the pipe's 64 KiB
COST_INTERVAL = 0.01

#: The helper process of each implementation (forks file servers and workers on command).
HOST = harness.worker("timer_host.py")


# -- numbers -----------------------------------------------------------------------------------


percentile = harness.percentile


def ms(seconds: float) -> float:
    return seconds * 1e3


# -- the helper processes (one per implementation) ---------------------------------------------


class Host:
    """The helper process of one implementation: forks servers and workers on command."""

    def __init__(self, impl: str, script: str, env: dict[str, str]) -> None:
        self.impl = impl
        self.proc = subprocess.Popen(
            [sys.executable, script, impl],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self._fd = self.proc.stdout.fileno()
        self._partial = b""
        self._backlog: list[list[str]] = []
        self.expect("hello", timeout=60)

    def send(self, *words: object) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((" ".join(str(w) for w in words) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise BenchError(f"{self.impl} helper process is gone") from None

    def _read_lines(self, timeout: float) -> bool:
        ready, _, _ = select.select([self._fd], [], [], max(0.0, timeout))
        if not ready:
            return False
        chunk = os.read(self._fd, 65536)
        if not chunk:
            raise BenchError(f"{self.impl} helper process exited ({self.proc.wait()})")
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        self._backlog += [line.decode().split(" ") for line in lines]
        return True

    def find(self, kind: str, pid: int | None = None) -> list[str] | None:
        """Take the first line ``kind [pid] ...`` from what has arrived; None when there is none.
        BenchError when the worker ``pid`` reported an error instead."""
        for i, words in enumerate(self._backlog):
            if words[0] == kind and (pid is None or int(words[1]) == pid):
                return self._backlog.pop(i)
            if words[0] == "error" and pid is not None and int(words[1]) == pid:
                self._backlog.pop(i)
                raise BenchError(f"{self.impl}: {json.loads(' '.join(words[2:]))}")
        return None

    def expect(
        self, kind: str, pid: int | None = None, timeout: float = 30.0, what: str = ""
    ) -> list[str]:
        """The next line ``kind [pid] ...`` (earlier non-matching lines stay in the backlog)."""
        deadline = time.monotonic() + timeout
        while True:
            words = self.find(kind, pid)
            if words is not None:
                return words
            if not self._read_lines(deadline - time.monotonic()):
                raise BenchError(f"{self.impl}: no '{kind}' line within {timeout:g} s {what}")

    def take_all(self, kind: str) -> list[list[str]]:
        """Every line ``kind ...`` that has arrived by now."""
        while self._read_lines(0):
            pass
        found = [words for words in self._backlog if words[0] == kind]
        self._backlog = [words for words in self._backlog if words[0] != kind]
        return found

    def fork(self, *command: object, timeout: float = 30.0) -> int:
        self.send(*command)
        return int(self.expect("forked", timeout=timeout, what=str(command[0]))[1])

    def fileno(self) -> int:
        return self._fd

    def pump(self) -> None:
        """Read what has arrived (without blocking) into the backlog."""
        self._read_lines(0)

    def pump_for(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a line, reading it into the backlog."""
        self._read_lines(timeout)

    def drain(self) -> None:
        """Forget the lines of earlier runs (a failed run leaves some)."""
        while self._read_lines(0):
            pass
        self._backlog.clear()

    def wait(self, pid: int, timeout: float = 30.0) -> str:
        """Reap a forked child: 'signal N' or 'exit N'."""
        self.send("wait", pid)
        words = self.expect("status", pid, timeout=timeout)
        return " ".join(words[2:])

    def serve(self, fifo: str, max_interval: float, mode: str = "kill") -> int:
        self.fork("serve", fifo, max_interval, mode)
        return int(self.expect("ready", timeout=30, what="from the server")[1])

    def stop_server(self, pid: int) -> tuple[str, dict[str, int] | None]:
        """Stop a server child still alive; (its exit status, its event counts)."""
        counts = None
        if is_running(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
            with contextlib.suppress(BenchError):
                counts = json.loads(self.expect("stopped", pid, timeout=10)[2])
        return self.wait(pid), counts

    def close(self) -> None:
        """EOF on stdin: the helper kills whatever it forked that still runs, and exits."""
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def wait_dead(pidfds: dict[int, int], until: float, host: Host | None = None) -> dict[int, float]:
    """Block until each pidfd is readable (its process is dead) or ``until`` (time.time()):
    pid -> the time.time() at which it was seen dead. Reads ``host``'s lines meanwhile."""
    poller = select.poll()
    by_fd = {fd: pid for pid, fd in pidfds.items()}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    if host is not None:
        poller.register(host.fileno(), select.POLLIN)
    dead: dict[int, float] = {}
    while len(dead) < len(pidfds):
        left = until - time.time()
        if left <= 0:
            break
        for fd, _ in poller.poll(left * 1e3):
            if fd in by_fd:
                dead[by_fd[fd]] = time.time()
                poller.unregister(fd)
            elif host is not None:
                host.pump()
    return dead


def is_running(pid: int) -> bool:
    stat = harness.proc_stat(pid)
    return stat is not None and stat[0] not in "ZX"


# -- 1. deadline -> death ----------------------------------------------------------------------


def phase(rep: int, interval: float) -> float:
    """Added to ``after`` in repetition ``rep``: spreads the deadlines evenly over a polling
    period of ``interval`` (the same for both sides of a repetition). Without it the deadline
    falls at the same point of a polling server's period every time."""
    return ((rep + 1) * 0.6180339887498949 % 1.0) * interval


@dataclass
class Sample:
    latency: float  # s, death seen - deadline
    reap: float  # s, the server's reap call - deadline
    status: str  # how the worker ended
    server: str = ""  # how the (file) server ended


def file_latency_once(host: Host, tmp: str, interval: float, after: float, rep: int) -> Sample:
    host.drain()
    fifo = os.path.join(tmp, f"{host.impl}-{interval:g}-{rep}.fifo")
    server = host.serve(fifo, interval)
    worker = host.fork("latency", fifo, after + phase(rep, interval))
    pidfd = None
    try:
        pidfd = os.pidfd_open(worker)
        deadline = float(host.expect("deadline", worker, timeout=30)[2])
        dead = wait_dead({worker: pidfd}, deadline + interval + REAP_BOUND_S)
        if worker not in dead:
            harness.kill_pid(worker)
            raise BenchError(f"worker not reaped {interval + REAP_BOUND_S:g} s after deadline")
        # The server says "expired" (on_reap / log_event) just before it signals the worker.
        reaped = float(host.expect("expired", worker, timeout=5)[2])
        return Sample(
            dead[worker] - deadline,
            reaped - deadline,
            host.wait(worker),
            host.stop_server(server)[0],
        )
    finally:
        if pidfd is not None:
            os.close(pidfd)
        if is_running(worker):
            harness.kill_pid(worker)
            host.wait(worker)
        if is_running(server):
            host.stop_server(server)


def local_worker(impl: str, queue: Any, after: float, conn: Any) -> None:
    """A spawned worker: ``expires(after)`` on a LocalTimerClient, sends its deadline, sleeps."""
    if impl == TORCH:
        from torch.distributed.elastic.timer import LocalTimerClient, expires
    else:
        from relaunch.timer import LocalTimerClient, expires
    client = Recording(LocalTimerClient(queue))
    with expires(after=after, scope="latency", client=client):
        conn.send(client.sent["latency"])
        conn.close()
        time.sleep(600)


class Recording:
    """Forwards to the real client and remembers each expiration time that it sent."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sent: dict[str, float] = {}

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        self.sent[scope_id] = expiration_time
        self.inner.acquire(scope_id, expiration_time)

    def release(self, scope_id: str) -> None:
        self.inner.release(scope_id)


def local_server(impl: str, queue: Any, interval: float, reaps: list[float]) -> Any:
    """The LocalTimerServer of ``impl``, appending time.time() to ``reaps`` before each reap."""
    if impl == RELAUNCH:
        from relaunch.timer import LocalTimerServer

        def on_reap(worker: Any, timers: Any) -> None:
            reaps.append(time.time())

        return LocalTimerServer(queue, max_interval=interval, on_reap=on_reap)
    from torch.distributed.elastic.timer import LocalTimerServer as TorchServer

    class Timed(TorchServer):  # type: ignore[misc]  # torch's server has no hook: time its _reap_worker
        def _reap_worker(self, worker_id: int) -> bool:
            reaps.append(time.time())
            return bool(super()._reap_worker(worker_id))

    return Timed(queue, max_interval=interval)


def local_latency_once(impl: str, interval: float, after: float) -> Sample:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    reaps: list[float] = []
    server = local_server(impl, queue, interval, reaps)
    server.start()
    receive, send = ctx.Pipe(duplex=False)
    worker = ctx.Process(target=local_worker, args=(impl, queue, after, send), daemon=True)
    pidfd = None
    try:
        worker.start()
        send.close()
        assert worker.pid is not None
        pidfd = os.pidfd_open(worker.pid)
        if not receive.poll(60):
            raise BenchError("the spawned worker sent no deadline within 60 s")
        deadline = receive.recv()
        dead = wait_dead({worker.pid: pidfd}, deadline + interval + REAP_BOUND_S)
        if worker.pid not in dead:
            raise BenchError(f"worker not reaped {interval + REAP_BOUND_S:g} s after deadline")
        worker.join()
        code = worker.exitcode
        status = f"signal {-code}" if code is not None and code < 0 else f"exit {code}"
        return Sample(
            dead[worker.pid] - deadline, reaps[0] - deadline if reaps else math.nan, status
        )
    finally:
        if pidfd is not None:
            os.close(pidfd)
        if worker.is_alive():
            worker.kill()
        if worker.pid is not None:
            worker.join()
        server.stop()
        receive.close()
        queue.close()
        queue.join_thread()


def idle_worker(impl: str, conn: Any) -> None:
    """A spawned worker that imports what ``local_worker`` imports, then sleeps."""
    if impl == TORCH:
        import torch.distributed.elastic.timer  # noqa: F401
    else:
        import relaunch.timer  # noqa: F401
    conn.send(os.getpid())
    conn.close()
    time.sleep(600)


def kill_to_exit(pid: int) -> float:
    """SIGKILL ``pid`` (alive, sleeping); seconds until its pidfd turns readable."""
    pidfd = os.pidfd_open(pid)
    try:
        start = time.time()
        os.kill(pid, signal.SIGKILL)
        dead = wait_dead({pid: pidfd}, start + REAP_BOUND_S)
        if pid not in dead:
            raise BenchError(f"pid {pid} still alive {REAP_BOUND_S:g} s after SIGKILL")
        return dead[pid] - start
    finally:
        os.close(pidfd)


def exit_floor(kind: str, impl: str, host: Host | None, reps: int) -> float:
    """Median SIGKILL -> pidfd readable for an idle worker started as the latency workers are:
    how much of deadline -> death is the worker's own exit (a process with torch imported
    takes longer to tear down)."""
    samples = []
    for _ in range(reps):
        if kind == FILE:
            assert host is not None
            pid = host.fork("idle")
            host.expect("idle", pid, timeout=30)
            samples.append(kill_to_exit(pid))
            host.wait(pid)
            continue
        ctx = multiprocessing.get_context("spawn")
        receive, send = ctx.Pipe(duplex=False)
        worker = ctx.Process(target=idle_worker, args=(impl, send), daemon=True)
        worker.start()
        send.close()
        try:
            if not receive.poll(60):
                raise BenchError("the idle worker did not start within 60 s")
            receive.recv()
            assert worker.pid is not None
            samples.append(kill_to_exit(worker.pid))
        finally:
            if worker.is_alive():
                worker.kill()
            worker.join()
            receive.close()
    return percentile(samples, 0.5)


@dataclass
class LatencyRow:
    kind: str
    interval: float
    impl: str
    samples: list[Sample] = field(default_factory=list)
    error: str | None = None
    floor: float = math.nan  # s, median SIGKILL -> pidfd of an idle worker of this kind

    def stat(self, q: float, reap: bool = False) -> float:
        return percentile([ms(s.reap if reap else s.latency) for s in self.samples], q)

    def sigkilled(self) -> int:
        return sum(s.status == f"signal {int(signal.SIGKILL)}" for s in self.samples)


def bench_latency(
    hosts: dict[str, Host], tmp: str, reps: int, after: float, intervals: Sequence[float]
) -> list[Check]:
    impls = list(hosts)
    rows: list[LatencyRow] = []
    for kind in (FILE, LOCAL):
        floors = {}
        for impl in impls:
            log(f"[1/3] SIGKILL -> exit of an idle {kind} worker of {impl}, {FLOOR_REPS} runs")
            try:
                floors[impl] = exit_floor(kind, impl, hosts[impl], FLOOR_REPS)
            except BenchError as exc:
                log(f"  {impl}: {exc}")
        for interval in intervals:
            log(
                f"[1/3] deadline -> death: {kind}TimerServer, max_interval {interval:g}, "
                f"{reps} runs of {' and '.join(impls)}"
            )
            errors: dict[str, str] = {}

            def run_side(
                impl: str, kind: str = kind, interval: float = interval
            ) -> Callable[[int], Sample]:
                if kind == FILE:
                    return lambda rep: file_latency_once(hosts[impl], tmp, interval, after, rep)
                return lambda rep: local_latency_once(impl, interval, after + phase(rep, interval))

            samples = harness.run_alternating(
                {impl: run_side(impl) for impl in impls},
                {impl: reps for impl in impls},
                errors,
                after_each=lambda side: None,
                warmup=True,
            )
            for impl in impls:
                rows.append(
                    LatencyRow(
                        kind,
                        interval,
                        impl,
                        samples[impl],
                        errors.get(impl),
                        floors.get(impl, math.nan),
                    )
                )
    print(
        f"\n1. deadline -> death (ms): a worker sleeps in `with expires(after={after:g} + "
        "phase)`; time.time() when its pidfd turned readable - the deadline it sent; reap md: "
        "median of the server's reap call - the deadline; exit md: median SIGKILL -> pidfd "
        "readable of an idle worker of the same kind (its own exit); rl/torch d/r: ratio of the "
        "medians, death / reap"
    )
    print(
        f"{'server':<16} {'max_interval':>12} {'impl':<9} {'runs':>4} {'median':>7} "
        f"{'p90':>7} {'max':>7} {'reap md':>7} {'exit md':>7} {'SIGKILLed':>9} "
        f"{'rl/torch d/r':>12}  server after the reap"
    )
    by_key = {(r.kind, r.interval, r.impl): r for r in rows}
    checks = []
    for row in rows:
        other = by_key.get((row.kind, row.interval, TORCH))
        ratio = ""
        if row.impl == RELAUNCH and other is not None and other.samples and row.samples:
            ratio = (
                f"{row.stat(0.5) / other.stat(0.5):.3f}/"
                f"{row.stat(0.5, reap=True) / other.stat(0.5, reap=True):.3f}"
            )
        servers = sorted({s.server for s in row.samples if s.server})
        after_reap = ", ".join(f"{s} ({sum(x.server == s for x in row.samples)})" for s in servers)
        stats = " ".join(f"{fmt(row.stat(q), '.2f'):>7}" for q in (0.5, 0.9, 1))
        stats += f" {fmt(row.stat(0.5, reap=True), '.2f'):>7} {fmt(ms(row.floor), '.2f'):>7}"
        print(
            f"{row.kind + 'TimerServer':<16} {row.interval:>12g} {row.impl:<9} "
            f"{len(row.samples):>4} {stats} {f'{row.sigkilled()}/{len(row.samples)}':>9} "
            f"{ratio:>12}  {after_reap}" + (f"  ERROR: {row.error}" if row.error else "")
        )
        if row.impl == RELAUNCH:
            budget = ms(row.interval + LATENCY_SLACK_S)
            ok = (
                not row.error
                and len(row.samples) == reps
                and row.stat(0.5) <= budget
                and row.sigkilled() == reps
            )
            checks.append(
                Check(
                    f"{row.kind} {row.interval:g}: median deadline->death, all SIGKILLed",
                    f"{fmt(row.stat(0.5), '.2f')} ms, {row.sigkilled()}/{reps}",
                    f"<= {budget:g} ms, {reps}/{reps}",
                    ok,
                )
            )
    return checks


# -- 2. 1,000 live timers across 8 workers -----------------------------------------------------


@dataclass
class WorkerResult:
    index: int
    pid: int
    late_scope: str = ""
    late_deadline: float = math.nan
    #: scope -> how long before its deadline its release had certainly been written
    released: dict[str, float] = field(default_factory=dict)
    release_errors: list[str] = field(default_factory=list)
    acquired_at: float = math.nan
    expired: list[tuple[str, float, float]] = field(default_factory=list)  # scope, when, deadline
    dead_at: float | None = None
    status: str = ""


@dataclass
class ManyRun:
    impl: str
    gap: float  # seconds between a worker's acquires
    margin: float  # a worker releases a timer this long before its deadline
    base: float  # the first deadline
    workers: list[WorkerResult]
    counts: dict[str, int] | None  # the server's events
    server: str  # how the server ended


def late_index(index: int, workers: int, timers: int) -> int:
    """The scope worker ``index`` never releases: spread over the workers, never the first."""
    return 10 + (index * (timers - 20)) // max(1, workers - 1)


def wait_acquired(host: Host, results: list[WorkerResult], timeout: float) -> None:
    """Until every worker said "acquired"; BenchError when one failed or died first (a slow
    acquire can let the server reap a worker before it holds all its timers)."""
    deadline = time.monotonic() + timeout
    waiting = {result.pid: result for result in results}
    while waiting:
        host.pump_for(0.05)
        for pid, result in list(waiting.items()):
            words = host.find("acquired", pid)
            if words is None and not is_running(pid):
                host.pump_for(0.1)  # its last words
                words = host.find("acquired", pid)
                if words is None:
                    raise BenchError(f"w{result.index} died before it held all its timers")
            if words is not None:
                result.acquired_at = float(words[3])
                del waiting[pid]
        if waiting and time.monotonic() > deadline:
            raise BenchError(f"{len(waiting)} workers did not acquire within {timeout:g} s")


def many_once(
    host: Host,
    tmp: str,
    workers: int,
    timers: int,
    spread: float,
    interval: float,
    gap: float,
    margin: float,
) -> ManyRun:
    host.drain()
    fifo = os.path.join(tmp, f"{host.impl}-many-{gap:g}-{margin:g}.fifo")
    # torch's server signals its own process after a reap (torch 2.13: "Terminating the server
    # process ... because of expired timers"), with the signal the worker asked for. Its workers
    # ask for SIGTERM and its server ignores SIGTERM, so that it lives on to reap the others.
    mode, sig = ("survive", signal.SIGTERM) if host.impl == TORCH else ("kill", signal.SIGKILL)
    server = host.serve(fifo, interval, mode)
    base = time.time() + MANY_LEAD_S
    results: list[WorkerResult] = []
    pidfds: dict[int, int] = {}
    counts, server_status = None, "?"
    try:
        for index in range(workers):
            late = late_index(index, workers, timers)
            pid = host.fork(
                "many", fifo, index, workers, timers, base, spread, margin, late, int(sig), gap
            )
            results.append(WorkerResult(index, pid))
            pidfds[pid] = os.pidfd_open(pid)
        wait_acquired(host, results, timeout=30)
        # Every deadline is before base + spread; watch the pidfds from now on.
        dead = wait_dead(pidfds, base + spread + interval + REAP_BOUND_S, host)
        time.sleep(0.05)
        holding = {int(words[1]): words for words in host.take_all("holding")}
        for result in results:
            result.dead_at = dead.get(result.pid)
            late = late_index(result.index, workers, timers)
            # A worker reaped before it reached its late scope printed nothing: what it would
            # have sent (the same to a few microseconds).
            result.late_scope = f"w{result.index}-s{late}"
            result.late_deadline = base + spread * (late + result.index / workers) / timers
            if result.pid in holding:
                result.late_scope = json.loads(holding[result.pid][2])
                result.late_deadline = float(holding[result.pid][3])
        for words in host.take_all("rel"):
            for result in results:
                if int(words[1]) == result.pid:
                    result.released[f"w{result.index}-s{words[2]}"] = float(words[3])
        for words in host.take_all("relerr"):
            for result in results:
                if int(words[1]) == result.pid:
                    result.release_errors.append(json.loads(" ".join(words[3:])))
        for words in host.take_all("expired"):
            for result in results:
                if int(words[1]) == result.pid:
                    result.expired.append((json.loads(words[3]), float(words[2]), float(words[4])))
    finally:
        for pid, fd in pidfds.items():
            os.close(fd)
            if is_running(pid):
                harness.kill_pid(pid)
        for result in results:
            result.status = host.wait(result.pid)
        server_status, counts = host.stop_server(server)
    return ManyRun(host.impl, gap, margin, base, results, counts, server_status)


def print_many(run: ManyRun, interval: float) -> list[Check]:
    results = run.workers
    n = len(results)
    reaped = [r for r in results if r.dead_at is not None]
    only_late = [r for r in results if [e[0] for e in r.expired] == [r.late_scope]]
    # A scope other than the late one fired: was its release written before its deadline?
    fired_released = [
        (r, e)
        for r in results
        for e in r.expired
        if e[0] != r.late_scope and r.released.get(e[0], -1.0) > 0
    ]
    fired_other = sum(1 for r in results for e in r.expired if e[0] != r.late_scope)
    reap_lat = [
        ms(e[1] - r.late_deadline) for r in results for e in r.expired if e[0] == r.late_scope
    ]
    death_lat = [ms(r.dead_at - r.late_deadline) for r in reaped if r.dead_at is not None]
    early = sum(1 for r in reaped if r.dead_at is not None and r.dead_at < r.late_deadline)
    slacks = [v for r in results for v in r.released.values()]
    releases = len(slacks)
    errors = sum(len(r.release_errors) for r in results)
    acquired_by = max(r.acquired_at for r in results) - run.base
    events = ""
    if run.counts is not None:
        events = ", " + " ".join(f"{k}={v}" for k, v in sorted(run.counts.items()))
    label = many_label(run.impl, run.gap, run.margin)
    print(
        f"{label:<46} {len(reaped):>6} {len(only_late):>9} {len(fired_released):>8} "
        f"{fired_other - len(fired_released):>6} {early:>5} "
        f"{fmt(percentile(reap_lat, 0.5), '.2f'):>7} {fmt(percentile(reap_lat, 1), '.2f'):>7} "
        f"{fmt(percentile(death_lat, 0.5), '.2f'):>8} {fmt(percentile(death_lat, 1), '.2f'):>7} "
        f"{releases:>5}/{errors:<3} {fmt(ms(min(slacks, default=math.nan)), '.1f'):>6} "
        f"{fmt(ms(acquired_by), '.0f'):>8}  {run.server}{events}"
    )
    for r, (scope, when, deadline) in fired_released:
        print(
            f"    {run.impl}: {scope} of pid {r.pid} fired {ms(when - deadline):.1f} ms after "
            f"its deadline; its release had been written {ms(r.released[scope]):.1f} ms "
            "before the deadline"
        )
    for r in results:
        fired = ",".join(e[0] for e in r.expired) or "-"
        death = ms(r.dead_at - r.late_deadline) if r.dead_at is not None else None
        log(
            f"    {run.impl} w{r.index} pid {r.pid}: late {r.late_scope}, fired {fired}, "
            f"death - deadline {fmt(death, '.2f')} ms, {r.status}"
            + (f", release errors: {r.release_errors[0]}" if r.release_errors else "")
        )
    if run.impl != RELAUNCH:
        return []
    budget = ms(interval + LATENCY_SLACK_S)
    acquires = (run.counts or {}).get("acquire")
    timers = acquires if acquires is not None else "?"
    return [
        Check(
            f"{timers} timers: workers reaped, each for its late scope only",
            f"{len(only_late)}/{n}",
            f"{n}/{n}",
            len(only_late) == n and len(reaped) == n,
        ),
        Check(
            f"{timers} timers: timers released in time that fired",
            str(len(fired_released)),
            "0",
            not fired_released,
        ),
        Check(
            f"{timers} timers: max deadline->death",
            f"{fmt(max(death_lat, default=math.nan), '.2f')} ms",
            f"<= {budget:g} ms",
            len(death_lat) == n and max(death_lat) <= budget,
        ),
    ]


MANY_LEGEND = """\
   late only: workers reaped for their late scope and nothing else
   rel+fire:  timers that fired although their release had been written before the deadline
   other:     other timers that fired (released late, or not at all)
   early:     workers dead before their late scope's deadline
   reap, death: ms from the late scope's deadline to the server's reap call (on_reap or
              log_event) and to the worker's pidfd turning readable; median and max
   rel/err:   releases written / releases that raised
   slack:     the least ms before a deadline that a release had been written
   acquired:  ms from the last worker's last acquire to the first deadline (negative: before)"""


def many_label(impl: str, gap: float, margin: float) -> str:
    return (
        f"{impl}, "
        + (f"acquires {ms(gap):g} ms apart" if gap else "all at once")
        + f", release {ms(margin):g} ms early"
    )


def bench_many(
    hosts: dict[str, Host], tmp: str, workers: int, timers: int, spread: float, interval: float
) -> list[Check]:
    runs: list[ManyRun] = []
    errors: list[str] = []
    for impl, host in hosts.items():
        for gap, margin in MANY_SETTINGS[impl]:
            label = many_label(impl, gap, margin)
            log(f"[2/3] {workers} x {timers} timers on {impl}'s FileTimerServer: {label}")
            try:
                runs.append(many_once(host, tmp, workers, timers, spread, interval, gap, margin))
            except BenchError as exc:
                log(f"  {label}: {exc}")
                errors.append(f"{label}: {exc}")
    print(
        f"\n2. {workers * timers} live timers: {workers} workers x {timers} scopes on one "
        f"FileTimerServer (max_interval {interval:g}), deadlines over {spread:g} s; each "
        "worker releases every timer shortly before its deadline but its late scope"
    )
    print(MANY_LEGEND)
    print(
        f"{'impl, settings':<46} {'reaped':>6} {'late only':>9} {'rel+fire':>8} {'other':>6} "
        f"{'early':>5} {'reap md':>7} {'max':>7} {'death md':>8} {'max':>7} {'rel/err':>9} "
        f"{'slack':>6} {'acquired':>8}  server, events"
    )
    checks: list[Check] = []
    for run in runs:
        checks += print_many(run, interval)
    for error in errors:
        print(f"  error: {error}")
    if not any(run.impl == RELAUNCH for run in runs):
        checks.append(Check(f"{workers * timers} timers on relaunch", "error", "completes", False))
    return checks


# -- 3. the cost of one expires() --------------------------------------------------------------


def bench_cost(hosts: dict[str, Host], tmp: str, batches: int, calls: int) -> None:
    print(
        f"\n3. one `with expires(after=60, scope=...): pass` in a worker, us per call (median "
        f"of {batches} batches of {calls}; FileTimerServer max_interval {COST_INTERVAL:g}; "
        "'no client': the same with a client that sends nothing)"
    )
    print(f"{'client':<24} {'scope given':>12} {'default scope':>14}")
    table: dict[tuple[str, str], list[float]] = {}
    for impl, host in hosts.items():
        log(f"[3/3] cost of expires() with {impl}'s FileTimerClient")
        fifo = os.path.join(tmp, f"{impl}-cost.fifo")
        server = host.serve(fifo, COST_INTERVAL)
        try:
            for target, label in ((fifo, "FileTimerClient"), ("-", "no client")):
                worker = host.fork("cost", target, batches, calls)
                try:
                    words = host.expect("cost", worker, timeout=120)
                    table[(impl, label)] = [float(words[2]), float(words[3])]
                except BenchError as exc:
                    print(f"{impl + ' ' + label:<24} ERROR: {exc}")
                finally:
                    host.wait(worker)
        finally:
            host.stop_server(server)
    for label in ("FileTimerClient", "no client"):
        for impl in hosts:
            if (impl, label) in table:
                given, default = table[(impl, label)]
                print(f"{impl + ' ' + label:<24} {given:>12.1f} {default:>14.1f}")


# -- main --------------------------------------------------------------------------------------


def mp_helpers() -> set[int]:
    """multiprocessing's resource tracker (spawn starts it; it exits with this process)."""
    return {
        pid
        for pid in harness.our_children()
        if "multiprocessing.resource_tracker" in harness.cmdline(pid)
    }


LAUNCHERS = False  # the timer classes, in a helper process per implementation

QUICK = {"reps": 2, "intervals": [0.1], "timers": 25, "spread": 1.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=20, help="latency runs per side and setting")
    parser.add_argument("--after", type=float, default=AFTER_S, help="expires(after=...), s")
    parser.add_argument(
        "--intervals",
        type=float,
        nargs="+",
        default=list(INTERVALS),
        help="max_interval values (default: %(default)s)",
    )
    parser.add_argument("--workers", type=int, default=MANY_WORKERS)
    parser.add_argument("--timers", type=int, default=MANY_TIMERS, help="timers per worker")
    parser.add_argument("--spread", type=float, default=MANY_SPREAD_S)
    parser.add_argument("--no-torch", action="store_true", help="measure relaunch only")
    parser.add_argument(
        "--only", choices=("latency", "many", "cost"), action="append", help="run only these"
    )


def run(ctx: harness.Context) -> list[Check]:
    opts = ctx.opts
    only = set(opts.only or ("latency", "many", "cost"))
    torch = None if opts.no_torch else harness.torch_version()
    print(f"  torch: {torch or ('not run: --no-torch' if opts.no_torch else 'import fails')}")
    ctx.data["torch"] = torch
    checks: list[Check] = []
    hosts: dict[str, Host] = {}
    try:
        log("starting the helper processes (torch's imports take a few seconds)")
        hosts[RELAUNCH] = Host(RELAUNCH, HOST, ctx.env)
        if torch:
            hosts[TORCH] = Host(TORCH, HOST, ctx.env)
        if "latency" in only:
            checks += bench_latency(hosts, ctx.tmp, opts.reps, opts.after, opts.intervals)
        if "many" in only:
            checks += bench_many(
                hosts, ctx.tmp, opts.workers, opts.timers, opts.spread, MANY_INTERVAL
            )
        if "cost" in only:
            bench_cost(hosts, ctx.tmp, COST_BATCHES, COST_CALLS)
    finally:
        for host in hosts.values():
            host.close()
    ctx.keep |= mp_helpers()
    return checks
