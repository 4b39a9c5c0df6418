"""Chaos runs: kill a worker or a whole node of a relaunch job at a random moment, and check.

Run by hand (the test suite runs a short version, tests/chaos/test_chaos.py)::

    python benchmarks/chaos.py --runs 60 --seed 1
    python benchmarks/chaos.py --runs 10 --seed 7 --no-etcd --topologies single,c10d
    python benchmarks/chaos.py --seed 7 --only 3,5 --keep     # rerun runs 3 and 5 of seed 7

Each run starts a job of plain-Python workers (this file, run as ``chaos.py worker``) under the
``relaunch`` command in one of three topologies: one node (``single``), two nodes on the
built-in store (``c10d``), two nodes on etcd (``etcd``, a single-member etcd that the harness
starts with tests/etcd_cluster.py). Once the chosen target has done a chosen number of steps, it
injects one fault: SIGKILL, SIGTERM or SIGSEGV to a worker, an exit code that the worker itself
exits with, or SIGKILL to a whole node (the agent; on c10d never the node that hosts the store,
since the job dies with that node by design). Then it checks:

- **survived**: every agent still alive exits 0, and every rank of the final world wrote the
  right result (the workers compute a known value over ``--steps`` steps, resuming from a
  checkpoint after a restart, so the value does not depend on failures);
- **leaks**: no process of the run is alive 5 s after its agents exited (each one carries
  ``RELAUNCH_TEST_MARK=<a mark of the run>`` in its environment; leftovers are killed by pid);
- **lost lines**: every line a worker wrote to its stdout is in its log file
  (``--log-dir``/``<run>/attempt_<n>/<local rank>/stdout.log``). A worker writes each line to
  stdout first and then to a file of its own: that file is the ground truth. The workers of a
  SIGKILLed node are not checked (their agent, which writes their logs, is dead);
- **report**: the failure report names the fault: for a worker fault, the root cause (rank,
  pid, ``killed by SIGKILL (signal 9)`` / ``exited with code 3``) and the run summary's
  ``restart N: rank R ...`` line, on the node of the worker; for a node fault, the summary
  line ``restart N: node of group rank G lost`` on the surviving node.

The choices (topology and fault, the target, the step, the exit code) come from a seeded random
generator: the same ``--seed`` gives the same runs. Standard library only (plus the etcd binary
for the etcd topology). The exit status is 0 only when every check of every run passed.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS_DIR = os.path.join(os.path.dirname(HERE), "tests")
THIS_FILE = os.path.abspath(__file__)

MARK_VAR = "RELAUNCH_TEST_MARK"  # the variable tests/conftest.py's LeakCheck uses
NPROC = 2  # workers per node
MAX_RESTARTS = 3
STEPS = 30  # steps of the job
STEP_S = 0.03  # each worker sleeps this long after each step
ITEMS = 64  # items summed per step, split between the ranks
EXIT_CODES = (1, 3, 42)
#: The rendezvous settings of the multi-node topologies: a node counts as lost 0.6 s after its
#: last heartbeat. ``last_call_timeout`` is long so that the two agents, started together,
#: always form their first world together (the round completes as soon as both joined).
RDZV_CONF = "keep_alive_interval=0.2,keep_alive_max_attempt=3,last_call_timeout=5,join_timeout=20"
RUN_TIMEOUT_S = 60.0  # from the start of the agents to their end
LEAK_GRACE_S = 5.0  # what may still run after the agents exited (conftest.LeakCheck's 5 s)

FAULTS = ("SIGKILL", "SIGTERM", "SIGSEGV", "exit", "node")
WORKER_SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM, "SIGSEGV": signal.SIGSEGV}


@dataclass(frozen=True)
class Topology:
    name: str
    nodes: int
    backend: str  # static, c10d or etcd
    #: The nodes a node fault may kill: not the c10d host (node 0), whose death ends the job.
    killable: tuple[int, ...]


TOPOLOGIES = {
    "single": Topology("single", 1, "static", ()),
    "c10d": Topology("c10d", 2, "c10d", (1,)),
    "etcd": Topology("etcd", 2, "etcd", (0, 1)),
}


# -- the job: what the workers compute ---------------------------------------------------------


def item(i: int) -> int:
    return (i * 2654435761) % 4294967291


def advance(value: int, total: int) -> int:
    return (value * 6364136223846793005 + total + 1442695040888963407) % (1 << 64)


def expected_value(steps: int = STEPS, items: int = ITEMS) -> int:
    """What every rank holds after ``steps`` steps, whatever the failures and world sizes."""
    value = 0
    for k in range(steps):
        value = advance(value, sum(item(i) for i in range(k * items, (k + 1) * items)))
    return value


def _hang(reason: str) -> None:
    """What a collective does when a peer dies: never return (relaunch must stop us)."""
    os.write(2, f"chaos worker {os.getpid()}: {reason}; waiting to be stopped\n".encode())
    while True:
        time.sleep(3600)


class _Peers:
    """A blocking all-reduce among the ranks of one world, over TCP: rank 0 serves at
    ``MASTER_ADDR:MASTER_PORT`` (as torch's store would) and sums what each rank sends."""

    def __init__(self, rank: int, world: int, addr: str, port: int) -> None:
        self.rank, self.world = rank, world
        self.files: dict[int, Any] = {}
        self._keep: list[socket.socket] = []
        if world == 1:
            return
        if rank == 0:
            server = socket.create_server((addr, port), backlog=world)
            self._keep.append(server)
            while len(self.files) < world - 1:
                conn, _ = server.accept()
                self._keep.append(conn)
                file = conn.makefile("rwb")
                hello = file.readline().split()
                if len(hello) == 2 and hello[0] == b"hello":
                    self.files[int(hello[1])] = file
            return
        while True:  # rank 0 may not listen yet
            try:
                conn = socket.create_connection((addr, port))
                break
            except OSError:
                time.sleep(0.01)
        self._keep.append(conn)
        self.files[0] = conn.makefile("rwb")
        self._send(0, f"hello {rank}")

    def _send(self, rank: int, text: str) -> None:
        try:
            self.files[rank].write(text.encode() + b"\n")
            self.files[rank].flush()
        except OSError as exc:
            _hang(f"lost rank {rank}: {exc}")

    def _recv(self, rank: int) -> list[str]:
        try:
            line = self.files[rank].readline()
        except OSError as exc:
            _hang(f"lost rank {rank}: {exc}")
        if not line:
            _hang(f"lost rank {rank}")
        return line.decode().split()

    def start(self, step: int, value: int) -> tuple[int, int]:
        """Rank 0's checkpoint, for every rank."""
        if self.rank == 0:
            for rank in self.files:
                self._send(rank, f"{step} {value}")
            return step, value
        fields = self._recv(0)
        return int(fields[0]), int(fields[1])

    def allreduce(self, step: int, part: int) -> int:
        if self.rank == 0:
            total = part
            for rank in sorted(self.files):
                fields = self._recv(rank)
                if int(fields[0]) != step:
                    _hang(f"rank {rank} is at step {fields[0]}, not {step}")
                total += int(fields[1])
            for rank in self.files:
                self._send(rank, str(total))
            return total
        self._send(0, f"{step} {part}")
        return int(self._recv(0)[0])


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as file:
        file.write(text)
    os.replace(tmp, path)


def worker_main() -> int:
    """One worker of the job: ``STEPS`` steps of an all-reduce, a checkpoint after each (rank
    0), one line per step on stdout and in its own file, the result in ``results/<rank>``; and
    a child process that never exits by itself."""
    env = os.environ
    top = env["CHAOS_DIR"]
    steps, step_s = int(env["CHAOS_STEPS"]), float(env["CHAOS_STEP_S"])
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    pid = os.getpid()
    meta = {
        "node": int(env["CHAOS_NODE"]),
        "attempt": int(env["TORCHELASTIC_RESTART_COUNT"]),
        "local_rank": int(env["LOCAL_RANK"]),
        "rank": rank,
        "world": world,
        "group_rank": int(env["GROUP_RANK"]),
        "pid": pid,
        "log_dir": os.path.dirname(env["TORCHELASTIC_ERROR_FILE"]),
    }
    _write_atomic(os.path.join(top, "workers", f"{pid}.json"), json.dumps(meta))
    if os.fork() == 0:  # a helper, like a data loader, that relaunch must stop with the worker
        while True:  # it keeps the worker's stdout and stderr open, and outlives the worker
            time.sleep(3600)
    truth = os.open(os.path.join(top, "lines", str(pid)), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    trigger = os.path.join(top, "triggers", str(pid))
    checkpoint = os.path.join(top, "checkpoint")
    peers = _Peers(rank, world, env["MASTER_ADDR"], int(env["MASTER_PORT"]))
    step, value = 0, 0
    if rank == 0 and os.path.exists(checkpoint):
        with open(checkpoint) as file:
            step, value = map(int, file.read().split())
    step, value = peers.start(step, value)
    while step < steps:
        if os.path.exists(trigger):  # an injected exit code
            with open(trigger) as file:
                return int(file.read())
        part = sum(item(i) for i in range(step * ITEMS, (step + 1) * ITEMS) if i % world == rank)
        value = advance(value, peers.allreduce(step, part))
        step += 1
        if rank == 0:
            _write_atomic(checkpoint, f"{step} {value}")
        line = f"rank {rank} pid {pid} step {step} value {value}\n".encode()
        os.write(1, line)  # stdout first: a line in the truth file is a line printed
        os.write(truth, line)
        time.sleep(step_s)
    _write_atomic(os.path.join(top, "results", str(rank)), f"{value} {world} {pid}")
    return 0


# -- plans: which fault, where, when -----------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    index: int
    topology: str
    fault: str  # one of FAULTS
    node: int  # the target node (for a worker fault: the node of the worker)
    local_rank: int  # the target worker (worker faults)
    step: int  # inject once the target has done this many steps
    code: int  # the exit code (fault "exit")

    @property
    def what(self) -> str:
        if self.fault == "node":
            return f"SIGKILL to node {self.node} (its agent)"
        fault = f"exit code {self.code}" if self.fault == "exit" else self.fault
        return f"{fault} to node {self.node} local rank {self.local_rank}"

    def label(self) -> str:
        return f"{self.index}-{self.topology}-{self.fault}"


def combinations(topologies: Sequence[str]) -> list[tuple[str, str]]:
    return [
        (name, fault)
        for name in topologies
        for fault in FAULTS
        if fault != "node" or TOPOLOGIES[name].killable
    ]


def plan_runs(seed: int, runs: int, topologies: Sequence[str] = tuple(TOPOLOGIES)) -> list[Plan]:
    """``runs`` plans from ``seed``. Each round takes every (topology, fault) pair once, in a
    random order that covers every fault and every topology as early as it can (so that a few
    runs already try each); the target, the step and the exit code are drawn for each run."""
    rng = random.Random(seed)
    pairs = combinations(topologies)
    all_faults = {fault for _, fault in pairs}
    order: list[tuple[str, str]] = []
    while len(order) < runs and pairs:
        pool = list(pairs)
        rng.shuffle(pool)
        faults_seen: set[str] = set()
        seen: set[str] = set()  # topologies
        while pool:
            pick = max(pool, key=lambda p: (p[1] not in faults_seen) + (p[0] not in seen))
            pool.remove(pick)
            order.append(pick)
            faults_seen.add(pick[1])
            seen.add(pick[0])
            if faults_seen == all_faults and seen == set(topologies):
                faults_seen, seen = set(), set()
    plans = []
    for index, (name, fault) in enumerate(order[:runs]):
        draw = random.Random(f"{seed}-{index}")  # a run's draws depend on its number alone
        topology = TOPOLOGIES[name]
        node = draw.randrange(topology.nodes)
        killed = draw.choice(topology.killable) if topology.killable else 0
        local_rank = draw.randrange(NPROC)
        step = draw.randint(0, STEPS - 6)  # 0: as soon as the target has started
        code = draw.choice(EXIT_CODES)
        plans.append(
            Plan(index, name, fault, killed if fault == "node" else node, local_rank, step, code)
        )
    return plans


# -- one run -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    plan: Plan
    run_dir: str
    seconds: float = 0.0
    error: str = ""  # the harness could not do its part (a timeout, a fault not injected)
    target: str = ""  # e.g. "rank 3 pid 1234"
    exits: list[int | None] = field(default_factory=list)
    exit_ok: bool = False
    result_ok: bool = False
    result_note: str = ""
    leaked: list[str] = field(default_factory=list)
    lines: int = 0  # lines checked
    lost: list[str] = field(default_factory=list)  # lines missing from the log files
    console_lost: int = 0  # of the checked lines, missing from the agents' stdout (the tee)
    unchecked: int = 0  # lines of the killed node's workers
    report_ok: bool = False
    report_note: str = ""
    restarts: list[int] = field(default_factory=list)  # per node, from its run summary
    recovery: float | None = None  # fault -> the last agent exited

    @property
    def survived(self) -> bool:
        return not self.error and self.exit_ok and self.result_ok

    @property
    def ok(self) -> bool:
        return self.survived and not self.leaked and not self.lost and self.report_ok

    def problems(self) -> list[str]:
        found = []
        if self.error:
            found.append(self.error)
        if not self.exit_ok:
            found.append(f"exit statuses {self.exits}")
        if not self.result_ok:
            found.append(f"result: {self.result_note}")
        if self.leaked:
            found.append(f"{len(self.leaked)} process(es) left behind: " + "; ".join(self.leaked))
        if self.lost:
            found.append(
                f"{len(self.lost)} of {self.lines} line(s) lost from the log files, "
                "e.g. " + "; ".join(self.lost[:3])
            )
        if not self.report_ok:
            found.append(f"report: {self.report_note}")
        return found

    def line(self) -> str:
        plan = self.plan
        status = "ok" if self.ok else "FAIL"
        exits = ",".join("-" if code is None else str(code) for code in self.exits)
        return (
            f"run {plan.index:3d} {plan.topology:<6} {plan.what} ({self.target}) after "
            f"{plan.step} steps: {status}; exits {exits}, result "
            f"{'ok' if self.result_ok else 'WRONG'}, leaked {len(self.leaked)}, lost "
            f"{len(self.lost)}/{self.lines}, report {'ok' if self.report_ok else 'WRONG'}, "
            f"restarts {'+'.join(map(str, self.restarts))}, {self.seconds:.1f}s"
        )

    def explain(self, tails: bool = True) -> str:
        """What went wrong, where the run's files are, and (``tails``) the agents' stderr."""
        text = [
            self.line(),
            *(f"  - {problem}" for problem in self.problems()),
            f"  run directory: {self.run_dir}",
        ]
        for path in sorted(glob.glob(os.path.join(self.run_dir, "node*.err"))) if tails else ():
            text.append(f"  --- {os.path.basename(path)} (agent stderr, last 40 lines) ---")
            text.extend("  " + line for line in _tail(path, 40))
        return "\n".join(text)


def _tail(path: str, count: int) -> list[str]:
    try:
        with open(path, errors="replace") as file:
            return file.read().splitlines()[-count:]
    except OSError as exc:
        return [f"<{exc}>"]


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as file:
            return file.read()
    except OSError:
        return ""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _alive(pid: int) -> bool:
    """Running: a zombie counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as file:
        return file.read().replace(b"\0", b" ").decode(errors="replace").strip()
    return "?"


def marked_pids(mark: str) -> list[int]:
    """Live processes whose environment carries ``RELAUNCH_TEST_MARK=mark``."""
    needle = f"{MARK_VAR}={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as file:
                environ = file.read()
        except OSError:
            continue
        if needle in environ.split(b"\0") and _alive(int(entry)):
            found.append(int(entry))
    return found


def collect_leaks(mark: str, grace: float = LEAK_GRACE_S) -> list[str]:
    """Processes of the run still alive ``grace`` seconds from now: killed by pid, described."""
    deadline = time.monotonic() + grace
    left = marked_pids(mark)
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = marked_pids(mark)
    described = [f"pid {pid} {_cmdline(pid)[:100]}" for pid in left]
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return described


class _Timeout(Exception):
    pass


def _wait(condition: Callable[[], object], deadline: float, what: str) -> None:
    """Wait for ``condition()``, checked every few ms, until ``deadline`` (monotonic)."""
    delay = 0.001
    while not condition():
        if time.monotonic() > deadline:
            raise _Timeout(f"timed out waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


def _count_lines(path: str) -> int:
    try:
        with open(path, "rb") as file:
            return file.read().count(b"\n")
    except OSError:
        return 0


def describe_fault(plan: Plan) -> str:
    """How relaunch must describe the end of the target worker."""
    if plan.fault == "exit":
        return f"exited with code {plan.code}"
    sig = WORKER_SIGNALS[plan.fault]
    return f"killed by {sig.name} (signal {int(sig)})"


class Run:
    """One run of ``plan``: start the agents, inject the fault, wait for the end, check."""

    def __init__(
        self,
        plan: Plan,
        base_dir: str,
        etcd_endpoints: str = "",
        mark: str | None = None,
        steps: int = STEPS,
        timeout: float = RUN_TIMEOUT_S,
    ) -> None:
        self.plan = plan
        self.topology = TOPOLOGIES[plan.topology]
        self.dir = os.path.join(base_dir, f"run{plan.index:03d}")
        self.etcd_endpoints = etcd_endpoints
        self.mark = mark or uuid.uuid4().hex
        self.steps = steps
        self.timeout = timeout
        self.agents: list[subprocess.Popen[bytes]] = []
        self.target_meta: dict[str, int] = {}  # the target worker's, once it is chosen
        self.outcome = Outcome(plan, self.dir)

    # -- paths --

    def path(self, *parts: str) -> str:
        return os.path.join(self.dir, *parts)

    def metas(self) -> list[dict[str, int]]:
        found = []
        for path in glob.glob(self.path("workers", "*.json")):
            with contextlib.suppress(OSError, ValueError):
                found.append(json.loads(_read(path)))
        return found

    # -- the agents --

    def rdzv_flags(self, node: int, run_id: str, port: int) -> list[str]:
        backend = self.topology.backend
        if backend == "static":
            return []
        flags = [
            "--nnodes",
            f"1:{self.topology.nodes}",
            "--rdzv-backend",
            backend,
            "--rdzv-id",
            run_id,
        ]
        if backend == "c10d":
            host = "1" if node == 0 else "0"
            return [
                *flags,
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-conf",
                f"{RDZV_CONF},is_host={host}",
            ]
        return [*flags, "--rdzv-endpoint", self.etcd_endpoints, "--rdzv-conf", RDZV_CONF]

    def start_agents(self) -> None:
        for sub in ("workers", "lines", "triggers", "results"):
            os.makedirs(self.path(sub))
        env = {
            **os.environ,
            MARK_VAR: self.mark,
            "CHAOS_DIR": self.dir,
            "CHAOS_STEPS": str(self.steps),
            "CHAOS_STEP_S": str(STEP_S),
        }
        run_id = f"chaos-{uuid.uuid4().hex[:12]}"
        port = _free_port()
        for node in range(self.topology.nodes):
            argv = [
                sys.executable,
                "-m",
                "relaunch",
                "--nproc-per-node",
                str(NPROC),
                "--max-restarts",
                str(MAX_RESTARTS),
                "--tee",
                "3",
                "--log-dir",
                self.path("logs", f"node{node}"),
                *self.rdzv_flags(node, run_id, port),
                THIS_FILE,
                "worker",
            ]
            with (
                open(self.path(f"node{node}.out"), "wb") as out,
                open(self.path(f"node{node}.err"), "wb") as err,
            ):
                self.agents.append(
                    subprocess.Popen(
                        argv,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=err,
                        env={**env, "CHAOS_NODE": str(node)},
                    )
                )

    def inject(self, deadline: float) -> float:
        """Wait for the moment, inject the fault; the time it was injected."""
        plan, full = self.plan, NPROC * self.topology.nodes
        local = 0 if plan.fault == "node" else plan.local_rank

        def target() -> dict[str, int] | None:
            for meta in self.metas():
                if (meta["node"], meta["local_rank"], meta["world"]) == (
                    plan.node,
                    local,
                    full,
                ) and _alive(meta["pid"]):
                    return meta
            return None

        _wait(
            lambda: len([m for m in self.metas() if m["world"] == full]) >= full,
            deadline,
            f"all {full} workers to start in one world",
        )
        _wait(target, deadline, "the target worker")
        meta = target()
        assert meta is not None
        pid = meta["pid"]
        self.outcome.target = f"rank {meta['rank']} pid {pid}"
        if plan.fault == "node":
            agent = self.agents[plan.node].pid
            self.outcome.target = f"group rank {meta['group_rank']}, agent pid {agent}"
        self.target_meta = meta
        truth = self.path("lines", str(pid))
        _wait(
            lambda: _count_lines(truth) >= plan.step or not _alive(pid),
            deadline,
            f"the target (pid {pid}) to do {plan.step} steps",
        )
        if not _alive(pid):
            raise _Timeout(f"the target (pid {pid}) ended before the fault was injected")
        if plan.fault == "node":
            self.agents[plan.node].send_signal(signal.SIGKILL)
        elif plan.fault == "exit":
            _write_atomic(self.path("triggers", str(pid)), str(plan.code))
        else:
            os.kill(pid, WORKER_SIGNALS[plan.fault])
        return time.monotonic()

    def execute(self) -> Outcome:
        started = time.monotonic()
        deadline = started + self.timeout
        injected: float | None = None
        out = self.outcome
        try:
            self.start_agents()
            injected = self.inject(deadline)
            for agent in self.agents:
                agent.wait(timeout=max(0.0, deadline - time.monotonic()))
        except (_Timeout, subprocess.TimeoutExpired) as exc:
            out.error = (
                str(exc)
                if isinstance(exc, _Timeout)
                else (f"the agents did not exit within {self.timeout:g}s")
            )
        finally:
            for agent in self.agents:
                if agent.poll() is None:
                    agent.kill()
                agent.wait()
        out.seconds = time.monotonic() - started
        if injected is not None and not out.error:
            out.recovery = time.monotonic() - injected
        out.exits = [agent.returncode for agent in self.agents]
        out.leaked = collect_leaks(self.mark)
        self.check()
        return out

    # -- the checks --

    def killed_node(self) -> int | None:
        return self.plan.node if self.plan.fault == "node" else None

    def check(self) -> None:
        out, killed = self.outcome, self.killed_node()
        out.exit_ok = bool(self.agents) and all(
            code == 0 for node, code in enumerate(out.exits) if node != killed
        )
        self.check_result()
        self.check_lines()
        self.check_report()

    def check_result(self) -> None:
        out = self.outcome
        nodes = self.topology.nodes - (1 if self.killed_node() is not None else 0)
        world = NPROC * nodes
        want = expected_value(self.steps)
        wrong = []
        for rank in range(world):
            text = _read(self.path("results", str(rank))).split()
            if not text:
                wrong.append(f"rank {rank}: no result")
            elif int(text[0]) != want or int(text[1]) != world:
                wrong.append(
                    f"rank {rank}: {text[0]} in world {text[1]} (want {want} in world {world})"
                )
        out.result_ok = not wrong
        out.result_note = "; ".join(wrong)

    def log_file(self, meta: dict[str, Any]) -> str | None:
        """The worker's own stdout log: next to the error file relaunch gave it."""
        path = os.path.join(meta["log_dir"], "stdout.log")
        return path if os.path.exists(path) else None

    def check_lines(self) -> None:
        out, killed = self.outcome, self.killed_node()
        consoles = {
            node: set(_read(self.path(f"node{node}.out")).splitlines())
            for node in range(self.topology.nodes)
        }
        for meta in sorted(self.metas(), key=lambda m: m["pid"]):
            truth = _read(self.path("lines", str(meta["pid"]))).splitlines()
            if meta["node"] == killed:
                out.unchecked += len(truth)
                continue
            out.lines += len(truth)
            path = self.log_file(meta)
            logged = set(_read(path).splitlines()) if path else set()
            where = meta["log_dir"] + ("" if path else " (no such log file)")
            for line in truth:
                if line not in logged:
                    out.lost.append(f"'{line}' not in {where}/stdout.log")
                if f"[default{meta['local_rank']}]:{line}" not in consoles[meta["node"]]:
                    out.console_lost += 1

    def check_report(self) -> None:
        out, plan = self.outcome, self.plan
        out.restarts = [
            len(re.findall(r"(?m)^  restart \d+: ", _read(self.path(f"node{n}.err"))))
            for n in range(self.topology.nodes)
        ]
        meta = self.target_meta
        if not meta:
            out.report_note = "no fault was injected"
            return
        if plan.fault == "node":
            group_rank = meta["group_rank"]
            pattern = rf"(?m)^  restart \d+: node of group rank {group_rank} lost"
            survivors = [n for n in range(self.topology.nodes) if n != plan.node]
            missing = [
                n for n in survivors if not re.search(pattern, _read(self.path(f"node{n}.err")))
            ]
            out.report_ok = not missing
            out.report_note = (
                f"the run summary of node(s) {missing} has no line "
                f"'restart N: node of group rank {group_rank} lost'"
            )
            return
        err = _read(self.path(f"node{plan.node}.err"))
        fault = describe_fault(plan)
        rank, local, pid = meta["rank"], meta["local_rank"], meta["pid"]
        root = (
            rf"Root cause \(first failure\):\n  rank {rank} \(local_rank {local}, host "
            rf"[^,]*, pid {pid}\) {re.escape(fault)}"
        )
        summary = rf"(?m)^  restart \d+: rank {rank} {re.escape(fault)}"
        notes = []
        if not re.search(root, err):
            notes.append(
                f"no root cause 'rank {rank} (local_rank {local}, host ..., pid {pid}) {fault}'"
            )
        if not re.search(summary, err):
            notes.append(f"no summary line 'restart N: rank {rank} {fault}'")
        out.report_ok = not notes
        out.report_note = f"node {plan.node}'s stderr has " + " and ".join(notes)


def run_plan(
    plan: Plan,
    base_dir: str,
    etcd_endpoints: str = "",
    *,
    mark: str | None = None,
    steps: int = STEPS,
    timeout: float = RUN_TIMEOUT_S,
) -> Outcome:
    """Run one plan in ``base_dir/runNNN``; ``etcd_endpoints`` for the etcd topology."""
    if plan.topology == "etcd" and not etcd_endpoints:
        raise ValueError("the etcd topology needs etcd endpoints")
    return Run(plan, base_dir, etcd_endpoints, mark, steps, timeout).execute()


# -- the report --------------------------------------------------------------------------------


def summarize(outcomes: Sequence[Outcome]) -> list[str]:
    n = len(outcomes)
    lines = sum(o.lines for o in outcomes)
    lost = sum(len(o.lost) for o in outcomes)
    console = sum(o.console_lost for o in outcomes)
    unchecked = sum(o.unchecked for o in outcomes)
    rows = [
        ("runs", str(n)),
        ("survived (exit 0, right result)", f"{sum(o.survived for o in outcomes)} of {n}"),
        ("leaked processes", str(sum(len(o.leaked) for o in outcomes))),
        (
            "lost log lines",
            f"{lost} of {lines}"
            + (f" (+{unchecked} of killed nodes, not checked)" if unchecked else ""),
        ),
        ("lines missing on the console (tee)", f"{console} of {lines}"),
        ("reports naming the fault", f"{sum(o.report_ok for o in outcomes)} of {n}"),
        ("runs passing every check", f"{sum(o.ok for o in outcomes)} of {n}"),
    ]
    width = max(len(name) for name, _ in rows)
    return [f"  {name:<{width}}  {value}" for name, value in rows]


def table(outcomes: Sequence[Outcome]) -> list[str]:
    """A markdown table per (topology, fault): runs, passed, and each check's failures."""
    groups: dict[tuple[str, str], list[Outcome]] = {}
    for outcome in outcomes:
        groups.setdefault((outcome.plan.topology, outcome.plan.fault), []).append(outcome)
    rows = [
        "| topology | fault | runs | all checks | survived | leaked | lost lines | "
        "report names it | recovery s (median) |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for name in TOPOLOGIES:
        for fault in FAULTS:
            group = groups.get((name, fault))
            if not group:
                continue
            recoveries = [o.recovery for o in group if o.recovery is not None]
            rows.append(
                f"| {name} | {fault} | {len(group)} | {sum(o.ok for o in group)} | "
                f"{sum(o.survived for o in group)} | {sum(len(o.leaked) for o in group)} | "
                f"{sum(len(o.lost) for o in group)} of {sum(o.lines for o in group)} | "
                f"{sum(o.report_ok for o in group)} | "
                f"{statistics.median(recoveries) if recoveries else float('nan'):.2f} |"
            )
    return rows


# -- main --------------------------------------------------------------------------------------


def _names(text: str) -> list[str]:
    names = [name for name in text.split(",") if name]
    for name in names:
        if name not in TOPOLOGIES:
            raise argparse.ArgumentTypeError(f"unknown topology {name!r} ({', '.join(TOPOLOGIES)})")
    return names


def _indexes(text: str) -> list[int]:
    return [int(index) for index in text.split(",") if index]


def start_etcd() -> Any:
    if shutil.which("etcd") is None:
        raise SystemExit(
            "chaos: no etcd binary on PATH (Debian: apt-get install etcd-server); "
            "use --no-etcd to leave the etcd topology out"
        )
    sys.path.insert(0, TESTS_DIR)
    try:
        from etcd_cluster import EtcdCluster
    finally:
        sys.path.remove(TESTS_DIR)
    return EtcdCluster(1).start()


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="number of runs (default: 20)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    parser.add_argument(
        "--topologies",
        type=_names,
        default=list(TOPOLOGIES),
        help="comma-separated: single,c10d,etcd (default: all)",
    )
    parser.add_argument(
        "--etcd",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="include the etcd topology (default: yes)",
    )
    parser.add_argument(
        "--only",
        type=_indexes,
        default=None,
        help="run only these runs of the seed's plan, e.g. 3,17",
    )
    parser.add_argument("--steps", type=int, default=STEPS, help="steps of the job")
    parser.add_argument(
        "--keep", action="store_true", help="keep all run directories (failed ones are always kept)"
    )
    parser.add_argument("--dir", default=None, help="where the run directories go")
    parser.add_argument("--table", action="store_true", help="also print a markdown table")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="show the agents' stderr for a failed run"
    )
    opts = parser.parse_args(None if argv is None else list(argv))
    topologies = [name for name in opts.topologies if opts.etcd or name != "etcd"]
    if not topologies:
        parser.error("no topology left")
    seed = opts.seed if opts.seed is not None else random.randrange(1 << 31)
    runs = max(opts.only) + 1 if opts.only else opts.runs
    plans = plan_runs(seed, runs, topologies)
    if opts.only:
        plans = [plan for plan in plans if plan.index in opts.only]
    base = opts.dir or tempfile.mkdtemp(prefix="relaunch-chaos-")
    os.makedirs(base, exist_ok=True)
    started = time.monotonic()
    with open("/proc/loadavg") as file:
        load = " ".join(file.read().split()[:3])
    print(
        f"chaos: seed {seed}, {len(plans)} runs, topologies {','.join(topologies)}; python "
        f"{sys.version.split()[0]}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}, load "
        f"{load}",
        flush=True,
    )
    print(
        f"  reproduce: python {os.path.relpath(THIS_FILE)} --seed {seed} --runs {runs} "
        f"--topologies {','.join(topologies)}; directories under {base}",
        flush=True,
    )
    cluster = start_etcd() if "etcd" in {plan.topology for plan in plans} else None
    outcomes = []
    try:
        for plan in plans:
            outcome = run_plan(plan, base, cluster.endpoints if cluster else "", steps=opts.steps)
            outcomes.append(outcome)
            print(outcome.line() if outcome.ok else outcome.explain(opts.verbose), flush=True)
            if outcome.ok and not opts.keep:
                shutil.rmtree(outcome.run_dir, ignore_errors=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    finally:
        if cluster is not None:
            cluster.stop()
    print(f"\nsummary (seed {seed}, {time.monotonic() - started:.0f} s)")
    print("\n".join(summarize(outcomes)))
    if opts.table:
        print()
        print("\n".join(table(outcomes)))
    failed = [o for o in outcomes if not o.ok]
    if failed:
        print(
            f"\nfailed runs: {', '.join(str(o.plan.index) for o in failed)} (rerun one with "
            f"--seed {seed} --only N; directories kept under {base})"
        )
    elif not opts.keep and not opts.dir:
        shutil.rmtree(base, ignore_errors=True)
    return 0 if outcomes and not failed and len(outcomes) == len(plans) else 1


if __name__ == "__main__":
    sys.exit(worker_main() if sys.argv[1:2] == ["worker"] else main())
