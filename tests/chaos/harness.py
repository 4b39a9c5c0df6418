"""Chaos runs: kill a worker or a whole node of a relaunch job at a random moment, and check.

The library of the chaos runs: tests/chaos/test_chaos.py runs a short version, and the long one
is a benchmark (``python -m benchmarks chaos --runs 60 --seed 1``, see benchmarks/chaos.py).

Each run starts a job of plain-Python workers (tests/chaos/worker.py) under the
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

import contextlib
import glob
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from relaunch.endpoints import find_free_port
from tests.chaos.worker import ITEMS, advance, item, write_atomic
from tests.support.procs import MARK_VAR, collect_leaks, pid_alive

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
NPROC = 2  # workers per node
MAX_RESTARTS = 3
STEPS = 30  # steps of the job
STEP_S = 0.03  # each worker sleeps this long after each step
EXIT_CODES = (1, 3, 42)
#: The rendezvous settings of the multi-node topologies: a node counts as lost 0.6 s after its
#: last heartbeat. ``last_call_timeout`` is long so that the two agents, started together,
#: always form their first world together (the round completes as soon as both joined).
RDZV_CONF = "keep_alive_interval=0.2,keep_alive_max_attempt=3,last_call_timeout=5,join_timeout=20"
RUN_TIMEOUT_S = 60.0  # from the start of the agents to their end
LEAK_GRACE_S = 5.0  # what may still run after the agents exited (as the leaks fixture allows)

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


def expected_value(steps: int = STEPS, items: int = ITEMS) -> int:
    """What every rank holds after ``steps`` steps, whatever the failures and world sizes."""
    value = 0
    for k in range(steps):
        value = advance(value, sum(item(i) for i in range(k * items, (k + 1) * items)))
    return value


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
        self.target_meta: dict[str, Any] = {}  # the target worker's, once it is chosen
        self.outcome = Outcome(plan, self.dir)

    # -- paths --

    def path(self, *parts: str) -> str:
        return os.path.join(self.dir, *parts)

    def metas(self) -> list[dict[str, Any]]:
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
        port = find_free_port("127.0.0.1")
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
                WORKER,
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

        def target() -> dict[str, Any] | None:
            for meta in self.metas():
                if (meta["node"], meta["local_rank"], meta["world"]) == (
                    plan.node,
                    local,
                    full,
                ) and pid_alive(meta["pid"]):
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
            lambda: _count_lines(truth) >= plan.step or not pid_alive(pid),
            deadline,
            f"the target (pid {pid}) to do {plan.step} steps",
        )
        if not pid_alive(pid):
            raise _Timeout(f"the target (pid {pid}) ended before the fault was injected")
        if plan.fault == "node":
            self.agents[plan.node].send_signal(signal.SIGKILL)
        elif plan.fault == "exit":
            write_atomic(self.path("triggers", str(pid)), str(plan.code))
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
        out.leaked = collect_leaks(self.mark, LEAK_GRACE_S)
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
