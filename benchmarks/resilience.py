"""Resilience: a hang's deadline to every stack written, its culprit named and the group restarted,
on one node and across two, and how long a slow rank takes to be flagged as a straggler.

Run by hand (not part of the test suite): ``python -m benchmarks resilience [--quick]``.

1. **hang, 1 node**: ``relaunch --nproc-per-node 4 --max-restarts 1 --tee 2 hang.py OUT given 1``:
   local rank 1 enters ``relaunch.section("step", timeout=1)`` and hangs; the others wait. From
   the deadline (written by the worker) to the agent's line naming the overdue section
   (*detected*), to the failure report's root cause naming the rank the others wait for
   (*verdict*: ``Root cause (a hang, ...): rank 1 is not where ranks 0, 2, 3 wait``, from every
   rank's stack), and to the first worker of the next attempt starting (*restarted*: every stack
   has been written and the old group is gone before it). Budget: restarted <= 2 s.
2. **hang, 2 nodes**: the same over two agents on the built-in store (2 workers each); the
   hung rank is on one node; *verdict* is the later of the two nodes' root-cause lines (each
   node's verdict covers both nodes' ranks, gathered through the store); *restarted* is the last
   worker of the next attempt to start, on either node, so the other node's stacks are in too.
   Budget: <= 5 s.
3. **straggler**: two agents of two workers; every rank reports a step every 20 ms but rank 3
   every 100 ms from the start. From the workers' start to the line flagging rank 3 (by its
   pace) on group rank 0's node and on rank 3's own node. No budget; the note gives the figures.
4. **straggler of synchronous training**: two agents of two gloo workers, an all-reduce every
   step, each computing 20 ms a step inside ``relaunch.section("compute")``; from step 400 the
   ranks of node 1 compute 100 ms. Every rank steps at one pace, so no rate tells; from the
   onset (written by the slow ranks) to the line flagging node 1 and its ranks by their
   section's time, on group rank 0's node and on node 1. No budget; the note gives the figures.

torchrun has no sections, heartbeats or straggler flags: there is nothing of it to run beside.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from benchmarks import harness
from benchmarks.harness import BenchError, Check, fmt, log, median
from relaunch.endpoints import find_free_port

LAUNCHERS = False
QUICK = {"reps": 1}
ONE_NODE_BUDGET_S = 2.0
TWO_NODES_BUDGET_S = 5.0
RUN_TIMEOUT_S = 60.0
#: How a failure report's root cause begins when a hang's culprit was judged from every stack.
VERDICT = "Root cause (a hang, from every rank's stack): rank 1 is not where ranks 0, 2, 3 wait"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=3, help="runs of each measurement")


class Agent:
    """A ``python -m relaunch`` whose stderr lines are timestamped as they come."""

    def __init__(self, argv: Sequence[str], env: dict[str, str]) -> None:
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "relaunch", *argv],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stderr is not None
        self._reader = threading.Thread(target=self._read, args=(self.proc.stderr,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append((time.time(), line))

    def first(self, text: str) -> float | None:
        return next((at for at, line in self.lines if text in line), None)

    def wait(self) -> int:
        try:
            code = self.proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise BenchError("relaunch did not end in time") from None
        self._reader.join(timeout=10)
        return code


def _await(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise BenchError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _starts(out: str, attempt: int | None) -> list[float]:
    """When the workers of ``attempt`` started (None: the straggler job's, which has one)."""
    prefix = "start." if attempt is None else f"start.{attempt}."
    times = []
    for name in os.listdir(out):
        if name.startswith(prefix):
            with open(os.path.join(out, name)) as file:
                times.append(float(file.read()))
    return times


def _two_nodes(port: int, run_id: str, nproc: int, extra: Sequence[str]) -> list[str]:
    return [
        "--nnodes",
        "2",
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        run_id,
        *extra,
    ]


def hang_once(ctx: harness.Context, nodes: int, rep: int) -> tuple[float, float, float]:
    """(detected, verdict, restarted) seconds after the deadline."""
    out = os.path.join(ctx.tmp, f"hang{nodes}-{rep}")
    os.makedirs(out)
    job = [harness.worker("hang.py"), out, "given", "1"]
    common = ["--max-restarts", "1", "--tee", "2", "--log-dir", os.path.join(out, "logs")]
    if nodes == 1:
        agents = [Agent(["--nproc-per-node", "4", *common, *job], ctx.env)]
    else:
        port = find_free_port()
        argv = _two_nodes(port, f"hang{rep}", 2, common)
        agents = [Agent([*argv, *job], ctx.env) for _ in range(2)]
    codes = [agent.wait() for agent in agents]
    if any(codes):
        raise BenchError(f"a hang run failed: exit statuses {codes}")
    with open(os.path.join(out, "deadline")) as file:
        deadline = float(file.read())
    detected = min(
        at for agent in agents if (at := agent.first("section 'step' overdue")) is not None
    )
    judged = [agent.first(VERDICT) for agent in agents]
    if None in judged:
        raise BenchError("a node's failure report did not name the hang's culprit")
    verdict = max(at for at in judged if at is not None)
    restarted = max(_starts(out, 1))
    return detected - deadline, verdict - deadline, restarted - deadline


def straggler_once(ctx: harness.Context, rep: int) -> tuple[float, float]:
    """Seconds from the workers' start to rank 3 flagged on group rank 0's node and its own."""
    out = os.path.join(ctx.tmp, f"slow-{rep}")
    os.makedirs(out)
    port = find_free_port()
    argv = _two_nodes(port, f"slow{rep}", 2, [])
    agents = [Agent([*argv, harness.worker("slow_rank.py"), out, "3"], ctx.env) for _ in range(2)]
    flag = ", rank 3) is a straggler"
    try:
        _await(lambda: all(agent.first(flag) for agent in agents), 40, "the straggler flags")
    finally:
        with open(os.path.join(out, "stop"), "w"):
            pass
    codes = [agent.wait() for agent in agents]
    if any(codes):
        raise BenchError(f"a straggler run failed: exit statuses {codes}")
    started = min(_starts(out, None))
    delays = sorted(agent.first(flag) - started for agent in agents)  # type: ignore[operator]
    return delays[0], delays[1]


#: The step from which node 1 computes five times slower: about 10 s of the fast pace first,
#: more than the window a section's time is measured over (a steady job's onset).
SLOW_AFTER = 400
SYNC_FLAG = "(node 1, ranks 2-3) is a straggler: 'compute' takes "


def sync_straggler_once(ctx: harness.Context, rep: int) -> tuple[float, float]:
    """Seconds from node 1's slow computing began to its flag on group rank 0's node and on
    its own, in synchronous gloo training."""
    out = os.path.join(ctx.tmp, f"sync-slow-{rep}")
    os.makedirs(out)
    port = find_free_port()
    argv = _two_nodes(port, f"syncslow{rep}", 2, [])
    job = [harness.worker("sync_slow_node.py"), out, "1", str(SLOW_AFTER)]
    agents = [Agent([*argv, *job], ctx.env) for _ in range(2)]
    try:
        _await(lambda: all(agent.first(SYNC_FLAG) for agent in agents), 90, "the node's flags")
    finally:
        with open(os.path.join(out, "stop"), "w"):
            pass
    codes = [agent.wait() for agent in agents]
    if any(codes):
        raise BenchError(f"a synchronous straggler run failed: exit statuses {codes}")
    onsets = []
    for name in os.listdir(out):
        if name.startswith("onset."):
            with open(os.path.join(out, name)) as file:
                onsets.append(float(file.read()))
    onset = min(onsets)
    delays = sorted(agent.first(SYNC_FLAG) - onset for agent in agents)  # type: ignore[operator]
    if delays[0] < 0:
        raise BenchError(f"node 1 was flagged {-delays[0]:.1f} s before it slowed down")
    return delays[0], delays[1]


def run(ctx: harness.Context) -> list[Check]:
    reps = ctx.opts.reps
    checks: list[Check] = []
    results: dict[str, Any] = {}
    for nodes, budget in ((1, ONE_NODE_BUDGET_S), (2, TWO_NODES_BUDGET_S)):
        samples = [hang_once(ctx, nodes, rep) for rep in range(reps)]
        detected = median([s[0] for s in samples])
        verdict = median([s[1] for s in samples])
        restarted = median([s[2] for s in samples])
        worst = max(s[2] for s in samples)
        log(
            f"hang, {nodes} node(s): detected {fmt(detected, '.2f')} s, culprit named "
            f"{fmt(verdict, '.2f')} s, restarted {fmt(restarted, '.2f')} s after the deadline "
            f"(worst {fmt(worst, '.2f')} s)"
        )
        results[f"hang_{nodes}"] = {"samples": samples}
        checks.append(
            Check(
                f"hang on {nodes} node(s): deadline -> culprit named on every node (median)",
                f"{verdict:.2f} s",
                "-",
                True,
            )
        )
        checks.append(
            Check(
                f"hang on {nodes} node(s): deadline -> stacks + restarted (worst of {reps})",
                f"{worst:.2f} s",
                f"<= {budget:g} s",
                worst <= budget,
            )
        )
    flagged = [straggler_once(ctx, rep) for rep in range(reps)]
    first, last = median([s[0] for s in flagged]), median([s[1] for s in flagged])
    log(f"straggler flagged {fmt(first)} s (first node) and {fmt(last)} s (both) after start")
    results["straggler"] = {"samples": flagged}
    checks.append(
        Check("straggler flagged on both nodes, after the start", f"{last:.1f} s", "-", True)
    )
    synced = [sync_straggler_once(ctx, rep) for rep in range(reps)]
    first, last = median([s[0] for s in synced]), median([s[1] for s in synced])
    log(
        f"synchronous straggler flagged {fmt(first)} s (group rank 0's node) and {fmt(last)} s "
        "(its own) after its onset"
    )
    results["sync_straggler"] = {"samples": synced}
    checks.append(
        Check("synchronous straggler: onset -> flagged on both nodes", f"{last:.1f} s", "-", True)
    )
    ctx.data.update(results)
    return checks
