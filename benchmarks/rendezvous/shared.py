"""What the measurements of ``python -m benchmarks rendezvous`` (and ``spares``) share: the
sides (relaunch on c10d and on etcd, torchrun on c10d), the etcd member, and the launcher
processes of one run, their lines read together."""

from __future__ import annotations

import os
import re
import select
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks import harness
from benchmarks.harness import RELAUNCH, TORCHRUN, BenchError, Check, log, median
from relaunch.endpoints import find_free_port

#: The etcd side: the launcher (``relaunch --rdzv-backend etcd``) is a side of its own.
ETCD = "relaunch-etcd"
BACKENDS = ("c10d", "etcd")
#: How the sides are named in the tables.
LABELS = {RELAUNCH: "relaunch c10d", ETCD: "relaunch etcd", TORCHRUN: "torchrun c10d"}

LINE_TIMEOUT_S = 60.0  # give up on launchers that print nothing for this long

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
