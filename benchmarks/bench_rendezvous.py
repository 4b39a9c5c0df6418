"""The dynamic (c10d) rendezvous: joining, losing a node, and a 1024-node simulation.

Run by hand (not part of the test suite)::

    python benchmarks/bench_rendezvous.py

Three measurements. The first two run the ``relaunch`` command and, where ``torch`` can be
imported, torchrun (``python -m torch.distributed.run``) with the same flags (only the heartbeat
settings differ, see ``DEATH_CONF``), alternating: K agents started at once until all K workers
run, and a node SIGKILLed until the survivor's worker runs again. The third runs relaunch's
rendezvous for 256 and 1024 nodes as threads of this process, on real sockets to one store
server, all at once and then one by one, and counts the store operations of each node. Only
relaunch's numbers are checked against budgets; torchrun's are for comparison. Standard library
only; the exit status is 0 when every relaunch budget was measured and holds. See
benchmarks/README.md for what each measurement means.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import resource
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import _harness
from _harness import RELAUNCH, TORCHRUN, BenchError, Check, fmt, log, median, verdict

JOIN_NODES = (2, 4, 8)
JOIN_BUDGET_S = 1.5  # launch -> every worker has printed its first line, every K
DEATH_BUDGET_S = 2.0  # SIGKILL of a node -> the survivor's restarted worker printed
DEATH_SETTLE_S = 1.0  # both workers run in world 2 this long before the kill, plus
DEATH_PHASE_STEP_S = 0.1  # this much more per repetition (mod 5): the heartbeats' phase varies
DEATH_BOUND_S = 20.0  # how long a launcher gets to recover
WORKER_GONE_S = 1.0  # the killed node's worker must be gone this soon (relaunch)
#: Heartbeats: relaunch counts a node dead after interval * max_attempt = 1.0 s. torchrun takes
#: only whole seconds for keep_alive_interval (it parses it with int()), and with interval 1 and
#: max_attempt 1 a single node never completes its round (torch 2.13: it waits until
#: join_timeout), so torchrun gets 1 s * 2 = 2.0 s.
DEATH_CONF = {
    "relaunch": "keep_alive_interval=0.5,keep_alive_max_attempt=2,last_call_timeout=1,"
    "join_timeout=60",
    "torchrun": "keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1,"
    "join_timeout=60",
}
JOIN_CONF = "join_timeout=60"
SIM_NODES = (256, 1024)
SIM_BUDGET_S = 10.0  # 1024 nodes: barrier -> every next_rendezvous() returned
SIM_LOCAL_WORLD_SIZE = 2
SIM_OPS_RATIO = 1.25  # ops per node at 1024 <= this * ops at 256 + SIM_OPS_SLACK
SIM_OPS_SLACK = 2
STAGGER_NODES = (64, 256)  # the same, with the nodes joining one after another
STAGGER_S = 0.005
SIM_OPS = ("get", "set", "compare_set", "add", "delete", "wait", "watch")
LINE_TIMEOUT_S = 60.0  # give up on launchers that print nothing for this long

#: The worker scripts, written to a temporary directory; both launchers run them as
#: ``python -u SCRIPT ARGS``.
SCRIPTS = {
    "noop.py": "pass\n",
    # Measurement 1: one line at start, then exit 0.
    "hello.py": """\
import os, time
print(f"started {time.time()!r} rank {os.environ['RANK']} world {os.environ['WORLD_SIZE']}",
      flush=True)
""",
    # Measurement 2: one line at start, then run until the file argv[1] exists (at most 120 s).
    "world.py": """\
import os, sys, time
print(f"started {time.time()!r} rank {os.environ['RANK']} world {os.environ['WORLD_SIZE']}"
      f" pid {os.getpid()}", flush=True)
deadline = time.monotonic() + 120
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.02)
""",
}

STARTED_RE = re.compile(rb"started (\d+(?:\.\d+)?) rank (\d+) world (\d+)(?: pid (\d+))?")


def spread(values: Sequence[float], spec: str = ".0f") -> str:
    """``median [min-max]``, or ``-``."""
    if not values:
        return "-"
    return f"{median(values):.0f} [{min(values):{spec}}-{max(values):{spec}}]"


@dataclass
class Launcher(_harness.Launcher):
    """A launcher command line; the flags are torchrun's, passed to both launchers as they are."""

    def argv(
        self, nnodes: str, port: int, run_id: str, conf: str, script: str, *args: str
    ) -> list[str]:
        flags = [
            "--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "--rdzv-conf", conf,
            "--tee", "1",
        ]  # fmt: skip
        return [*self.prefix, *flags, script, *args]


