"""Evicting a straggler to a spare (``--evict-stragglers``) in synchronous training: straggler
onset -> flagged -> evicted -> the slow node gone -> the job back at the fast pace, and the
job's time with and without eviction.

Run by hand (not part of the test suite): ``python -m benchmarks eviction [--quick]``.

Two agents of two gloo workers form a ``--nnodes 2:2`` job on the built-in store, their workers
forked from a zygote that imported torch (``--preload torch``); a third waits as a spare once
the job runs. Every step each rank computes 20 ms inside ``relaunch.section("compute")`` and
all-reduces a tensor (``workers/sync_slow_node.py``); the ranks of the slow node compute 100 ms
from step ``--slow-after`` on, so every rank steps at their pace, until ``--steps``. Ranks
resume from the step they wrote last, as kept state would have them, so the spare goes on where
the slow node was.

- **with eviction** (``--evict-stragglers WINDOW``): from the onset (the slow node's first slow
  step) to the first line flagging it, to the line evicting it (the judge's), to the slow node's
  line saying it is out of the job, to the spare's workers started (the job back at the fast
  pace), and the job's time (from the first agent's start to the last one's end).
- **without**: the same three agents, no ``--evict-stragglers``: the job runs at the slow
  node's pace. Goal: with / without <= 0.7.
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
MOMENTS = ("flagged", "evicted", "left", "back")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=3, help="runs of each side")
    parser.add_argument("--steps", type=int, default=400, help="steps of the job")
    parser.add_argument(
        "--slow-after", type=int, default=1, help="the slow node's first slow step (default 1)"
    )
    parser.add_argument(
        "--window", type=float, default=3.0, help="--evict-stragglers SECONDS (default 3)"
    )


def once(ctx: harness.Context, evict: bool, rep: int) -> dict[str, float]:
    """One job: its time, and (evicting) when each moment came after the onset."""
    side = "evict" if evict else "keep"
    out = os.path.join(ctx.tmp, f"{side}-{rep}")
    os.makedirs(out)
    port = find_free_port()
    argv = [
        *("--nnodes", "2:2", "--nproc-per-node", "2", "--redirects", "3"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"),
        *("--rdzv-id", f"{side}{rep}", "--log-dir", os.path.join(out, "logs")),
        *("--preload", "torch"),
        *(("--evict-stragglers", f"{ctx.opts.window:g}") if evict else ()),
    ]
    slow_after, steps = str(ctx.opts.slow_after), str(ctx.opts.steps)
    job = [harness.worker("sync_slow_node.py"), out, "env", slow_after, "0.02", steps]
    began = time.time()
    agents = []
    for name, slow in (("a", "0"), ("b", "1")):
        env = {**ctx.env, "SLOW_NODE": slow}
        agents.append(Agent([*argv, "--rdzv-conf", f"node_name={name}", *job], env))
    try:
        _await(lambda: len(_workers(out, "start")) >= 4, 60, "the job of two nodes")
        env = {**ctx.env, "SLOW_NODE": "0"}
        agents.append(Agent([*argv, "--rdzv-conf", "node_name=c", *job], env))
    finally:
        codes = [agent.wait() for agent in agents]
    ended = time.time()
    if any(codes):
        raise BenchError(f"a {side} run failed: exit statuses {codes}")
    result = {"job": ended - began}
    if evict:
        onset = min(
            float(_read(out, name)) for name in os.listdir(out) if name.startswith("onset.")
        )
        flagged = min(at for agent in agents if (at := agent.first("is a straggler")) is not None)
        evicted = min(
            at for agent in agents if (at := agent.first("evicted as a straggler")) is not None
        )
        left = agents[1].first("this node is excluded from the job until")
        if left is None:
            raise BenchError("the slow node was not evicted")
        back = max(at for at, _, slow in _workers(out, "start") if not slow and at > evicted)
        moments = {"flagged": flagged, "evicted": evicted, "left": left, "back": back}
        result.update({name: at - onset for name, at in moments.items()})
    return result


def _read(out: str, name: str) -> str:
    with open(os.path.join(out, name)) as file:
        return file.read()


def _workers(out: str, name: str) -> list[tuple[float, int, bool]]:
    """(when, step, slow) of every worker started (``start.<rank>.<pid>``)."""
    found = []
    for entry in os.listdir(out):
        if entry.startswith(f"{name}."):
            at, step, slow = _read(out, entry).split()
            found.append((float(at), int(step), slow == "1"))
    return found


def run(ctx: harness.Context) -> list[Check]:
    reps = ctx.opts.reps
    results: dict[str, Any] = {"evict": [], "keep": []}
    for rep in range(reps):
        for side in harness.alternate(["evict", "keep"], rep):
            results[side].append(once(ctx, side == "evict", rep))
    ctx.data.update(results)
    evict, keep = results["evict"], results["keep"]
    at = {name: median([r[name] for r in evict]) for name in MOMENTS}
    log(
        f"after the onset: flagged {fmt(at['flagged'])} s, evicted {fmt(at['evicted'])} s, "
        f"the slow node out {fmt(at['left'])} s, the spare's workers running {fmt(at['back'])} s "
        f"(window {ctx.opts.window:g} s)"
    )
    with_, without = median([r["job"] for r in evict]), median([r["job"] for r in keep])
    ratio = with_ / without
    log(f"the job: {fmt(with_)} s with eviction, {fmt(without)} s without ({ratio:.2f}x)")
    return [
        Check(
            "onset -> flagged -> evicted -> slow node out -> spare running (s)",
            " / ".join(f"{at[name]:.1f}" for name in MOMENTS),
            "-",
            None,
        ),
        Check(
            "evicted -> the slow node out of the job (s)",
            f"{at['left'] - at['evicted']:.2f}",
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
