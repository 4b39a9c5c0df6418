"""Evicting a straggler to a spare (``--evict-stragglers``): straggler onset -> flagged ->
evicted -> the job back at the fast pace, and the job's time with and without eviction.

Run by hand (not part of the test suite): ``python -m benchmarks eviction [--quick]``.

Two agents of two workers form a ``--nnodes 2:2`` job on the built-in store; a third waits as a
spare once the job runs. Every rank steps every 20 ms, but the ranks of the slow node every
100 ms from the start (``workers/slow_node.py``, asynchronous work: each rank reports its steps,
no collective), until every rank made ``--steps``. Ranks resume from the step they wrote last,
as kept state would have them, so the spare goes on where the slow node was.

- **with eviction** (``--evict-stragglers WINDOW``): from the workers' start (the onset: the
  slow node is slow from its first step) to the first line flagging a straggler, to the
  eviction's restart line, to the spare's workers started (the job back at the fast pace), and
  the job's time (from the first agent's start to the last one's end).
- **without**: the same three agents, no ``--evict-stragglers``: the job runs at the slow
  node's pace. Goal: with / without <= 0.7.

Flagging is today's (steps per second), which sees a slow node in asynchronous work only;
synchronous training (a collective every step) needs the flagging of time outside the
collectives: re-run this with a synchronous worker once that is in.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from benchmarks import harness
from benchmarks.harness import BenchError, Check, fmt, log, median
from benchmarks.resilience import Agent, _await
from relaunch.endpoints import find_free_port

LAUNCHERS = False
QUICK = {"reps": 1}
GOAL = 0.7


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=3, help="runs of each side")
    parser.add_argument("--steps", type=int, default=400, help="steps every rank makes")
    parser.add_argument(
        "--window", type=float, default=3.0, help="--evict-stragglers SECONDS (default 3)"
    )


def once(ctx: harness.Context, evict: bool, rep: int) -> dict[str, float]:
    """One job: its time, and (evicting) when each moment came after the workers' start."""
    side = "evict" if evict else "keep"
    out = os.path.join(ctx.tmp, f"{side}-{rep}")
    os.makedirs(out)
    port = find_free_port()
    argv = [
        *("--nnodes", "2:2", "--nproc-per-node", "2", "--redirects", "3"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"),
        *("--rdzv-id", f"{side}{rep}", "--log-dir", os.path.join(out, "logs")),
        *(("--evict-stragglers", f"{ctx.opts.window:g}") if evict else ()),
    ]
    job = [harness.worker("slow_node.py"), out, str(ctx.opts.steps)]
    began = time.time()
    agents = []
    for name, slow in (("a", "0"), ("b", "1")):
        env = {**ctx.env, "SLOW_NODE": slow}
        agents.append(Agent([*argv, "--rdzv-conf", f"node_name={name}", *job], env))
    try:
        _await(lambda: len(_starts(out)) >= 4, 30, "the job of two nodes")
        env = {**ctx.env, "SLOW_NODE": "0"}
        agents.append(Agent([*argv, "--rdzv-conf", "node_name=c", *job], env))
    finally:
        codes = [agent.wait() for agent in agents]
    ended = time.time()
    if any(codes):
        raise BenchError(f"a {side} run failed: exit statuses {codes}")
    starts = _starts(out)
    onset = min(at for at, _ in starts)
    result = {"job": ended - began}
    if evict:
        flagged = min(at for agent in agents if (at := agent.first("is a straggler")) is not None)
        evicted = agents[0].first("evicted as a straggler")
        if evicted is None:
            raise BenchError("the slow node was not evicted")
        back = max(at for at, slow in starts if slow == "0" and at > evicted)
        result.update(
            flagged=flagged - onset, evicted=evicted - onset, back=back - onset, onset=0.0
        )
    return result


def _starts(out: str) -> list[tuple[float, str]]:
    """(when, SLOW_NODE) of every worker started (``start.<rank>.<pid>``)."""
    found = []
    for name in os.listdir(out):
        if name.startswith("start."):
            with open(os.path.join(out, name)) as file:
                at, slow = file.read().split()
            found.append((float(at), slow))
    return found


def run(ctx: harness.Context) -> list[Check]:
    reps = ctx.opts.reps
    results: dict[str, Any] = {"evict": [], "keep": []}
    for rep in range(reps):
        for side in harness.alternate(["evict", "keep"], rep):
            results[side].append(once(ctx, side == "evict", rep))
    ctx.data.update(results)
    evict, keep = results["evict"], results["keep"]
    moments = {name: median([r[name] for r in evict]) for name in ("flagged", "evicted", "back")}
    log(
        f"after the onset: flagged {fmt(moments['flagged'])} s, evicted "
        f"{fmt(moments['evicted'])} s, the spare's workers running {fmt(moments['back'])} s "
        f"(window {ctx.opts.window:g} s)"
    )
    with_, without = median([r["job"] for r in evict]), median([r["job"] for r in keep])
    ratio = with_ / without
    log(f"the job: {fmt(with_)} s with eviction, {fmt(without)} s without ({ratio:.2f}x)")
    return [
        Check(
            "onset -> flagged -> evicted -> spare running (s)",
            f"{moments['flagged']:.1f} / {moments['evicted']:.1f} / {moments['back']:.1f}",
            "-",
            None,
        ),
        Check(
            f"the job's time, with / without eviction ({ctx.opts.steps} steps)",
            f"{with_:.1f} / {without:.1f} s = {ratio:.2f}x",
            f"<= {GOAL:g}x",
            ratio <= GOAL,
        ),
    ]
