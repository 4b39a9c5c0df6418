"""The dynamic rendezvous (c10d and etcd): joining, losing a node, N simulated nodes, re-forming.

Run by hand (not part of the test suite): ``python -m benchmarks rendezvous [--quick]``
(``--backends etcd``: the etcd parts alone; ``--only sim``, ``--only reform``: one part).

Four measurements, each on two rendezvous backends: the built-in store (``c10d``) and etcd
(``etcd``, a single-member etcd v3 that the benchmark starts from ``/usr/bin/etcd`` with
tests/etcd_cluster.py and stops at the end). The first two run the ``relaunch`` command on both
backends and, where ``torch`` can be imported, torchrun (``python -m torch.distributed.run``) on
c10d with the same flags (only the heartbeat settings differ, see ``DEATH_CONF``), alternating:
K agents started at once until all K workers run, and a node SIGKILLed until the survivor's
worker runs again. The third runs relaunch's rendezvous for 256, 1,024 and 4,096 nodes as
threads of 8 processes, on real sockets to one store server (a TcpStoreServer in a process of
its own, or the etcd member), all at once and then one by one, and counts the store operations
of each node (and, on etcd, the HTTP requests) and the server's and clients' CPU. The fourth
runs 1,024 such nodes with heartbeats, crashes one (or adds one) and times the re-forming
(tests/support/simnodes.py). Only relaunch's numbers are checked against budgets; torchrun's
are for comparison. Standard library only (plus the etcd binary for the etcd side); the exit
status is 0 when every relaunch budget was measured and holds. See benchmarks/README.md for
what each measurement means.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import re
import resource
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks import harness
from benchmarks.harness import RELAUNCH, TORCHRUN, BenchError, Check, fmt, log, median, verdict
from relaunch.endpoints import find_free_port
from relaunch.runtime import raise_open_file_limit
from relaunch.store import Store
from tests.support.simnodes import (
    Back,
    Reform,
    SimJob,
    check_world,
    summarize,
    wait_beating,
    wait_threads_gone,
)

#: The etcd side: the launcher (``relaunch --rdzv-backend etcd``) is a side of its own.
ETCD = "relaunch-etcd"
BACKENDS = ("c10d", "etcd")
#: How the sides are named in the tables.
LABELS = {RELAUNCH: "relaunch c10d", ETCD: "relaunch etcd", TORCHRUN: "torchrun c10d"}
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
#: relaunch on etcd gets relaunch's settings: its heartbeat is an etcd lease of
#: ceil(interval * max_attempt) = 1 s that the agent renews every 0.5 s.
DEATH_CONF = {
    RELAUNCH: "keep_alive_interval=0.5,keep_alive_max_attempt=2,last_call_timeout=1,"
    "join_timeout=60",
    ETCD: "keep_alive_interval=0.5,keep_alive_max_attempt=2,last_call_timeout=1,join_timeout=60",
    TORCHRUN: "keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1,join_timeout=60",
}
JOIN_CONF = "join_timeout=60"
SIM_NODES = (256, 1024, 4096)
#: Barrier -> every next_rendezvous() returned, by N (a smaller N gets the budget of the next
#: budgeted one up): issue 14.
SIM_BUDGETS = {"c10d": {4096: 5.0}, "etcd": {1024: 5.0, 4096: 20.0}}
#: Simulating N nodes as threads of one process: with the default switch interval (5 ms)
#: every thread waiting for the GIL wakes each 5 ms and CPython's hand-off thrashes (etcd,
#: 1,024 nodes: 46 s and 82 CPU-seconds, against 5.5 s at 0.1 s). Real nodes are processes.
SIM_SWITCH_S = 0.1
SIM_SWITCH_NOTE = (
    f"The simulation runs with sys.setswitchinterval({SIM_SWITCH_S:g}): with thousands of"
    " threads in one process the GIL's 5 ms\n   hand-off thrashes; real nodes are separate"
    " processes."
)
#: Processes the simulated nodes are spread over (at once; one by one: 1), N / SIM_PROCS threads
#: each: fewer threads per interpreter fight less for its GIL, and the store server sees its
#: clients at a pace nearer real nodes' (etcd, 4,096 nodes: 7.6 s and 7.6 etcd CPU-seconds
#: from 8 processes, 47 s and 33 CPU-seconds from one).
SIM_PROCS = 8
SIM_STACK = 1 << 20  # thread stacks of the simulated nodes (and their heartbeat threads)
SIM_LOCAL_WORLD_SIZE = 2
SIM_OPS_RATIO = 1.25  # ops per node at 1024 <= this * ops at 256 + SIM_OPS_SLACK
SIM_OPS_SLACK = 2
STAGGER_NODES = (64, 256)  # the same, with the nodes joining one after another
STAGGER_S = 0.005
#: How long a simulated node waits for its round before it gives up (a stalled round fails).
SIM_JOIN_TIMEOUT = {"c10d": 120.0, "etcd": 600.0}
ETCD_SIM_NODES = SIM_NODES
SIM_OPS = ("get", "set", "compare_set", "add", "delete", "wait", "watch")
#: EtcdStore's own operations: transactions, keys under a prefix
ETCD_OPS = (
    "txn",
    "count_prefix",
    "await_prefix_count",
    "range_prefix",
    "delete_prefix",
)
LEASE_OPS = ("grant_lease", "keep_alive", "revoke_lease")  # EtcdStore's, for the heartbeats
LINE_TIMEOUT_S = 60.0  # give up on launchers that print nothing for this long
REFORM_NODES = (1024,)
# The default keep-alive, dead after 5 s * 3: with 1 s * 3, etcd, sharing this VM's two cores
# with 1,024 simulated nodes, let live leases expire.
REFORM_INTERVAL_S = 5.0
REFORM_MAX_ATTEMPT = 3
REFORM_ROUND_S = 2.0  # beyond the keep-alive detection: every member back (issue 14)
REFORM_TIMEOUT_S = 120.0  # how long a re-forming may take before it counts as failed


STARTED_RE = re.compile(rb"started (\d+(?:\.\d+)?) rank (\d+) world (\d+)(?: pid (\d+))?")


def spread(values: Sequence[float], spec: str = ".0f") -> str:
    """``median [min-max]``, or ``-``."""
    if not values:
        return "-"
    return f"{median(values):.0f} [{min(values):{spec}}-{max(values):{spec}}]"


@dataclass
class Launcher(harness.Launcher):
    """A launcher command line; the flags are torchrun's, passed to both launchers as they are.
    ``backend``: the rendezvous backend this side runs on."""

    backend: str = "c10d"

    def argv(  # type: ignore[override]  # rendezvous flags, not torchrun's
        self, nnodes: str, endpoint: str, run_id: str, conf: str, script: str, *args: str
    ) -> list[str]:
        flags = [
            "--nnodes",
            nnodes,
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            self.backend,
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            run_id,
            "--rdzv-conf",
            conf,
            "--tee",
            "1",
        ]
        return [*self.prefix, *flags, script, *args]


@dataclass
class Bench(harness.Bench[Launcher]):
    """Shared state (see harness.Bench), the etcd side and its cluster, and what was left
    behind."""

    etcd: Launcher = field(default_factory=lambda: Launcher(ETCD, [], "not started", "etcd"))
    backends: tuple[str, ...] = BACKENDS
    cluster: Any = None  # the EtcdCluster, once started
    #: The etcd side against relaunch's budgets: reported, not in the exit status.
    etcd_checks: list[Check] = field(default_factory=list)
    by_side: dict[str, list[str]] = field(default_factory=dict)  # what each side left behind
    _runs: int = 0

    def sides(self) -> list[Launcher]:
        """Every side this run was asked for, measured or not (for the tables)."""
        wanted = [self.relaunch, self.torchrun] if "c10d" in self.backends else []
        if "etcd" in self.backends:
            wanted.insert(1 if wanted else 0, self.etcd)
        return wanted

    def launchers(self) -> list[Launcher]:
        return [lch for lch in self.sides() if lch.unavailable is None]

    def endpoint(self, launcher: Launcher) -> str:
        """Where ``launcher``'s rendezvous is: a free port for c10d, the cluster for etcd."""
        if launcher.backend == "etcd":
            return str(self.cluster.endpoints)
        return f"127.0.0.1:{find_free_port('127.0.0.1')}"

    def keep(self) -> list[int]:
        """Our own children that are not orphans: the etcd members."""
        return list(self.cluster.pids) if self.cluster is not None else []

    def etcd_cpu(self) -> float:
        """CPU seconds the etcd members used so far (they are reaped only at the end, so
        RUSAGE_CHILDREN does not hold them yet)."""
        return sum(proc_cpu(pid) for pid in self.keep())

    def run_dir(self, what: str) -> str:
        """A fresh directory for one run (stderr files, flag files); removed with ``tmp``."""
        self._runs += 1
        return tempfile.mkdtemp(prefix=f"{self._runs:03d}-{what}-", dir=self.tmp)

    def collect(self, side: str = "") -> None:
        """Kill what the last run left behind (but not the etcd members); note it against
        ``side``."""
        if killed := self.leaks():
            self.by_side.setdefault(side, []).extend(killed)