@dataclass
class Bench(_harness.Bench[Launcher]):
    """Shared state (see _harness.Bench), and what was left behind."""

    leftovers: dict[str, list[str]] = field(default_factory=dict)
    _runs: int = 0

    def launchers(self) -> list[Launcher]:
        return [lch for lch in (self.relaunch, self.torchrun) if lch.unavailable is None]

    def run_dir(self, what: str) -> str:
        """A fresh directory for one run (stderr files, flag files); removed with ``tmp``."""
        self._runs += 1
        return tempfile.mkdtemp(prefix=f"{self._runs:03d}-{what}-", dir=self.tmp)

    def collect(self, side: str) -> None:
        """Kill what the last run left behind; note it against ``side``."""
        if killed := _harness.collect_orphans():
            self.leftovers.setdefault(side, []).extend(killed)


# -- processes ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Agents:
    """The launcher processes of one run, each with its stdout on a pipe; their lines are read
    together, each stamped with time.time() when its chunk arrived. Stops them (by pid) at the
    end of the ``with`` block."""

    def __init__(self, bench: Bench, run_dir: str) -> None:
        self.bench, self.run_dir = bench, run_dir
        self.procs: list[subprocess.Popen] = []
        self.exited_at: dict[int, float] = {}  # index -> time.perf_counter() at exit
        self._partial: dict[int, bytes] = {}
        self._open: dict[int, int] = {}  # fd -> index
        self._ready: list[tuple[int, float, bytes]] = []

    def __enter__(self) -> Agents:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                _harness.kill_pid(proc.pid)
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()

    def start(self, argv: list[str]) -> int:
        index = len(self.procs)
        with open(self.stderr_file(index), "wb") as err:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                env=self.bench.env,
                cwd=self.run_dir,
            )
        assert proc.stdout is not None
        self.procs.append(proc)
        self._open[proc.stdout.fileno()] = index
        self._partial[index] = b""
        return index

    def stderr_file(self, index: int) -> str:
        return os.path.join(self.run_dir, f"agent{index}.stderr")

    def stderr_tail(self, index: int | None = None) -> str:
        """The last line of an agent's stderr: of ``index``, else of the first that failed."""
        if index is None:
            failed = [i for i, p in enumerate(self.procs) if p.poll() not in (None, 0)]
            index = failed[0] if failed else 0
        with contextlib.suppress(OSError), open(self.stderr_file(index), errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
            return f"agent {index}: " + (lines[-1][:200] if lines else "(no stderr)")
        return f"agent {index}: (no stderr)"

    def _poll_exits(self) -> None:
        now = time.perf_counter()
        for index, proc in enumerate(self.procs):
            if index not in self.exited_at and proc.poll() is not None:
                self.exited_at[index] = now

    def next(self, timeout: float) -> tuple[int, float, bytes] | None:
        """The next whole line of any agent as (agent, arrival, line); None after ``timeout`` s
        without one (or when every pipe is at its end)."""
        deadline = time.monotonic() + timeout
        while not self._ready:
            left = deadline - time.monotonic()
            if left <= 0 or not self._open:
                return None
            self.pump(min(left, 0.005))
        return self._ready.pop(0)

    def pump(self, timeout: float) -> None:
        """Read whatever arrives within ``timeout`` s; note exits."""
        if self._open:
            readable = select.select(list(self._open), [], [], timeout)[0]
        else:
            readable = []
            time.sleep(timeout)
        for fd in readable:
            chunk = os.read(fd, 1 << 16)
            arrival = time.time()
            index = self._open[fd]
            if not chunk:
                del self._open[fd]
                continue
            *lines, self._partial[index] = (self._partial[index] + chunk).split(b"\n")
            self._ready.extend((index, arrival, line) for line in lines)
        self._poll_exits()

    def wait_all(self, timeout: float) -> list[int]:
        """Exit codes of every agent, reading their output meanwhile; BenchError on a hang."""
        deadline = time.monotonic() + timeout
        while len(self.exited_at) < len(self.procs):
            if time.monotonic() > deadline:
                raise BenchError(
                    f"{len(self.procs) - len(self.exited_at)} agent(s) still running after "
                    f"{timeout:.0f} s"
                )
            self.pump(0.005)
        return [proc.returncode for proc in self.procs]


def note_errors(bench: Bench, errors: dict[str, str]) -> None:
    for lch in (bench.relaunch, bench.torchrun):
        reason = lch.unavailable or errors.get(lch.name)
        if reason is not None:
            print(f"  {lch.name}: not measured ({reason})")


# -- 1. K agents at once -> all K workers running ----------------------------------------------


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def join_run(bench: Bench, launcher: Launcher, nodes: int) -> tuple[float, float, float, float]:
    """(every worker printed, every line arrived, every agent exited), in s since the launch,
    and the CPU seconds of the agents and their workers."""
    run_dir = bench.run_dir(f"join{nodes}-{launcher.name}")
    port, run_id = free_port(), f"join{nodes}"
    argv = launcher.argv(str(nodes), port, run_id, JOIN_CONF, bench.script("hello.py"))
    seen: dict[int, tuple[float, float]] = {}  # rank -> (printed at, arrived at)
    with Agents(bench, run_dir) as agents:
        cpu = children_cpu()
        launched, started = time.time(), time.perf_counter()
        for _ in range(nodes):
            agents.start(argv)
        while len(seen) < nodes:
            item = agents.next(LINE_TIMEOUT_S)
            if item is None:
                raise BenchError(
                    f"{len(seen)} of {nodes} workers started, then silence or end of output "
                    f"({agents.stderr_tail()})"
                )
            match = STARTED_RE.search(item[2])
            if match is None:
                continue
            rank, world = int(match.group(2)), int(match.group(3))
            if world != nodes or rank in seen or not 0 <= rank < nodes:
                raise BenchError(f"unexpected worker line {item[2][:120]!r}")
            seen[rank] = (float(match.group(1)), item[1])
        codes = agents.wait_all(LINE_TIMEOUT_S)
        if any(codes):
            raise BenchError(f"exit codes {codes} ({agents.stderr_tail()})")
        total = max(agents.exited_at.values()) - started
    cpu = children_cpu() - cpu  # the workers count: each agent reaped its own
    printed = max(at for at, _ in seen.values()) - launched
    arrived = max(at for _, at in seen.values()) - launched
    return printed, arrived, total, cpu


def bench_join(bench: Bench, reps: int, torchrun_reps: int) -> list[Check]:
    log(
        f"[1/3] K agents at once -> K workers running: K in {JOIN_NODES}, {reps} repetitions"
        f" (torchrun: {torchrun_reps}), alternating"
    )
    rows = []
    errors: dict[str, str] = {}
    for nodes in JOIN_NODES:
        log(f"  K={nodes}")
        sides: dict[str, Callable[[int], Any]] = {
            lch.name: lambda rep, lch=lch, k=nodes: join_run(bench, lch, k)
            for lch in bench.launchers()
        }
        counts = {side: torchrun_reps if side == TORCHRUN else reps for side in sides}
        samples = _harness.run_alternating(sides, counts, errors, bench.collect)
        rows.append((nodes, samples))

    print("\n1. K agents started at once (--nnodes K --nproc-per-node 1 --rdzv-backend c10d),")
    print("   seconds since the launch, medians: all printed = the last worker's own time stamp")
    print("   in its first line; arrived = that line reached us through --tee; exited = all")
    print("   agents exited; CPU: CPU seconds of all agents and workers; tr/rl: printed ratio")
    print(
        f"{'K':>3} {'runs':>4} {'relaunch printed':>17} {'arrived':>8} {'exited':>7} {'CPU':>5}"
        f"  <= 1.5 s  {'runs':>4} {'torchrun printed':>17} {'arrived':>8} {'exited':>7}"
        f" {'CPU':>5} {'tr/rl':>6}"
    )
    checks = []
    for nodes, samples in rows:
        cols: dict[str, list[float | None]] = {}
        for name in (RELAUNCH, TORCHRUN):
            runs = samples.get(name, [])
            cols[name] = [median([r[i] for r in runs]) if runs else None for i in range(4)]
        ours, theirs = cols[RELAUNCH][0], cols[TORCHRUN][0]
        ok = None if ours is None else ours <= JOIN_BUDGET_S
        ratio = None if ours is None or theirs is None else theirs / ours
        print(
            f"{nodes:>3} {len(samples.get(RELAUNCH, [])):>4} {fmt(ours, '.3f'):>17}"
            f" {fmt(cols[RELAUNCH][1], '.3f'):>8} {fmt(cols[RELAUNCH][2], '.3f'):>7}"
            f" {fmt(cols[RELAUNCH][3], '.2f'):>5}  {verdict(ok):>7}"
            f"  {len(samples.get(TORCHRUN, [])):>4} {fmt(theirs, '.3f'):>17}"
            f" {fmt(cols[TORCHRUN][1], '.3f'):>8} {fmt(cols[TORCHRUN][2], '.3f'):>7}"
            f" {fmt(cols[TORCHRUN][3], '.2f'):>5} {fmt(ratio, '.1f'):>6}"
        )
        checks.append(
            Check(
                f"K={nodes} agents -> all workers printed",
                f"{fmt(ours, '.3f')} s",
                f"<= {JOIN_BUDGET_S:g} s",
                ok,
            )
        )
    note_errors(bench, errors)
    return checks


# -- 2. a node SIGKILLed -> the survivor's worker runs again -----------------------------------


@dataclass
class DeathRun:
    recovered: bool
    printed_ms: float | None  # the survivor's world-1 worker: its own time stamp - the kill
    arrived_ms: float | None  # that line's arrival through --tee - the kill
    worker_gone_ms: float | None  # the killed node's worker gone (None: still there at the end)
    host_end: str  # how the surviving agent ended


def death_run(bench: Bench, launcher: Launcher, rep: int) -> DeathRun:
    run_dir = bench.run_dir(f"death-{launcher.name}")
    done = os.path.join(run_dir, "done")
    port = free_port()
    conf = DEATH_CONF[launcher.name]
    script = bench.script("world.py")
    # agent -> (world, pid, printed at, arrived at) of its latest worker line
    latest: dict[int, tuple[int, int, float, float]] = {}
    orphans: list[int] = []
    with Agents(bench, run_dir) as agents:

        def read(timeout: float) -> tuple[int, float, bytes] | None:
            item = agents.next(timeout)
            if item is not None and (match := STARTED_RE.search(item[2])) is not None:
                world, pid = int(match.group(3)), int(match.group(4) or 0)
                latest[item[0]] = (world, pid, float(match.group(1)), item[1])
            return item

        # Both at once, so that both join the first round; is_host picks the one that hosts.
        host = agents.start(launcher.argv("1:2", port, "death", f"{conf},is_host=1", script, done))
        other = agents.start(launcher.argv("1:2", port, "death", f"{conf},is_host=0", script, done))
        deadline = time.monotonic() + LINE_TIMEOUT_S
        while not (latest.get(host, (0,))[0] == 2 and latest.get(other, (0,))[0] == 2):
            if time.monotonic() > deadline or len(agents.exited_at):
                raise BenchError(f"no world of 2 nodes ({agents.stderr_tail()})")
            read(0.05)
        # The kill lands at a different point of the heartbeat period in each repetition.
        settle = time.monotonic() + DEATH_SETTLE_S + (rep % 5) * DEATH_PHASE_STEP_S
        while time.monotonic() < settle:
            read(settle - time.monotonic())
        victim_worker = latest[other][1]
        killed = time.time()
        os.kill(agents.procs[other].pid, signal.SIGKILL)
        bound = time.monotonic() + DEATH_BOUND_S
        recovered, gone_ms = None, None
        while time.monotonic() < bound and (recovered is None or gone_ms is None):
            if gone_ms is None and not _harness.alive(victim_worker):
                gone_ms = (time.time() - killed) * 1e3
            item = read(0.01)
            if (
                recovered is None
                and item is not None
                and item[0] == host
                and latest[host][0] == 1
                and latest[host][2] >= killed
            ):
                recovered = latest[host]
            if agents.procs[host].poll() is not None:
                break
        if gone_ms is None and _harness.alive(victim_worker):
            orphans.append(victim_worker)
        state = ""
        if recovered is None:
            world, pid = latest[host][:2]
            running = "still runs" if _harness.alive(pid) else "is gone"
            state = f"no restart: its world-{world} worker {running} at {DEATH_BOUND_S:g} s; "
        # Let the workers finish (exit 0): relaunch's survivor then leaves its exit barrier and
        # exits 0. Whatever still runs after 5 s is killed, by pid.
        with open(done, "w"):
            pass
        with contextlib.suppress(BenchError):
            agents.wait_all(5.0)
        code = agents.procs[host].poll()
        host_end = state + ("still running 5 s later: killed" if code is None else f"exit {code}")
        if code is not None and code != 0 and launcher.name == RELAUNCH:
            host_end += f" ({agents.stderr_tail(host)})"
    for pid in orphans:  # the killed node's worker, if its launcher left it running
        if _harness.alive(pid):
            _harness.kill_pid(pid)
    if recovered is None:
        return DeathRun(False, None, None, gone_ms, host_end)
    return DeathRun(
        True, (recovered[2] - killed) * 1e3, (recovered[3] - killed) * 1e3, gone_ms, host_end
    )


def bench_death(bench: Bench, reps: int, torchrun_reps: int) -> list[Check]:
    log(
        f"[2/3] SIGKILL of a node -> the survivor's worker again: {reps} repetitions"
        f" (torchrun: {torchrun_reps}), up to {DEATH_BOUND_S:g} s each"
    )
    sides: dict[str, Callable[[int], Any]] = {
        lch.name: lambda rep, lch=lch: death_run(bench, lch, rep) for lch in bench.launchers()
    }
    counts = {side: torchrun_reps if side == TORCHRUN else reps for side in sides}
    errors: dict[str, str] = {}
    samples = _harness.run_alternating(sides, counts, errors, bench.collect)
    print(
        f"\n2. --nnodes 1:2, both agents started at once (is_host=1, is_host=0); SIGKILL of the"
        f"\n   one that does not host the store {DEATH_SETTLE_S:g} s + (rep mod 5) x "
        f"{DEATH_PHASE_STEP_S:g} s after both workers ran in world 2\n   -> the survivor's "
        f"restarted worker printed world 1; ms since the kill, median [min-max];\n   "
        f"bounded at {DEATH_BOUND_S:g} s"
    )
    for name in (RELAUNCH, TORCHRUN):
        print(f"   {name} --rdzv-conf {DEATH_CONF[name]}")
    print(
        f"{'launcher':<9} {'runs':>4} {'recovered':>9} {'printed - kill':>18}"
        f" {'arrived - kill':>18} {'killed worker gone':>19}  survivor at the end"
    )
    checks = []
    for name in (RELAUNCH, TORCHRUN):
        runs: list[DeathRun] = samples.get(name, [])
        if not runs:
            continue
        back = [r for r in runs if r.recovered]
        printed = [r.printed_ms for r in back if r.printed_ms is not None]
        arrived = [r.arrived_ms for r in back if r.arrived_ms is not None]
        gone = [r.worker_gone_ms for r in runs if r.worker_gone_ms is not None]
        gone_col = spread(gone) if len(gone) == len(runs) else f"{len(runs) - len(gone)} alive"
        ends = ", ".join(sorted({r.host_end for r in runs}))
        print(
            f"{name:<9} {len(runs):>4} {len(back):>4} of {len(runs):<2} {spread(printed):>18}"
            f" {spread(arrived):>18} {gone_col:>19}  {ends}"
        )
        if name == RELAUNCH:
            med = median(printed) if len(back) == len(runs) else None
            workers_gone = len(gone) == len(runs) and max(gone) <= WORKER_GONE_S * 1e3
            ok = (
                med is not None
                and med <= DEATH_BUDGET_S * 1e3
                and workers_gone
                and all(r.host_end == "exit 0" for r in runs)
            )
            checks.append(
                Check(
                    "node SIGKILLed -> survivor's worker printed",
                    f"{fmt(med, '.0f')} ms",
                    f"<= {DEATH_BUDGET_S * 1e3:.0f} ms",
                    ok,
                )
            )
            checks.append(
                Check(
                    "killed node's worker gone (max)",
                    f"{fmt(max(gone) if gone else None, '.0f')} ms"
                    if len(gone) == len(runs)
                    else f"{len(runs) - len(gone)} alive",
                    f"<= {WORKER_GONE_S * 1e3:.0f} ms",
                    workers_gone,
                )
            )
    note_errors(bench, errors)
    return checks


# -- 3. N nodes as threads of this process -----------------------------------------------------


class CountingStore:
    """A ``Store`` that counts its calls by operation; everything else passes through."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.counts = dict.fromkeys(SIM_OPS, 0)
        self.joined_at: float | None = None  # perf_counter() when the first add() returned

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _count(self, op: str) -> None:
        self.counts[op] += 1

    def get(self, key: str) -> Any:
        self._count("get")
        return self._inner.get(key)

    def set(self, key: str, value: bytes) -> int:
        self._count("set")
        return self._inner.set(key, value)

    def compare_set(self, key: str, expected_version: int, value: bytes) -> Any:
        self._count("compare_set")
        return self._inner.compare_set(key, expected_version, value)

    def add(self, key: str, amount: int) -> int:
        self._count("add")
        total = self._inner.add(key, amount)
        if self.joined_at is None:
            self.joined_at = time.perf_counter()
        return total

    def delete(self, key: str) -> bool:
        self._count("delete")
        return self._inner.delete(key)

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        self._count("wait")
        return self._inner.wait(keys, timeout)

    def watch(self, key: str, version: int, timeout: float) -> Any:
        self._count("watch")
        return self._inner.watch(key, version, timeout)

    def total(self) -> int:
        return sum(self.counts.values())


@dataclass
class SimRun:
    nodes: int
    seconds: float  # release -> the last next_rendezvous() returned
    joined_s: float  # release -> the last node's join (its add) returned
    first_s: float  # release -> the first next_rendezvous() returned
    connect_s: float  # opening the 2 * N connections (not timed in ``seconds``)
    ops: list[int]  # rendezvous store operations per node
    by_op: dict[str, float]  # mean per node, by operation
    busiest: tuple[int, dict[str, int]]  # the busiest node: group rank, its ops by kind
    hb_ops: list[int]  # heartbeat store operations per node, once the first beat ran
    problems: list[str]  # validation failures


def raise_nofile() -> tuple[int, int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def sim_run(nodes: int, rep: int, stagger: float = 0.0) -> SimRun:
    """One round of ``nodes`` nodes, each a thread: all call next_rendezvous() at once, or, with
    ``stagger``, one after another that many seconds apart."""
    from relaunch.core.rendezvous import Settings
    from relaunch.rendezvous.dynamic import DynamicRendezvousHandler
    from relaunch.store import TcpStore, TcpStoreServer

    server = TcpStoreServer(port=0).start()
    handlers: list[Any] = []
    proxies: list[tuple[CountingStore, CountingStore]] = []
    try:
        settings = Settings(min_nodes=nodes, max_nodes=nodes, join_timeout=60,
                            last_call_timeout=1, keep_alive_interval=30)  # fmt: skip
        started = time.perf_counter()
        for _ in range(nodes):
            store = CountingStore(TcpStore("127.0.0.1", server.port, timeout=60,
                                           connect_timeout=60))  # fmt: skip
            heartbeat = CountingStore(TcpStore("127.0.0.1", server.port, timeout=60,
                                               connect_timeout=60))  # fmt: skip
            proxies.append((store, heartbeat))
            handlers.append(DynamicRendezvousHandler(f"sim{nodes}-{rep}", store, settings,
                                                     SIM_LOCAL_WORLD_SIZE, "127.0.0.1",
                                                     heartbeat))  # fmt: skip
        connect_s = time.perf_counter() - started
        results: list[Any] = [None] * nodes
        ended = [0.0] * nodes
        released: list[float] = []
        barrier = threading.Barrier(nodes, action=lambda: released.append(time.perf_counter()))

        def node(index: int) -> None:
            barrier.wait()
            if stagger:
                time.sleep(max(0.0, released[0] + index * stagger - time.perf_counter()))
            try:
                results[index] = handlers[index].next_rendezvous()
            except Exception as exc:  # reported below, as a validation failure
                results[index] = exc
            ended[index] = time.perf_counter()

        threads = [threading.Thread(target=node, args=(i,), name=f"node{i}") for i in range(nodes)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        t0 = released[0]
        ops = [store.total() for store, _ in proxies]
        by_op = {op: statistics.fmean(s.counts[op] for s, _ in proxies) for op in SIM_OPS}
        worst = max(range(nodes), key=ops.__getitem__)
        rank = getattr(results[worst], "group_rank", -1)
        busiest = (rank, {op: n for op, n in proxies[worst][0].counts.items() if n})
        joined = [s.joined_at for s, _ in proxies if s.joined_at is not None]
        # Every member's heartbeat thread makes its first beat at once (the next one is
        # keep_alive_interval = 30 s away): wait until the counts stay still for 0.2 s.
        settle, still_since, last = time.monotonic() + 10, time.monotonic(), -1
        while time.monotonic() < settle:
            now_total = sum(hb.total() for _, hb in proxies)
            if now_total != last:
                still_since, last = time.monotonic(), now_total
            elif time.monotonic() - still_since > 0.2 and all(hb.total() for _, hb in proxies):
                break
            time.sleep(0.01)
        hb_ops = [hb.total() for _, hb in proxies]
        problems = validate(results, nodes)
        return SimRun(
            nodes,
            max(ended) - t0,
            (max(joined) - t0) if joined else float("nan"),
            min(ended) - t0,
            connect_s,
            ops,
            by_op,
            busiest,
            hb_ops,
            problems,
        )
    finally:
        for handler in handlers:
            handler.shutdown()
        server.stop()


def validate(results: list[Any], nodes: int) -> list[str]:
    problems = [f"node {i}: {r!r}"[:160] for i, r in enumerate(results) if isinstance(r, Exception)]
    infos = [r for r in results if r is not None and not isinstance(r, Exception)]
    if problems or len(infos) != nodes:
        return problems or [f"{nodes - len(infos)} node(s) without a result"]
    lws = SIM_LOCAL_WORLD_SIZE
    if sorted(info.group_rank for info in infos) != list(range(nodes)):
        problems.append("group ranks are not a permutation of 0..N-1")
    if {info.group_world_size for info in infos} != {nodes}:
        problems.append(f"group world sizes {sorted({i.group_world_size for i in infos})}")
    if {info.world_size for info in infos} != {nodes * lws}:
        problems.append(f"world sizes {sorted({i.world_size for i in infos})} != {nodes * lws}")
    if any(info.rank_offset != info.group_rank * lws for info in infos):
        problems.append("rank offsets are not group_rank * local_world_size")
    masters = {(info.master_addr, info.master_port) for info in infos}
    if len(masters) != 1:
        problems.append(f"{len(masters)} different masters")
    return problems


def sim_scenario(
    label: str, sizes: Sequence[int], reps: int, stagger: float, soft_limit: int
) -> tuple[dict[int, list[SimRun]], str | None]:
    runs: dict[int, list[SimRun]] = {}
    for nodes in sizes:
        if 4 * nodes + 64 > soft_limit:
            return runs, f"RLIMIT_NOFILE {soft_limit} is too low for {nodes} nodes"
        for rep in range(reps):
            log(f"  {label}: N={nodes} #{rep + 1}")
            try:
                runs.setdefault(nodes, []).append(sim_run(nodes, rep, stagger))
            except Exception as exc:  # a failure of relaunch's store or rendezvous: report it
                log(f"  {label}, N={nodes}: {type(exc).__name__}: {exc}")
                return runs, f"{label}, N={nodes}: {type(exc).__name__}: {exc}"
    return runs, None


def ops_checks(label: str, runs: dict[int, list[SimRun]], small: int, big: int) -> list[Check]:
    checks = []
    for kind, pick in (("mean", statistics.fmean), ("max", max)):
        if runs.get(small) and runs.get(big):
            at_small = median([pick(s.ops) for s in runs[small]])
            at_big = median([pick(s.ops) for s in runs[big]])
            checks.append(
                Check(
                    f"store ops per node ({kind}), {label}, {big} vs {small}",
                    f"{at_big:.1f} vs {at_small:.1f}",
                    f"<= {SIM_OPS_RATIO:g}x + {SIM_OPS_SLACK}",
                    at_big <= SIM_OPS_RATIO * at_small + SIM_OPS_SLACK,
                )
            )
        else:
            checks.append(Check(f"store ops per node ({kind}), {label}", "-", "-", None))
    return checks


def bench_sim(bench: Bench, reps: int) -> list[Check]:
    soft, hard = raise_nofile()
    log(
        f"[3/3] {' and '.join(map(str, SIM_NODES))} nodes as threads on one store server, "
        f"{reps} repetition(s); then {' and '.join(map(str, STAGGER_NODES))} nodes joining "
        f"{STAGGER_S * 1e3:g} ms apart (RLIMIT_NOFILE {soft}/{hard})"
    )
    at_once, error = sim_scenario("at once", SIM_NODES, reps, 0.0, soft)
    staggered, stagger_error = sim_scenario("one by one", STAGGER_NODES, 1, STAGGER_S, soft)

    print(
        "\n3. N nodes as threads of one process, one TcpStoreServer, 2 connections per node,"
        f"\n   min = max = N, local_world_size {SIM_LOCAL_WORLD_SIZE}; seconds since the release"
        f" (median of {reps} at once, 1 one by one);\n   ops: store operations per node in"
        " next_rendezvous(); busiest: that node's group rank;\n   hb: heartbeat store"
        " operations per node (its first beat)"
    )
    print(
        f"{'arrival':<11} {'N':>5} {'connect':>8} {'all joined':>11} {'first back':>11}"
        f" {'all back':>9} {'<= 10 s':>7} {'ops mean':>9} {'ops max':>8} {'busiest':>8}"
        f" {'hb mean':>8}  valid"
    )
    big = max(SIM_NODES)
    for label, runs in (("at once", at_once), (f"{STAGGER_S * 1e3:g} ms apart", staggered)):
        for nodes, sims in runs.items():
            seconds = median([s.seconds for s in sims])
            shown = verdict(seconds <= SIM_BUDGET_S) if label == "at once" and nodes == big else ""
            print(
                f"{label:<11} {nodes:>5} {median([s.connect_s for s in sims]):>8.2f}"
                f" {median([s.joined_s for s in sims]):>11.3f}"
                f" {median([s.first_s for s in sims]):>11.3f}"
                f" {seconds:>9.3f} {shown:>7}"
                f" {median([statistics.fmean(s.ops) for s in sims]):>9.1f}"
                f" {median([max(s.ops) for s in sims]):>8.0f}"
                f" {sims[-1].busiest[0]:>8}"
                f" {median([statistics.fmean(s.hb_ops) for s in sims]):>8.1f}"
                f"  {'yes' if not any(s.problems for s in sims) else 'NO'}"
            )
    for label, runs in (("at once", at_once), ("one by one", staggered)):
        for nodes, sims in runs.items():
            last = sims[-1]
            parts = ", ".join(f"{op} {last.by_op[op]:.2f}" for op in SIM_OPS if last.by_op[op])
            rank, counts = last.busiest
            mine = ", ".join(f"{op} {n}" for op, n in counts.items())
            print(
                f"  {label}, N={nodes}: mean per node {parts}; busiest (group rank {rank}) {mine}"
            )
            for problem in sorted({p for s in sims for p in s.problems})[:10]:
                print(f"  {label}, N={nodes}: INVALID: {problem}")
    for problem in (error, stagger_error):
        if problem:
            print(f"  not measured: {problem}")

    big_runs = at_once.get(big)
    seconds = median([s.seconds for s in big_runs]) if big_runs else None
    checks = [
        Check(
            f"{big} nodes -> all next_rendezvous() back",
            f"{fmt(seconds, '.2f')} s",
            f"<= {SIM_BUDGET_S:g} s",
            None if seconds is None else seconds <= SIM_BUDGET_S,
        )
    ]
    measured = [s for runs in (at_once, staggered) for sims in runs.values() for s in sims]
    checks.append(
        Check(
            "simulated rounds valid",
            f"{sum(not s.problems for s in measured)} of {len(measured)}",
            "all",
            None if not measured else not any(s.problems for s in measured),
        )
    )
    checks += ops_checks("at once", at_once, min(SIM_NODES), big)
    checks += ops_checks("one by one", staggered, min(STAGGER_NODES), max(STAGGER_NODES))
    return checks


# -- main --------------------------------------------------------------------------------------


def warm_up(bench: Bench) -> None:
    """One untimed single-node c10d run of each launcher: fills the bytecode cache with every
    module the measurements import, and drops a launcher that cannot run at all."""
    for lch in bench.launchers():
        try:
            join_run(bench, lch, 1)
        except (BenchError, OSError) as exc:
            lch.unavailable = f"the warm-up run failed: {exc}"
            log(f"  {lch.name}: {lch.unavailable}")
        bench.collect(lch.name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="relaunch repetitions (1 and 2)")
    parser.add_argument(
        "--torchrun-reps", type=int, default=3, help="torchrun repetitions of measurement 1"
    )
    parser.add_argument(
        "--death-torchrun-reps",
        type=int,
        default=2,
        help=f"torchrun repetitions of measurement 2 (each takes ~{DEATH_BOUND_S + 12:.0f} s)",
    )
    parser.add_argument("--sim-reps", type=int, default=3, help="repetitions per N of 3")
    parser.add_argument(
        "--only",
        action="append",
        choices=("join", "death", "sim"),
        help="run only these measurements (repeatable)",
    )
    _harness.add_launcher_options(
        parser, "run the launchers with the environment's bytecode settings as they are"
    )
    opts = parser.parse_args()
    only = set(opts.only or ("join", "death", "sim"))

    subreaper = _harness.become_subreaper()
    started = time.perf_counter()
    with _harness.temp_dir("relaunch-bench-rdzv-") as tmp:
        env = _harness.prepare(tmp, SCRIPTS, not opts.no_bytecode_cache)
        relaunch, torchrun = _harness.make_launchers(opts, Launcher)
        bench = Bench(tmp, env, relaunch, torchrun)
        _harness.print_header("bench_rendezvous", opts, torchrun.unavailable, subreaper)
        checks: list[Check] = []
        if only & {"join", "death"}:
            log("warm-up: one single-node c10d run of each launcher")
            warm_up(bench)
        if "join" in only:
            checks += bench_join(bench, opts.reps, opts.torchrun_reps)
        if "death" in only:
            checks += bench_death(bench, opts.reps, opts.death_torchrun_reps)
        if "sim" in only:
            checks += bench_sim(bench, opts.sim_reps)
        bench.collect(RELAUNCH)

    ours = bench.leftovers.get(RELAUNCH, [])
    checks.append(Check("relaunch processes left behind", str(len(ours)), "0", not ours))
    _harness.print_summary(checks)
    for side, leftovers in bench.leftovers.items():
        for leftover in leftovers:
            print(f"  left behind by {side} (killed): {leftover}")
    print(f"total time {time.perf_counter() - started:.1f} s")
    return 0 if all(check.ok for check in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
