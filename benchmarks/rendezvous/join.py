"""Measurement 1: K agents started at once until all K workers run (c10d, etcd, torchrun)."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks import harness
from benchmarks.harness import RELAUNCH, TORCHRUN, BenchError, Check, fmt, log, median, verdict
from benchmarks.rendezvous.shared import (
    LABELS,
    LINE_TIMEOUT_S,
    STARTED_RE,
    Agents,
    Bench,
    Launcher,
    note_errors,
    run_id,
)

JOIN_NODES = (2, 4, 8)
JOIN_BUDGET_S = 1.5  # launch -> every worker has printed its first line, every K
JOIN_CONF = "join_timeout=60"


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


def bench_join(
    bench: Bench, reps: int, torchrun_reps: int, sizes: Sequence[int] = JOIN_NODES
) -> list[Check]:
    """Measurement 1 for every K in ``sizes``: its table; relaunch's checks (etcd's go to
    ``bench.etcd_checks``)."""
    log(
        f"[1/4] K agents at once -> K workers running: K in {tuple(sizes)}, {reps} repetitions"
        f" (torchrun: {torchrun_reps}), alternating; sides: "
        + ", ".join(LABELS[lch.name] for lch in bench.launchers())
    )
    rows = []
    errors: dict[str, str] = {}
    for nodes in sizes:
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
