"""Measurement 2: a node SIGKILLed until the survivor's restarted worker runs (c10d, etcd,
torchrun)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks import harness
from benchmarks.harness import RELAUNCH, TORCHRUN, BenchError, Check, fmt, log, median
from benchmarks.rendezvous.shared import (
    ETCD,
    LABELS,
    LINE_TIMEOUT_S,
    STARTED_RE,
    Agents,
    Bench,
    Launcher,
    note_errors,
    run_id,
    spread,
)

DEATH_BUDGET_S = 2.0  # SIGKILL of a node -> the survivor's restarted worker printed
DEATH_SETTLE_S = 1.0  # both workers run in world 2 this long before the kill, plus
DEATH_PHASE_STEP_S = 0.1  # this much more per repetition (mod 5): the heartbeats' phase varies
DEATH_BOUND_S = 20.0  # how long a launcher gets to recover
WORKER_GONE_S = 1.0  # the killed node's worker must be gone this soon (relaunch)
#: relaunch keeps the default heartbeats (5 s x 3: a node silent 15 s is dead): its agent's
#: guardian writes the dead agent's death notice (``rendezvous.death_notice``), and the
#: survivor hears it from the store at once. torchrun has no such notice: it gets heartbeats of
#: 1 s x 2 = 2.0 s (it takes only whole seconds for keep_alive_interval, parsing it with int(),
#: and with interval 1 and max_attempt 1 a single node never completes its round: torch 2.13
#: waits until join_timeout).
DEATH_CONF = {
    RELAUNCH: "last_call_timeout=1,join_timeout=60",
    ETCD: "last_call_timeout=1,join_timeout=60",
    TORCHRUN: "keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1,join_timeout=60",
}


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