def run_id(launcher: Launcher, what: str) -> str:
    """The --rdzv-id: on etcd a fresh one each run, so that no run meets another's keys."""
    return f"{what}-{uuid.uuid4().hex[:12]}" if launcher.backend == "etcd" else what


def proc_cpu(pid: int) -> float:
    """user + system CPU seconds of ``pid`` (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the etcd member ---------------------------------------------------------------------------


def start_etcd(bench: Bench) -> None:
    """Start a single-member etcd (tests/etcd_cluster.py) for the etcd side; on failure the
    side is not measured, and says why."""
    if not shutil.which("etcd"):
        bench.etcd.unavailable = "no etcd binary on PATH (Debian: apt-get install etcd-server)"
        return
    from tests.etcd_cluster import EtcdCluster

    started = time.perf_counter()
    try:
        bench.cluster = EtcdCluster(1).start()
    except (RuntimeError, OSError) as exc:
        bench.etcd.unavailable = f"etcd did not start: {str(exc).splitlines()[0]}"
        return
    bench.etcd.unavailable = None
    log(
        f"etcd: one member at {bench.cluster.endpoints} (pid {bench.cluster.pids[0]}), started"
        f" in {time.perf_counter() - started:.2f} s"
    )


def stop_etcd(bench: Bench) -> list[Check]:
    """Stop the cluster; check that its members are gone."""
    if bench.cluster is None:
        return []
    pids = bench.keep()
    bench.cluster.stop()
    bench.cluster = None
    left = [pid for pid in pids if harness.alive(pid)]
    for pid in left:
        harness.kill_pid(pid)
    return [Check("etcd members running after the cluster stopped", str(len(left)), "0", not left)]


def etcd_version() -> str:
    try:
        out = subprocess.run(["etcd", "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return out.stdout.splitlines()[0].removeprefix("etcd Version: ") if out.stdout else "?"


# -- processes ---------------------------------------------------------------------------------


class Agents:
    """The launcher processes of one run, each with its stdout on a pipe; their lines are read
    together, each stamped with time.time() when its chunk arrived. Stops them (by pid) at the
    end of the ``with`` block."""

    def __init__(self, bench: Bench, run_dir: str) -> None:
        self.bench, self.run_dir = bench, run_dir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.exited_at: dict[int, float] = {}  # index -> time.perf_counter() at exit
        self._partial: dict[int, bytes] = {}
        self._open: dict[int, int] = {}  # fd -> index
        self._ready: list[tuple[int, float, bytes]] = []

    def __enter__(self) -> Agents:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                harness.kill_pid(proc.pid)
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
        return f"agent {index}: {harness.last_line(self.stderr_file(index))}"

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
    for lch in bench.sides():
        reason = lch.unavailable or errors.get(lch.name)
        if reason is not None:
            print(f"  {lch.name}: not measured ({reason})")


# -- 1. K agents at once -> all K workers running ----------------------------------------------


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def join_run(
    bench: Bench, launcher: Launcher, nodes: int
) -> tuple[float, float, float, float, float]:
    """(every worker printed, every line arrived, every agent exited), in s since the launch,
    the CPU seconds of the agents, their workers and the store (the etcd member's, on etcd),
    and the CPU seconds of the etcd member alone (0 on c10d: one of the agents hosts the store)."""
    run_dir = bench.run_dir(f"join{nodes}-{launcher.name}")
    rdzv_id = run_id(launcher, f"join{nodes}")
    argv = launcher.argv(
        str(nodes), bench.endpoint(launcher), rdzv_id, JOIN_CONF, bench.script("hello.py")
    )
    seen: dict[int, tuple[float, float]] = {}  # rank -> (printed at, arrived at)
    with Agents(bench, run_dir) as agents:
        cpu, store_cpu = children_cpu(), bench.etcd_cpu()
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
    store_cpu = bench.etcd_cpu() - store_cpu
    printed = max(at for at, _ in seen.values()) - launched
    arrived = max(at for _, at in seen.values()) - launched
    return printed, arrived, total, cpu + store_cpu, store_cpu


def bench_join(bench: Bench, reps: int, torchrun_reps: int) -> list[Check]:
    log(
        f"[1/4] K agents at once -> K workers running: K in {JOIN_NODES}, {reps} repetitions"
        f" (torchrun: {torchrun_reps}), alternating; sides: "
        + ", ".join(LABELS[lch.name] for lch in bench.launchers())
    )
    rows = []
    errors: dict[str, str] = {}
    for nodes in JOIN_NODES:
        log(f"  K={nodes}")
        sides: dict[str, Callable[..., Any]] = {
            lch.name: lambda rep, lch=lch, k=nodes: join_run(bench, lch, k)
            for lch in bench.launchers()
        }
        counts = {side: torchrun_reps if side == TORCHRUN else reps for side in sides}
        samples = harness.run_alternating(sides, counts, errors, bench.collect)
        rows.append((nodes, samples))

    print("\n1. K agents started at once (--nnodes K --nproc-per-node 1 --rdzv-backend c10d or")
    print("   etcd), seconds since the launch, medians: printed = the last worker's own time")
    print("   stamp in its first line; arrived = that line reached us through --tee; exited = all")
    print("   agents exited; CPU: CPU seconds of all agents and workers, and of the etcd member on")
    print("   etcd; etcd CPU: the etcd member's share; vs c10d: printed / relaunch c10d printed")
    print(
        f"{'K':>3} {'launcher':<14} {'runs':>4} {'printed':>8} {'arrived':>8} {'exited':>7}"
        f" {'CPU':>5} {'etcd CPU':>8} {'<= 1.5 s':>8} {'vs c10d':>7}"
    )
    checks: list[Check] = []
    for nodes, samples in rows:
        base = median([r[0] for r in samples[RELAUNCH]]) if samples.get(RELAUNCH) else None
        for lch in bench.sides():
            runs = samples.get(lch.name, [])
            cols = [median([r[i] for r in runs]) if runs else None for i in range(5)]
            ours = lch.name != TORCHRUN
            ok = None if cols[0] is None else cols[0] <= JOIN_BUDGET_S
            ratio = None if cols[0] is None or base is None else cols[0] / base
            print(
                f"{nodes:>3} {LABELS[lch.name]:<14} {len(runs):>4} {fmt(cols[0], '.3f'):>8}"
                f" {fmt(cols[1], '.3f'):>8} {fmt(cols[2], '.3f'):>7} {fmt(cols[3], '.2f'):>5}"
                f" {fmt(cols[4], '.2f') if lch.backend == 'etcd' else '':>8}"
                f" {verdict(ok) if ours else '':>8} {fmt(ratio, '.2f'):>7}"
            )
            if ours:
                where = "" if lch.name == RELAUNCH else " on etcd"
                (checks if lch.name == RELAUNCH else bench.etcd_checks).append(
                    Check(
                        f"K={nodes} agents{where} -> all workers printed",
                        f"{fmt(cols[0], '.3f')} s",
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
    endpoint, rdzv_id = bench.endpoint(launcher), run_id(launcher, "death")
    conf = DEATH_CONF[launcher.name]
    # On c10d, is_host picks the agent that hosts the store (the other one is killed); etcd
    # has no host: the second agent is killed.
    host_conf, other_conf = (
        (conf, conf) if launcher.backend == "etcd" else (f"{conf},is_host=1", f"{conf},is_host=0")
    )
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
        host = agents.start(launcher.argv("1:2", endpoint, rdzv_id, host_conf, script, done))
        other = agents.start(launcher.argv("1:2", endpoint, rdzv_id, other_conf, script, done))
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
            if gone_ms is None and not harness.alive(victim_worker):
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
        if gone_ms is None and harness.alive(victim_worker):
            orphans.append(victim_worker)
        state = ""
        if recovered is None:
            world, pid = latest[host][:2]
            running = "still runs" if harness.alive(pid) else "is gone"
            state = f"no restart: its world-{world} worker {running} at {DEATH_BOUND_S:g} s; "
        # Let the workers finish (exit 0): relaunch's survivor then leaves its exit barrier and
        # exits 0. Whatever still runs after 5 s is killed, by pid.
        with open(done, "w"):
            pass
        with contextlib.suppress(BenchError):
            agents.wait_all(5.0)
        code = agents.procs[host].poll()
        host_end = state + ("still running 5 s later: killed" if code is None else f"exit {code}")
        if code is not None and code != 0 and launcher.name != TORCHRUN:
            host_end += f" ({agents.stderr_tail(host)})"
    for pid in orphans:  # the killed node's worker, if its launcher left it running
        if harness.alive(pid):
            harness.kill_pid(pid)
    if recovered is None:
        return DeathRun(False, None, None, gone_ms, host_end)
    return DeathRun(
        True, (recovered[2] - killed) * 1e3, (recovered[3] - killed) * 1e3, gone_ms, host_end
    )


def bench_death(bench: Bench, reps: int, torchrun_reps: int) -> list[Check]:
    log(
        f"[2/4] SIGKILL of a node -> the survivor's worker again: {reps} repetitions"
        f" (torchrun: {torchrun_reps}), up to {DEATH_BOUND_S:g} s each; sides: "
        + ", ".join(LABELS[lch.name] for lch in bench.launchers())
    )
    sides: dict[str, Callable[..., Any]] = {
        lch.name: lambda rep, lch=lch: death_run(bench, lch, rep) for lch in bench.launchers()
    }
    counts = {side: torchrun_reps if side == TORCHRUN else reps for side in sides}
    errors: dict[str, str] = {}
    samples = harness.run_alternating(sides, counts, errors, bench.collect)
    print(
        "\n2. --nnodes 1:2, both agents started at once (c10d: is_host=1, is_host=0); SIGKILL"
        "\n   of the one that does not host the store (etcd: of the second one)"
        f" {DEATH_SETTLE_S:g} s + (rep mod 5) x\n   {DEATH_PHASE_STEP_S:g} s after both workers"
        " ran in world 2 -> the survivor's restarted worker printed\n   world 1; ms since the"
        f" kill, median [min-max]; bounded at {DEATH_BOUND_S:g} s"
    )
    for lch in bench.sides():
        print(f"   {LABELS[lch.name]} --rdzv-conf {DEATH_CONF[lch.name]}")
    print(
        f"{'launcher':<14} {'runs':>4} {'recovered':>9} {'printed - kill':>18}"
        f" {'arrived - kill':>18} {'killed worker gone':>19}  survivor at the end"
    )
    checks: list[Check] = []
    for name in [lch.name for lch in bench.sides()]:
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
            f"{LABELS[name]:<14} {len(runs):>4} {len(back):>4} of {len(runs):<2}"
            f" {spread(printed):>18} {spread(arrived):>18} {gone_col:>19}  {ends}"
        )
        if name != TORCHRUN:
            where, into = ("", checks) if name == RELAUNCH else (" (etcd)", bench.etcd_checks)
            med = median(printed) if len(back) == len(runs) else None
            workers_gone = len(gone) == len(runs) and max(gone) <= WORKER_GONE_S * 1e3
            ok = (
                med is not None
                and med <= DEATH_BUDGET_S * 1e3
                and workers_gone
                and all(r.host_end == "exit 0" for r in runs)
            )
            into.append(
                Check(
                    f"node SIGKILLed{where} -> survivor's worker printed",
                    f"{fmt(med, '.0f')} ms",
                    f"<= {DEATH_BUDGET_S * 1e3:.0f} ms",
                    ok,
                )
            )
            into.append(
                Check(
                    f"killed node's worker gone{where} (max)",
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
    """A ``Store`` that counts its calls by operation; everything else passes through. On etcd
    (an inner store with ``requests``, see counted_etcd_store) it also notes how many
    compare-and-set transactions each ``add`` took: EtcdStore.add is a CAS loop."""

    def __init__(self, inner: Store) -> None:
        self._inner: Any = inner  # a TcpStore, or an EtcdStore with leases and ``requests``
        self.counts = dict.fromkeys(SIM_OPS + LEASE_OPS + ETCD_OPS, 0)
        self.joined_at: float | None = None  # perf_counter() when the first add() returned
        self.cas_tries: list[int] = []  # etcd: transactions per add()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _count(self, op: str) -> None:
        self.counts[op] += 1

    def requests(self, path: str | None = None) -> int | None:
        """HTTP requests of the inner EtcdStore so far (to ``path``, or all); None on c10d."""
        requests: Counter[str] | None = getattr(self._inner, "requests", None)
        if requests is None:
            return None
        return requests[path] if path is not None else sum(requests.values())

    def get(self, key: str) -> Any:
        self._count("get")
        return self._inner.get(key)

    def set(self, key: str, value: bytes, **kwargs: Any) -> int:
        self._count("set")
        return int(self._inner.set(key, value, **kwargs))  # lease= on etcd

    def compare_set(self, key: str, expected_version: int, value: bytes, **kwargs: Any) -> Any:
        self._count("compare_set")
        return self._inner.compare_set(key, expected_version, value, **kwargs)  # also= on etcd

    def add(self, key: str, amount: int) -> int:
        self._count("add")
        before = self.requests("/v3/kv/txn")
        total = int(self._inner.add(key, amount))
        if before is not None:
            self.cas_tries.append((self.requests("/v3/kv/txn") or 0) - before)
        if self.joined_at is None:
            self.joined_at = time.perf_counter()
        return total

    def delete(self, key: str) -> bool:
        self._count("delete")
        return bool(self._inner.delete(key))

    def txn(self, compare: Any, success: Any, failure: Any) -> Any:
        self._count("txn")
        result = self._inner.txn(compare, success, failure)
        if self.joined_at is None:
            self.joined_at = time.perf_counter()
        return result

    def count_prefix(self, prefix: str) -> Any:
        self._count("count_prefix")
        return self._inner.count_prefix(prefix)

    def await_prefix_count(self, prefix: str, at_least: int, timeout: float) -> Any:
        self._count("await_prefix_count")
        return self._inner.await_prefix_count(prefix, at_least, timeout)

    def range_prefix(self, prefix: str, limit: int = 0) -> Any:
        self._count("range_prefix")
        return self._inner.range_prefix(prefix, limit)

    def delete_prefix(self, prefix: str) -> Any:
        self._count("delete_prefix")
        return self._inner.delete_prefix(prefix)

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        self._count("wait")
        self._inner.wait(keys, timeout)

    def watch(self, key: str, version: int, timeout: float) -> Any:
        self._count("watch")
        return self._inner.watch(key, version, timeout)

    def grant_lease(self, ttl: float) -> int:
        self._count("grant_lease")
        return int(self._inner.grant_lease(ttl))

    def keep_alive(self, lease: int) -> bool:
        self._count("keep_alive")
        return bool(self._inner.keep_alive(lease))

    def revoke_lease(self, lease: int) -> None:
        self._count("revoke_lease")
        self._inner.revoke_lease(lease)

    def total(self) -> int:
        return sum(self.counts.values())


@functools.cache
def counted_etcd_class() -> type:
    """EtcdStore, counting its HTTP requests by path; a watch stream counts as one request
    (``/v3/watch``). Nothing else changes."""
    from relaunch.store import EtcdStore

    class CountedEtcdStore(EtcdStore):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.requests: Counter[str] = Counter()
            call = self._gateway.call

            def counted(path: str, body: dict[str, Any]) -> Any:
                self.requests[path] += 1
                return call(path, body)

            setattr(self._gateway, "call", counted)  # noqa: B010 - an instance's method, wrapped

        def open_watch(self, *args: Any) -> Any:
            self.requests["/v3/watch"] += 1
            return super().open_watch(*args)

    return CountedEtcdStore


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
    cpu_s: float = 0.0  # CPU seconds of this process (all threads), release -> all back
    server_cpu_s: float = 0.0  # CPU seconds of the store server (etcd member), the same span
    requests: list[int] = field(default_factory=list)  # etcd: HTTP requests per node
    cas: list[int] = field(default_factory=list)  # etcd: transactions per join (add)
    by_path: dict[str, float] = field(default_factory=dict)  # etcd: requests per node, by path


def raise_nofile() -> tuple[int, int]:
    """The open-file limit raised as far as the hard limit allows: ``(soft, hard)``."""
    return raise_open_file_limit(sys.maxsize)


@contextlib.contextmanager
def simulation() -> Iterator[None]:
    """What simulating many nodes as threads of one process needs: a GIL switch interval of
    SIM_SWITCH_S (see SIM_SWITCH_NOTE) and smaller thread stacks; both restored after."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(SIM_SWITCH_S)
    stack = threading.stack_size(SIM_STACK)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
        threading.stack_size(stack)


#: The built-in store's server as a process of its own, so that its CPU is measured apart from
#: the simulated nodes': it prints its port, and serves until its stdin closes.
SERVER_SCRIPT = """
import sys
from relaunch.store import TcpStoreServer
server = TcpStoreServer(port=0, expected_clients=int(sys.argv[1])).start()
print(server.port, flush=True)
sys.stdin.read()
server.stop()
"""


@contextlib.contextmanager
def store_server(bench: Bench) -> Iterator[tuple[int, int]]:
    """A TcpStoreServer in a process of its own: ``(port, pid)``; stopped after."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER_SCRIPT, str(2 * max(SIM_NODES))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=bench.env,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = proc.stdout.readline()
        if not line.strip().isdigit():
            raise BenchError(f"the store server did not start (printed {line!r})")
        yield int(line), proc.pid
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def sim_store(
    bench: Bench, on_etcd: bool, run: str, counted: bool = True
) -> Iterator[tuple[Callable[[], Any], Callable[[], float]]]:
    """Connections to one store server: ``(connect, server CPU seconds so far)``. On etcd the
    bench's member (``counted``: EtcdStores that count their HTTP requests); else a
    TcpStoreServer in a process of its own."""
    if on_etcd:
        assert bench.cluster is not None
        endpoints = bench.cluster.endpoints
        etcd_store: Any
        if counted:
            etcd_store = counted_etcd_class()
        else:
            from relaunch.store import EtcdStore as etcd_store

        def make_etcd_store() -> Any:
            store = etcd_store(endpoints, timeout=60.0)
            store.get(f"relaunch/{run}/news/closed")  # connects (create_etcd_handler reads it too)
            if counted:
                store.requests.clear()
            return store

        yield make_etcd_store, bench.etcd_cpu
        return
    from relaunch.store import TcpStore

    with store_server(bench) as (port, pid):

        def make_tcp_store() -> Any:
            return TcpStore("127.0.0.1", port, timeout=60, connect_timeout=60)

        yield make_tcp_store, functools.partial(proc_cpu, pid)


@dataclass
class NodeRecord:
    """What one simulated node did (picklable: it may come from a worker process)."""

    result: tuple[int, int, int, int, str, int] | str  # RendezvousInfo's fields, or the error
    ended: float  # perf_counter() when next_rendezvous() returned (CLOCK_MONOTONIC: shared)
    counts: dict[str, int]  # rendezvous store operations, by kind
    joined_at: float | None
    requests: int | None  # etcd: HTTP requests
    by_path: dict[str, int]  # etcd: HTTP requests by path
    cas: list[int]  # etcd: transactions per add
    hb_ops: int = 0  # heartbeat store operations (its first beat)


@dataclass
class Batch:
    """Some of a round's simulated nodes, run by one process: when they were released and
    how much CPU that process used until they were all back."""

    connect_s: float
    released: float
    cpu_s: float
    records: list[NodeRecord]


def run_batch(
    make_store: Callable[[], Any],
    on_etcd: bool,
    run: str,
    settings: Any,
    count: int,
    offset: int,
    stagger: float,
    release: Callable[[], float],
    back: Callable[[], None],
) -> tuple[Batch, Callable[[], None]]:
    """Connect ``count`` nodes; ``release()`` blocks until they go and returns that
    ``perf_counter()``; run them (node ``offset + i`` starts ``(offset + i) * stagger`` late);
    ``back()`` once all are back. The batch, and what shuts its handlers down."""
    from relaunch.rendezvous.dynamic import DynamicRendezvousHandler

    handlers: list[Any] = []
    proxies: list[tuple[CountingStore, CountingStore, CountingStore | None]] = []

    def shutdown() -> None:
        for handler in handlers:
            handler.shutdown()

    try:
        started = time.perf_counter()
        for _ in range(count):
            store, heartbeat = CountingStore(make_store()), CountingStore(make_store())
            # etcd: the store the node's feed of the job's news follows (its one watch)
            watch = CountingStore(make_store()) if on_etcd else None
            proxies.append((store, heartbeat, watch))
            handlers.append(
                DynamicRendezvousHandler(
                    run,
                    store,
                    settings,
                    SIM_LOCAL_WORLD_SIZE,
                    "127.0.0.1",
                    heartbeat,
                    backend="etcd" if on_etcd else "c10d",
                    watch_store=watch,
                    leases=on_etcd,
                )
            )
        connect_s = time.perf_counter() - started
        results: list[Any] = [None] * count
        ended = [0.0] * count
        go = threading.Event()
        released: list[float] = []

        def node(index: int) -> None:
            go.wait()
            if stagger:
                wait = released[0] + (offset + index) * stagger - time.perf_counter()
                time.sleep(max(0.0, wait))
            try:
                info = handlers[index].next_rendezvous()
                results[index] = (
                    info.group_rank,
                    info.group_world_size,
                    info.world_size,
                    info.rank_offset,
                    info.master_addr,
                    info.master_port,
                )
            except Exception as exc:  # reported as a validation failure
                results[index] = f"{exc!r}"[:160]
            ended[index] = time.perf_counter()

        threads = [
            threading.Thread(target=node, args=(i,), name=f"node{offset + i}") for i in range(count)
        ]
        for thread in threads:
            thread.start()
        released.append(release())
        cpu_at = time.process_time()
        go.set()
        for thread in threads:
            thread.join()
        cpu_s = time.process_time() - cpu_at
        back()
        # Every member's heartbeat thread makes its first beat at once (the next one is
        # keep_alive_interval = 30 s away): wait until the counts stay still for 0.5 s.
        settle, still_since, last = time.monotonic() + 60, time.monotonic(), -1
        while time.monotonic() < settle:
            now_total = sum(hb.total() for _, hb, _ in proxies)
            if now_total != last:
                still_since, last = time.monotonic(), now_total
            elif time.monotonic() - still_since > 0.5 and all(hb.total() for _, hb, _ in proxies):
                break
            time.sleep(0.01)
        records = [
            NodeRecord(
                results[i],
                ended[i],
                {op: n for op, n in store.counts.items() if n},
                store.joined_at,
                requests_of(store, watch),
                dict(
                    Counter(getattr(store._inner, "requests", {}))
                    + Counter(getattr(getattr(watch, "_inner", None), "requests", {}))
                ),
                store.cas_tries,
                heartbeat.total(),
            )
            for i, (store, heartbeat, watch) in enumerate(proxies)
        ]
        return Batch(connect_s, released[0], cpu_s, records), shutdown
    except BaseException:
        shutdown()
        raise


def requests_of(store: CountingStore, watch: CountingStore | None) -> int | None:
    """The HTTP requests of a node's rendezvous store and its feed's store (None on c10d)."""
    requests = store.requests()
    if watch is None or requests is None:
        return requests
    return requests + (watch.requests() or 0)


#: run_batch's arguments up to ``stagger``
BatchArgs = tuple[Callable[[], Any], bool, str, Any, int, int, float]


def sim_worker(conn: Any, args: BatchArgs) -> None:
    """A worker process of a spread simulation (forked): runs one batch, talking to the parent
    over ``conn``: "ready" -> release time; "back" (its CPU); the batch; "end" -> shut down."""
    cpu: list[float] = []

    def release() -> float:
        conn.send("ready")
        at = float(conn.recv())
        time.sleep(max(0.0, at - time.perf_counter()))
        return at

    try:
        with simulation():
            batch, shutdown = run_batch(*args, release, lambda: conn.send("back"))
            cpu.append(batch.cpu_s)
            conn.send(batch)
            conn.recv()  # "end": every batch is in
            shutdown()
    except BaseException as exc:
        conn.send(f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def sim_run(
    bench: Bench, on_etcd: bool, nodes: int, rep: int, stagger: float = 0.0, procs: int = 1
) -> SimRun:
    """One round of ``nodes`` nodes, each a thread: all call next_rendezvous() at once, or, with
    ``stagger``, one after another that many seconds apart. On etcd, on the bench's cluster
    (EtcdStores, heartbeats by lease); else on a TcpStoreServer in a process of its own. With
    ``procs`` > 1 the nodes are spread over that many forked processes."""
    from relaunch.core.rendezvous import Settings

    backend = "etcd" if on_etcd else "c10d"
    run = f"sim{nodes}-{rep}-{uuid.uuid4().hex[:12]}"
    settings = Settings(
        min_nodes=nodes,
        max_nodes=nodes,
        join_timeout=SIM_JOIN_TIMEOUT[backend],
        last_call_timeout=1,
        keep_alive_interval=30,
    )
    procs = max(1, min(procs, nodes))
    with sim_store(bench, on_etcd, run) as (make_store, server_cpu):
        server_at: list[float] = []
        if procs == 1:

            def release() -> float:
                server_at.append(server_cpu())
                return time.perf_counter()

            def all_back() -> None:
                server_at.append(server_cpu())

            batch, shutdown = run_batch(
                make_store, on_etcd, run, settings, nodes, 0, stagger, release, all_back
            )
            shutdown()
            batches = [batch]
        else:
            batches = spread_run(
                make_store, on_etcd, run, settings, nodes, stagger, procs, server_cpu, server_at
            )
    return sim_result(nodes, batches, server_at[1] - server_at[0])


def spread_run(
    make_store: Callable[[], Any],
    on_etcd: bool,
    run: str,
    settings: Any,
    nodes: int,
    stagger: float,
    procs: int,
    server_cpu: Callable[[], float],
    server_at: list[float],
) -> list[Batch]:
    """Run the round's nodes in ``procs`` forked processes, released together."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    sizes = [nodes // procs + (1 if i < nodes % procs else 0) for i in range(procs)]
    offsets = [sum(sizes[:i]) for i in range(procs)]
    workers = []
    try:
        for size, offset in zip(sizes, offsets, strict=True):
            parent, child = context.Pipe()
            args: BatchArgs = (make_store, on_etcd, run, settings, size, offset, stagger)
            proc = context.Process(target=sim_worker, args=(child, args), daemon=True)
            proc.start()
            child.close()
            workers.append((proc, parent))

        def expect(what: str) -> list[Any]:
            got = [conn.recv() for _, conn in workers]
            wrong = (
                [g for g in got if g != what] if what else [g for g in got if isinstance(g, str)]
            )
            if wrong:
                raise BenchError(f"a worker process failed: {wrong[0]}")
            return got

        expect("ready")
        release_at = time.perf_counter() + 0.05 + 0.002 * procs
        server_at.append(server_cpu())
        for _, conn in workers:
            conn.send(release_at)
        expect("back")
        server_at.append(server_cpu())
        batches: list[Batch] = expect("")
        for _, conn in workers:
            conn.send("end")
        return batches
    finally:
        for proc, conn in workers:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
                proc.join()
            conn.close()


def sim_result(nodes: int, batches: list[Batch], server_cpu_s: float) -> SimRun:
    """The round's figures from its batches."""
    records = [r for b in batches for r in b.records]
    t0 = min(b.released for b in batches)
    ops = [sum(r.counts.values()) for r in records]
    by_op = {
        op: statistics.fmean(r.counts.get(op, 0) for r in records) for op in SIM_OPS + ETCD_OPS
    }
    worst = max(range(nodes), key=ops.__getitem__)
    result = records[worst].result
    busiest = (result[0] if isinstance(result, tuple) else -1, records[worst].counts)
    joined = [r.joined_at for r in records if r.joined_at is not None]
    on_etcd = any(r.requests is not None for r in records)
    paths = sorted({p for r in records for p in r.by_path})
    ended = [r.ended for r in records]
    return SimRun(
        nodes,
        max(ended) - t0,
        (max(joined) - t0) if joined else float("nan"),
        min(ended) - t0,
        max(b.connect_s for b in batches),
        ops,
        by_op,
        busiest,
        [r.hb_ops for r in records],
        validate([r.result for r in records], nodes),
        sum(b.cpu_s for b in batches),
        server_cpu_s,
        [r.requests or 0 for r in records] if on_etcd else [],
        [n for r in records for n in r.cas],
        {p: statistics.fmean(r.by_path.get(p, 0) for r in records) for p in paths},
    )


def fmean0(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def validate(results: list[Any], nodes: int) -> list[str]:
    problems = [f"node {i}: {r}"[:160] for i, r in enumerate(results) if isinstance(r, str)]
    infos = [r for r in results if isinstance(r, tuple)]
    if problems or len(infos) != nodes:
        return problems or [f"{nodes - len(infos)} node(s) without a result"]
    lws = SIM_LOCAL_WORLD_SIZE
    if sorted(info[0] for info in infos) != list(range(nodes)):
        problems.append("group ranks are not a permutation of 0..N-1")
    if {info[1] for info in infos} != {nodes}:
        problems.append(f"group world sizes {sorted({i[1] for i in infos})}")
    if {info[2] for info in infos} != {nodes * lws}:
        problems.append(f"world sizes {sorted({i[2] for i in infos})} != {nodes * lws}")
    if any(info[3] != info[0] * lws for info in infos):
        problems.append("rank offsets are not group_rank * local_world_size")
    masters = {(info[4], info[5]) for info in infos}
    if len(masters) != 1:
        problems.append(f"{len(masters)} different masters")
    return problems


def sim_budget(store: str, nodes: int) -> float | None:
    """The budget for ``nodes`` at once on ``store``: that of the smallest budgeted N at or
    above it (a smaller job must meet it too); None beyond the largest."""
    fits = [(n, s) for n, s in SIM_BUDGETS[store].items() if n >= nodes]
    return min(fits)[1] if fits else None


def sim_scenario(
    bench: Bench,
    label: str,
    sizes: Sequence[int],
    reps: int,
    stagger: float,
    soft_limit: int,
    on_etcd: bool,
    procs: int = 1,
) -> tuple[dict[int, list[SimRun]], str | None]:
    runs: dict[int, list[SimRun]] = {}
    store = "etcd" if on_etcd else "c10d"
    for nodes in sizes:
        # 2 connections a node (the server is another process); on etcd also a watch stream
        if (3 if on_etcd else 2) * nodes + 256 > soft_limit:
            return runs, f"RLIMIT_NOFILE {soft_limit} is too low for {nodes} nodes"
        for rep in range(reps):
            log(f"  {store}, {label}: N={nodes} #{rep + 1}")
            try:
                sim = sim_run(bench, on_etcd, nodes, rep, stagger, procs)
                runs.setdefault(nodes, []).append(sim)
            except Exception as exc:  # a failure of relaunch's store or rendezvous: report it
                log(f"  {store}, {label}, N={nodes}: {type(exc).__name__}: {exc}")
                return runs, f"{store}, {label}, N={nodes}: {type(exc).__name__}: {exc}"
            sim = runs[nodes][-1]
            log(
                f"    all back {sim.seconds:.2f} s, {statistics.fmean(sim.ops):.1f} ops/node"
                f", CPU {sim.cpu_s:.1f} s (server {sim.server_cpu_s:.1f} s)"
                + (
                    f", {statistics.fmean(sim.requests):.1f} requests/node, "
                    f"{statistics.fmean(sim.cas or [0]):.1f} CAS tries/join"
                    if sim.requests
                    else ""
                )
            )
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


@dataclass
class SimResults:
    """One store's simulated rounds: at once and one by one, and why any was not measured."""

    store: str
    at_once: dict[int, list[SimRun]]
    staggered: dict[int, list[SimRun]]
    errors: list[str]
    reps: int


def print_sim_table(results: list[SimResults]) -> None:
    """The figures, as a Markdown table (one row per store, arrival and N; medians)."""
    print(
        "| N | backend | arrival | all back (s) | budget | ops/node mean (max) |"
        " requests/node mean (max) | server CPU (s) | client CPU (s) |"
    )
    print("|--:|---|---|--:|---|--:|--:|--:|--:|")
    for res in results:
        for label, runs in (("at once", res.at_once), ("one by one", res.staggered)):
            for nodes, sims in sorted(runs.items()):
                seconds = median([s.seconds for s in sims])
                budget = sim_budget(res.store, nodes) if label == "at once" else None
                verdict_text = (
                    f"<= {budget:g} s {verdict(seconds <= budget)}" if budget is not None else "-"
                )
                requests = (
                    f"{median([statistics.fmean(s.requests) for s in sims]):.1f}"
                    f" ({median([max(s.requests) for s in sims]):.0f})"
                    if res.store == "etcd"
                    else "-"
                )
                invalid = "" if not any(s.problems for s in sims) else " INVALID"
                print(
                    f"| {nodes:,} | {res.store} | {label} | {seconds:.2f}{invalid}"
                    f" | {verdict_text}"
                    f" | {median([statistics.fmean(s.ops) for s in sims]):.1f}"
                    f" ({median([max(s.ops) for s in sims]):.0f})"
                    f" | {requests}"
                    f" | {median([s.server_cpu_s for s in sims]):.2f}"
                    f" | {median([s.cpu_s for s in sims]):.2f} |"
                )


def bench_sim(
    bench: Bench,
    reps: int,
    etcd_reps: int,
    etcd_sizes: Sequence[int],
    procs: int = 1,
) -> list[Check]:
    soft, hard = raise_nofile()
    stores = [b for b in BACKENDS if b in bench.backends]
    log(
        f"[3/4] N nodes as threads on one store server ({', '.join(stores)}): N in "
        f"{tuple(SIM_NODES)}, {reps} repetition(s) (etcd: {etcd_reps}, N in "
        f"{tuple(etcd_sizes)}); then {' and '.join(map(str, STAGGER_NODES))} nodes joining "
        f"{STAGGER_S * 1e3:g} ms apart (RLIMIT_NOFILE {soft}/{hard})"
    )
    results: list[SimResults] = []
    with simulation():
        for store in stores:
            if store == "etcd" and bench.etcd.unavailable is not None:
                results.append(SimResults(store, {}, {}, [f"etcd: {bench.etcd.unavailable}"], 0))
                continue
            on_etcd = store == "etcd"
            sizes, n = (etcd_sizes, etcd_reps) if on_etcd else (SIM_NODES, reps)
            at_once, error = sim_scenario(bench, "at once", sizes, n, 0.0, soft, on_etcd, procs)
            staggered, stagger_error = sim_scenario(
                bench, "one by one", STAGGER_NODES, 1, STAGGER_S, soft, on_etcd
            )
            errors = [e for e in (error, stagger_error) if e]
            results.append(SimResults(store, at_once, staggered, errors, n))

    print(
        f"\n3. N nodes as threads of {procs} forked processes (one by one: of one), one store"
        " server (c10d: a TcpStoreServer in a"
        "\n   process of its own; etcd: the etcd member), 2 connections per node, min = max = N,"
        f" local_world_size {SIM_LOCAL_WORLD_SIZE};\n   all back: seconds from the release"
        f" until every next_rendezvous() returned (median of {reps} at once, etcd"
        f" {etcd_reps};\n   1 one by one, {STAGGER_S * 1e3:g} ms apart); ops: store operations"
        " per node in next_rendezvous(); requests:\n   HTTP requests per node (etcd, a watch"
        " stream counting one); CPU: the store server's (etcd member's)\n   and this process's"
        f" (every node), release -> all back.\n   {SIM_SWITCH_NOTE}\n"
    )
    print_sim_table(results)
    print(
        "\n   more: connect = opening the connections (untimed); all joined = the last join"
        " returned;\n   busiest = that node's group rank; hb = heartbeat store operations per"
        " node (its first beat);\n   CAS/join: etcd transactions per join"
    )
    print(
        f"{'store':<5} {'arrival':<11} {'N':>5} {'connect':>8} {'all joined':>11}"
        f" {'first back':>11} {'all back':>9} {'busiest':>8} {'hb mean':>8} {'CAS/join':>9}"
        f" {'CAS max':>8} {'req/s':>7}  valid"
    )
    for res in results:
        for label, runs in (
            ("at once", res.at_once),
            (f"{STAGGER_S * 1e3:g} ms apart", res.staggered),
        ):
            for nodes, sims in sorted(runs.items()):
                etcd = res.store == "etcd"
                req = [s.requests if etcd else s.ops for s in sims]
                rate = median([sum(r) / s.seconds for r, s in zip(req, sims, strict=True)])
                cas_mean = median([fmean0(s.cas) for s in sims])
                cas_max = median([max(s.cas or [0]) for s in sims])
                print(
                    f"{res.store:<5} {label:<11} {nodes:>5}"
                    f" {median([s.connect_s for s in sims]):>8.2f}"
                    f" {median([s.joined_s for s in sims]):>11.3f}"
                    f" {median([s.first_s for s in sims]):>11.3f}"
                    f" {median([s.seconds for s in sims]):>9.3f}"
                    f" {sims[-1].busiest[0]:>8}"
                    f" {median([statistics.fmean(s.hb_ops) for s in sims]):>8.1f}"
                    f" {fmt(cas_mean if etcd else None):>9}"
                    f" {fmt(cas_max if etcd else None, '.0f'):>8}"
                    f" {rate:>7.0f}"
                    f"  {'yes' if not any(s.problems for s in sims) else 'NO'}"
                )
    for res in results:
        for label, runs in (("at once", res.at_once), ("one by one", res.staggered)):
            for nodes, sims in sorted(runs.items()):
                last = sims[-1]
                parts = ", ".join(f"{op} {n:.2f}" for op, n in last.by_op.items() if n)
                rank, counts = last.busiest
                mine = ", ".join(f"{op} {n}" for op, n in counts.items())
                print(
                    f"  {res.store}, {label}, N={nodes}: mean per node {parts}; busiest (group"
                    f" rank {rank}) {mine}"
                )
                if last.by_path:
                    paths = ", ".join(
                        f"{path.removeprefix('/v3/')} {n:.2f}" for path, n in last.by_path.items()
                    )
                    print(f"  {res.store}, {label}, N={nodes}: HTTP requests per node: {paths}")
                for problem in sorted({p for s in sims for p in s.problems})[:10]:
                    print(f"  {res.store}, {label}, N={nodes}: INVALID: {problem}")
        for problem in res.errors:
            print(f"  not measured: {problem}")

    # Budgets: in the exit status on both stores; etcd's only noted when there is no etcd to
    # run on (like torchrun without torch).
    checks: list[Check] = []
    for res in results:
        where = f" ({res.store})"
        absent = res.store == "etcd" and bench.etcd.unavailable is not None
        into = bench.etcd_checks if absent else checks
        sizes = sorted(res.at_once) or sorted(etcd_sizes if res.store == "etcd" else SIM_NODES)
        for nodes in sizes:
            budget = sim_budget(res.store, nodes)
            if budget is None:
                continue
            timed = res.at_once.get(nodes)
            seconds = median([s.seconds for s in timed]) if timed else None
            into.append(
                Check(
                    f"{nodes} nodes at once -> all next_rendezvous() back{where}",
                    f"{fmt(seconds, '.2f')} s",
                    f"<= {budget:g} s",
                    None if seconds is None else seconds <= budget,
                )
            )
        measured = [
            s for runs in (res.at_once, res.staggered) for sims in runs.values() for s in sims
        ]
        into.append(
            Check(
                f"simulated rounds valid{where}",
                f"{sum(not s.problems for s in measured)} of {len(measured)}",
                "all",
                None if not measured or res.errors else not any(s.problems for s in measured),
            )
        )
        if len(sizes) > 1:
            into += ops_checks(f"at once{where}", res.at_once, sizes[0], sizes[-1])
        into += ops_checks(
            f"one by one{where}", res.staggered, min(STAGGER_NODES), max(STAGGER_NODES)
        )
    return checks


# -- 4. re-forming at scale: one node of N lost, one node joining N ----------------------------


@dataclass
class ReformResult:
    """One re-forming measured (``reform`` None: it could not be), with its bounds."""

    store: str
    event: str  # "lost" or "joined"
    nodes: int  # nodes running before the event
    detection_s: float  # the keep-alive detection bound (lost_node_grace); 0 for a join
    formed_s: float | None  # the first round: release -> all back
    reform: Reform | None
    problems: list[str]
    server_cpu_s: float | None = None  # event -> all back: the store server, or etcd
    client_cpu_s: float | None = None  # the same span: the simulating processes


def reform_settings(event: str, nodes: int, join_timeout: float) -> Any:
    """``lost``: min N - 1, max N (the survivors may re-form); ``joined``: min N, max N + 1
    (room for one more)."""
    from relaunch.core.rendezvous import Settings

    low, high = (nodes - 1, nodes) if event == "lost" else (nodes, nodes + 1)
    return Settings(
        min_nodes=low,
        max_nodes=high,
        join_timeout=join_timeout,
        last_call_timeout=1,
        keep_alive_interval=REFORM_INTERVAL_S,
        keep_alive_max_attempt=REFORM_MAX_ATTEMPT,
    )


@dataclass
class NodeView:
    """A simulated node as a worker process reports it (picklable; see simnodes.NodeLike)."""

    index: int
    backs: list[Back]
    notified: list[float]
    called: list[float]


def reform_worker(
    conn: Any, job_args: tuple[str, Any, Callable[[], Any], bool], first: int
) -> None:
    """A worker process of the re-form measurement (forked): a SimJob whose nodes are numbered
    from ``first``, driven by the parent's commands over ``conn`` (see ReformWorkers)."""
    run, settings, make_store, leases = job_args
    closed = False
    with simulation():
        job = SimJob(run, settings, make_store, leases, SIM_LOCAL_WORLD_SIZE)
        try:
            while True:
                command, arg = conn.recv()
                if command == "add":
                    job.add(arg)
                    reply: Any = len(job.nodes)
                elif command == "go":  # at perf_counter() ``arg``, every node not started yet
                    time.sleep(max(0.0, arg - time.perf_counter()))
                    fresh = [n for n in job.nodes if n.thread is None]
                    job.start(fresh, barrier=len(fresh) > 1)
                    reply = None
                elif command == "backs":
                    reply = (job.total_backs, job.errors())
                elif command == "views":
                    reply = [
                        NodeView(
                            first + n.index,
                            [Back(b.at, dataclasses.replace(b.info, store=None)) for b in n.backs],
                            list(n.notified),
                            list(n.called),
                        )
                        for n in job.nodes
                    ]
                elif command == "kill":
                    reply = job.kill(job.nodes[arg - first])
                elif command == "stop":  # nodes stuck in a round that never forms stay: 10 s
                    job.stop(10.0)
                    reply = None
                elif command == "close":
                    closed = True
                    conn.send(job.close(10.0) + wait_threads_gone(10.0))
                    return
                else:
                    reply = f"unknown command {command!r}"
                conn.send(reply)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                conn.send(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            if not closed:
                job.close(10.0)
            conn.close()


class ReformWorkers:
    """The nodes of one re-form job, spread over ``procs`` forked worker processes."""

    def __init__(self, job: SimJob, procs: int, nodes: int) -> None:
        import multiprocessing

        context = multiprocessing.get_context("fork")
        self.job = job  # this process's view: keys, observers; it runs no node
        sizes = [nodes // procs + (1 if i < nodes % procs else 0) for i in range(procs)]
        self.firsts = [sum(sizes[:i]) for i in range(procs)]
        self.sizes = sizes
        self.workers: list[tuple[Any, Any]] = []
        args = (job.run_id, job.settings, job.make_store, job.leases)
        for first in self.firsts:
            parent, child = context.Pipe()
            proc = context.Process(target=reform_worker, args=(child, args, first), daemon=True)
            proc.start()
            child.close()
            self.workers.append((proc, parent))

    def ask(self, command: str, arg: Any = None, only: int | None = None) -> list[Any]:
        """Send ``command`` to every worker (or worker ``only``); their replies."""
        chosen = self.workers if only is None else [self.workers[only]]
        for _, conn in chosen:
            conn.send((command, arg))
        replies = [conn.recv() for _, conn in chosen]
        for reply in replies:
            if isinstance(reply, str):
                raise BenchError(f"a worker process failed: {reply}")
        return replies

    def owner(self, index: int) -> int:
        return max(w for w, first in enumerate(self.firsts) if first <= index)

    def wait_backs(self, total: int, timeout: float) -> list[str]:
        """Wait until the nodes returned ``total`` times in all; the errors (a timeout too)."""
        deadline = time.monotonic() + timeout
        while True:
            replies = self.ask("backs")
            errors = [e for _, errs in replies for e in errs]
            if errors or sum(n for n, _ in replies) >= total:
                return errors
            if time.monotonic() > deadline:
                return [f"not back within {timeout:g}s"]
            time.sleep(0.05)

    def views(self) -> list[NodeView]:
        return [view for views in self.ask("views") for view in views]

    def cpu(self) -> float:
        """CPU seconds the worker processes used so far."""
        return sum(proc_cpu(proc.pid) for proc, _ in self.workers)

    def close(self) -> list[str]:
        left: list[str] = []
        with contextlib.suppress(OSError, EOFError, BenchError):
            self.ask("stop")  # every node stops before any handler shuts down
        for proc, conn in self.workers:
            try:
                conn.send(("close", None))
                left += conn.recv() if conn.poll(60) else ["(no answer)"]
            except (OSError, EOFError):
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
                left.append(f"worker {proc.pid} killed")
            conn.close()
        self.job.close(10.0)
        return left


def reform_run(
    bench: Bench, on_etcd: bool, event: str, nodes: int, procs: int = SIM_PROCS
) -> ReformResult:
    """N nodes (threads of ``procs`` processes) form a round; then one crashes (``lost``), or
    one more joins (``joined``), and every member that hears of it calls next_rendezvous()
    again, as the agent does."""
    store = "etcd" if on_etcd else "c10d"
    run = f"reform-{event}{nodes}-{uuid.uuid4().hex[:12]}"
    join_timeout = SIM_JOIN_TIMEOUT[store]
    settings = reform_settings(event, nodes, join_timeout)
    detection = 0.0
    if event == "lost":  # the handler's own bound: its lease granularity included on etcd
        from relaunch.rendezvous.dynamic import DynamicRendezvousHandler
        from relaunch.store import MemoryStore

        memory = MemoryStore()
        probe = DynamicRendezvousHandler(
            run, memory, settings, 1, "127.0.0.1", memory, leases=on_etcd
        )
        detection = probe.lost_node_grace
    with sim_store(bench, on_etcd, run, counted=False) as (make_store, server_cpu):
        job = SimJob(run, settings, make_store, on_etcd, SIM_LOCAL_WORLD_SIZE)
        workers = ReformWorkers(job, max(1, min(procs, nodes)), nodes)
        try:
            for w, size in enumerate(workers.sizes):
                workers.ask("add", size, only=w)
            started = time.perf_counter()
            workers.ask("go", time.perf_counter() + 0.05)
            errors = workers.wait_backs(nodes, join_timeout)
            views = workers.views()
            formed_s = max((v.backs[0].at for v in views if v.backs), default=started) - started
            problems = errors or check_world(
                [v.backs[0].info for v in views], nodes, SIM_LOCAL_WORLD_SIZE
            )
            if problems:
                return ReformResult(store, event, nodes, detection, None, None, problems)
            log(f"    first round of {nodes} back in {formed_s:.2f} s (connections included)")
            wanted = {v.index: len(v.backs) + 1 for v in views}
            seen = job.observe_changed(job.current_round(), detection + REFORM_TIMEOUT_S)
            cpu_before = (server_cpu(), workers.cpu())
            if event == "lost":
                victim = next(v for v in views if v.backs[0].info.group_rank == nodes // 2)
                if not wait_beating(job, victim, 60.0):
                    return ReformResult(
                        store, event, nodes, detection, formed_s, None, ["no heartbeat"]
                    )
                (t0,) = workers.ask("kill", victim.index, only=workers.owner(victim.index))
                del wanted[victim.index]
                errors = workers.wait_backs(nodes + nodes - 1, detection + REFORM_TIMEOUT_S)
            else:  # the last worker's next node: numbered N
                late, last = nodes, len(workers.workers) - 1
                workers.ask("add", 1, only=last)
                workers.ask("go", 0.0, only=last)
                wanted[late] = 1
                errors = workers.wait_backs(nodes + nodes + 1, REFORM_TIMEOUT_S)
            server_cpu_s, client_cpu_s = server_cpu() - cpu_before[0], workers.cpu() - cpu_before[1]
            if errors:
                log(f"    {len(errors)} error(s), the first: {errors[0]}")
            views = workers.views()
            members = [v for v in views if v.index in wanted]
            if event == "joined":
                t0 = next(v for v in views if v.index == late).called[0]
            reform = summarize(event, t0, members, wanted, seen, errors, SIM_LOCAL_WORLD_SIZE)
            return ReformResult(
                store,
                event,
                nodes,
                detection,
                formed_s,
                reform,
                reform.problems,
                server_cpu_s,
                client_cpu_s,
            )
        finally:
            left = workers.close()
            if left:
                log(f"    left running after the job closed: {sorted(set(left))[:5]}")


def reform_budget(res: ReformResult) -> float:
    """Event -> every member back: the keep-alive detection plus REFORM_ROUND_S."""
    return res.detection_s + REFORM_ROUND_S


def bench_reform(bench: Bench, sizes: Sequence[int], procs: int = SIM_PROCS) -> list[Check]:
    soft, hard = raise_nofile()
    stores = [b for b in BACKENDS if b in bench.backends]
    log(
        f"[4/4] re-forming: N in {tuple(sizes)} nodes as threads ({', '.join(stores)}), one"
        f" crashed, then one joining (RLIMIT_NOFILE {soft}/{hard})"
    )
    results: list[ReformResult] = []
    errors: list[str] = []
    with simulation():
        for store in stores:
            if store == "etcd" and bench.etcd.unavailable is not None:
                errors.append(f"etcd: {bench.etcd.unavailable}")
                continue
            for nodes in sizes:
                if 3 * nodes + 256 > soft:
                    errors.append(f"RLIMIT_NOFILE {soft} is too low for {nodes} nodes")
                    continue
                for event in ("lost", "joined"):
                    log(f"  {store}, N={nodes}: one node {event}")
                    try:
                        res = reform_run(bench, store == "etcd", event, nodes, procs)
                    except Exception as exc:  # a failure of relaunch: report it
                        errors.append(f"{store}, N={nodes}, {event}: {type(exc).__name__}: {exc}")
                        log(f"    {errors[-1]}")
                        continue
                    results.append(res)
                    r = res.reform
                    log(
                        f"    all back {fmt(r.all_back if r else None, '.2f')} s after the"
                        f" {'crash' if event == 'lost' else 'call'}; {res.problems or 'valid'}"
                    )

    print(
        f"\n4. Re-forming at scale: N nodes as threads of {procs} forked processes (each a"
        " DynamicRendezvousHandler with its"
        f"\n   rendezvous, heartbeat and watch stores, leases on etcd), keep_alive_interval"
        f" {REFORM_INTERVAL_S:g} s,\n   keep_alive_max_attempt {REFORM_MAX_ATTEMPT},"
        f" local_world_size {SIM_LOCAL_WORLD_SIZE}. lost: min N-1, max N; the node of group"
        " rank N/2\n   crashes"
        " (its stores fail every call from then on: no clean-up, no lease revoked), and its"
        "\n   ring neighbour must see its heartbeat stop. joined: min N, max N+1; one more node"
        " calls\n   next_rendezvous(). Every member hearing of the change (its change listener)"
        " calls next_rendezvous()\n   again, as the agent does. Seconds since the crash (the"
        " new node's call): changed = the round's\n   `changed` record seen written (by a"
        " watcher of our own), notified = a member's listener called,\n   all back = the last"
        " member's next_rendezvous() returned with the new world. Budget: detection\n   (the"
        " handler's lost_node_grace: interval * max_attempt + one beat, on etcd rounded up to"
        " the lease's\n   whole seconds + 1 s; 0 for a join) + 2 s. Worker restart is not"
        " simulated: measurement 2 (death)\n   times it with real agents, SIGKILL -> the"
        " survivor's worker running again. CPU seconds from the event to all back: the"
        " store\n   server (or etcd) and the simulating processes (for a crash, the"
        f" heartbeats of the detection too).\n   {SIM_SWITCH_NOTE}\n"
    )
    print(
        "| N | backend | event | detection bound | changed | first notified | last notified"
        " | all back | budget | round (all back - changed) | server CPU | client CPU |"
    )
    print("|--:|---|---|--:|--:|--:|--:|--:|---|--:|--:|--:|")
    checks: list[Check] = []
    for res in results:
        r = res.reform
        budget = reform_budget(res)
        back = r.all_back if r else None
        ok = None if back is None else back <= budget and not res.problems
        round_s = back - r.changed if r and back is not None and r.changed is not None else None
        label = f"1 of {res.nodes} lost" if res.event == "lost" else f"1 joins {res.nodes}"
        print(
            f"| {res.nodes:,} | {res.store} | {label} | {res.detection_s:.1f}"
            f" | {fmt(r.changed if r else None, '.2f')}"
            f" | {fmt(r.first_notified if r else None, '.2f')}"
            f" | {fmt(r.last_notified if r else None, '.2f')}"
            f" | {fmt(back, '.2f')} | <= {budget:g} s {verdict(ok)} | {fmt(round_s, '.2f')}"
            f" | {fmt(res.server_cpu_s, '.2f')} | {fmt(res.client_cpu_s, '.2f')} |"
        )
        checks.append(
            Check(
                f"{label} -> all back ({res.store})",
                f"{fmt(back, '.2f')} s",
                f"<= {res.detection_s:g} + {REFORM_ROUND_S:g} s",
                ok,
            )
        )
        if res.event == "lost":
            checks.append(
                Check(
                    f"{label}: changed written -> all back ({res.store})",
                    f"{fmt(round_s, '.2f')} s",
                    f"<= {REFORM_ROUND_S:g} s",
                    None if round_s is None else round_s <= REFORM_ROUND_S,
                )
            )
        for problem in res.problems[:10]:
            print(f"  {res.store}, {label}: INVALID: {problem}")
    for error in errors:
        print(f"  not measured: {error}")
        checks.append(Check(f"re-forming: {error}"[:90], "-", "-", None))
    return checks


# -- main --------------------------------------------------------------------------------------


def warm_up(bench: Bench) -> None:
    """One untimed single-node run of each launcher (on its backend): fills the bytecode cache
    with every module the measurements import, and drops a launcher that cannot run at all."""
    for lch in bench.launchers():
        try:
            join_run(bench, lch, 1)
        except (BenchError, OSError) as exc:
            lch.unavailable = f"the warm-up run failed: {exc}"
            log(f"  {lch.name}: {lch.unavailable}")
        bench.collect(lch.name)


def backend_list(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in BACKENDS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a comma-separated list of {', '.join(BACKENDS)}"
        )
    return names


def node_list(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(n) for n in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected node counts, e.g. 256,1024")
    return sizes


QUICK = {
    "reps": 1,
    "torchrun_reps": 1,
    "death_torchrun_reps": 1,
    "sim_reps": 1,
    "join_nodes": (2, 4),
    "sim_nodes": (64, 256),
    "stagger_nodes": (16, 64),
    "etcd_sim_nodes": (64, 256),
    "reform_nodes": (64,),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument("--sim-reps", type=int, default=3, help="repetitions per N of 3 (c10d)")
    parser.add_argument(
        "--etcd-sim-reps",
        type=int,
        default=1,
        help="repetitions per N of 3 on etcd",
    )
    parser.add_argument(
        "--etcd-sim-nodes",
        type=node_list,
        default=",".join(map(str, ETCD_SIM_NODES)),
        help="N of 3 on etcd, at once (default: %(default)s)",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=("join", "death", "sim", "reform"),
        help="run only these measurements (repeatable)",
    )
    parser.add_argument(
        "--backends",
        type=backend_list,
        default=BACKENDS,
        help="rendezvous backends to measure, comma-separated: c10d (with torchrun), etcd "
        "(default: c10d,etcd; etcd alone: --backends etcd)",
    )
    parser.add_argument(
        "--join-nodes", type=node_list, default=JOIN_NODES, help="K of 1 (default: 2,4,8)"
    )
    parser.add_argument(
        "--sim-nodes",
        type=node_list,
        default=",".join(map(str, SIM_NODES)),
        help="N of 3 on c10d, at once (default: %(default)s)",
    )
    parser.add_argument(
        "--sim-procs",
        type=int,
        default=SIM_PROCS,
        help="spread the nodes of 3 (at once) over this many processes (default: %(default)s)",
    )
    parser.add_argument(
        "--reform-nodes",
        type=node_list,
        default=",".join(map(str, REFORM_NODES)),
        help="N of 4, re-forming (default: %(default)s)",
    )
    parser.add_argument(
        "--stagger-nodes",
        type=node_list,
        default=STAGGER_NODES,
        help="N of 3, one by one (default: 64,256)",
    )


def run(ctx: harness.Context) -> list[Check]:
    global JOIN_NODES, SIM_NODES, STAGGER_NODES
    opts = ctx.opts
    JOIN_NODES, SIM_NODES, STAGGER_NODES = opts.join_nodes, opts.sim_nodes, opts.stagger_nodes
    only = set(opts.only or ("join", "death", "sim", "reform"))
    checks: list[Check] = []
    relaunch, torchrun = ctx.launchers(Launcher)
    if "c10d" not in opts.backends:
        torchrun.unavailable = f"--backends {','.join(opts.backends)}"
    etcd = Launcher(ETCD, relaunch.prefix, "not started", "etcd")
    bench = ctx.bench(Bench, relaunch, torchrun, etcd=etcd, backends=opts.backends)
    try:
        if "etcd" in opts.backends:
            start_etcd(bench)
            where = (
                f"one member at {bench.cluster.endpoints} (tests/etcd_cluster.py)"
                if bench.cluster is not None
                else f"not run: {etcd.unavailable}"
            )
            print(f"  etcd: {etcd_version()}, {where}")
        if only & {"join", "death"}:
            log("warm-up: one single-node run of each launcher")
            warm_up(bench)
        if "join" in only:
            checks += bench_join(bench, opts.reps, opts.torchrun_reps)
        if "death" in only:
            checks += bench_death(bench, opts.reps, opts.death_torchrun_reps)
        if "sim" in only:
            checks += bench_sim(
                bench, opts.sim_reps, opts.etcd_sim_reps, opts.etcd_sim_nodes, opts.sim_procs
            )
        if "reform" in only:
            checks += bench_reform(bench, opts.reform_nodes, opts.sim_procs)
        bench.collect(RELAUNCH)
    finally:
        checks += stop_etcd(bench)
    bench.collect(ETCD if "c10d" not in opts.backends else RELAUNCH)
    # Only relaunch's leftovers fail the run; torchrun's are shown.
    ours = [item for side in (RELAUNCH, ETCD) for item in bench.by_side.get(side, [])]
    ctx.leftovers[:] = ours
    if bench.etcd_checks:
        harness.print_summary(
            bench.etcd_checks,
            "etcd side, against the same budgets (for comparison, not in the exit status)",
        )
    for leftover in bench.by_side.get(TORCHRUN, []):
        print(f"  left behind by torchrun (killed): {leftover}")
    return checks
