"""Measurement 5: the built-in store's host lost in a job of 3 (``--nnodes 2:3``) until the
survivors' restarted workers run (issue 28, item 1; docs/store-failover.md).

relaunch names three hosts in ``--rdzv-endpoint`` (127.0.0.1-3, one port): the first agent
hosts the store, the others serve standbys, and the survivors move the store to the first
standby. Two ways to lose the host: its agent SIGKILLed (refused at once; default keep-alive),
and its whole node silent (the agent and its worker SIGSTOPped: no FIN; keep-alive 1 s x 3, so
the detection time is 3 s). torchrun (one endpoint: it takes no list) is measured for the
SIGKILL: its store dies with its host.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks import harness
from benchmarks.harness import RELAUNCH, TORCHRUN, BenchError, Check, fmt, log, median
from benchmarks.rendezvous.shared import (
    LABELS,
    LINE_TIMEOUT_S,
    STARTED_RE,
    Agents,
    Bench,
    Launcher,
    note_errors,
    spread,
)
from relaunch.endpoints import find_free_port

SLACK_S = 2.0  # the budget: the keep-alive detection time + this
HOST_BOUND_S = 30.0  # how long the survivors get to run again
#: relaunch SIGKILL: the default heartbeats (5 s x 3); SIGSTOP: 1 s x 3 (3 s of silence).
#: Failover needs the job's token on every node.
KILL_CONF = "last_call_timeout=3,join_timeout=60,token=bench-token"
STOP_CONF = f"keep_alive_interval=1,keep_alive_max_attempt=3,{KILL_CONF}"
STOP_DETECTION_S = 3.0
TORCHRUN_CONF = "keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=3,join_timeout=60"


@dataclass
class HostRun:
    back_ms: float | None  # the first survivor's world-2 worker printed - the loss
    ends: str  # how the survivors ended


def _serving(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def host_run(bench: Bench, launcher: Launcher, how: str) -> HostRun:
    """One job of 3; its store's host lost ``how`` ("SIGKILL" or "SIGSTOP")."""
    run_dir = bench.run_dir(f"host-{how}-{launcher.name}")
    done = os.path.join(run_dir, "done")
    port = find_free_port("127.0.0.1")
    if launcher.name == TORCHRUN:
        endpoint, confs = (
            f"127.0.0.1:{port}",
            [f"{TORCHRUN_CONF},is_host={int(i == 0)}" for i in range(3)],
        )
    else:
        endpoint = ",".join(f"127.0.0.{n}:{port}" for n in (1, 2, 3))
        confs = [STOP_CONF if how == "SIGSTOP" else KILL_CONF] * 3
    script = bench.script("world.py")
    latest: dict[int, tuple[int, int, float]] = {}  # agent -> (world, worker pid, printed at)
    stopped: list[int] = []
    with Agents(bench, run_dir) as agents:

        def read(timeout: float) -> None:
            item = agents.next(timeout)
            if item is not None and (match := STARTED_RE.search(item[2])) is not None:
                latest[item[0]] = (int(match.group(3)), int(match.group(4)), float(match.group(1)))

        run_id = f"host-{launcher.name}-{how}"
        host = agents.start(launcher.argv("2:3", endpoint, run_id, confs[0], script, done))
        deadline = time.monotonic() + LINE_TIMEOUT_S
        while not _serving(port):
            if time.monotonic() > deadline or agents.exited_at:
                raise BenchError(f"the first agent hosts no store ({agents.stderr_tail()})")
            read(0.05)
        others = [
            agents.start(launcher.argv("2:3", endpoint, run_id, conf, script, done))
            for conf in confs[1:]
        ]
        while not all(latest.get(agent, (0,))[0] == 3 for agent in (host, *others)):
            if time.monotonic() > deadline or agents.exited_at:
                raise BenchError(f"no world of 3 nodes ({agents.stderr_tail()})")
            read(0.05)
        lost = time.time()
        if how == "SIGKILL":
            os.kill(agents.procs[host].pid, signal.SIGKILL)
        else:
            stopped = [agents.procs[host].pid, latest[host][1]]
            for pid in stopped:
                os.kill(pid, signal.SIGSTOP)
        bound = time.monotonic() + HOST_BOUND_S
        back = None
        try:
            while back is None and time.monotonic() < bound:
                read(0.01)
                again = [
                    latest[agent][2]
                    for agent in others
                    if agent in latest and latest[agent][0] == 2 and latest[agent][2] >= lost
                ]
                if again:
                    back = (min(again) - lost) * 1e3
                if all(agents.procs[agent].poll() is not None for agent in others):
                    break
        finally:
            with open(done, "w"):
                pass
            with contextlib.suppress(BenchError):
                for agent in others:
                    while agents.procs[agent].poll() is None and time.monotonic() < bound + 10:
                        agents.pump(0.01)
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            with contextlib.suppress(BenchError):
                agents.wait_all(15.0)
        codes = sorted({str(agents.procs[agent].poll()) for agent in others})
        ends = "survivors exit " + ",".join(codes)
        if how == "SIGSTOP":
            ends += f"; the old host exit {agents.procs[host].poll()}"
    return HostRun(back, ends)


def bench_host(bench: Bench, reps: int, torchrun_reps: int) -> list[Check]:
    log(
        f"[5/5] the store's host lost in a job of 3 -> the survivors' workers again: {reps} "
        f"repetitions each (torchrun: {torchrun_reps}, SIGKILL only)"
    )
    sides: dict[str, Callable[..., Any]] = {}
    counts: dict[str, int] = {}
    for lch in bench.launchers():
        if lch.backend != "c10d":
            continue
        for how in ("SIGKILL", "SIGSTOP") if lch.name == RELAUNCH else ("SIGKILL",):
            key = f"{lch.name} {how}"
            sides[key] = lambda rep, lch=lch, how=how: host_run(bench, lch, how)
            counts[key] = torchrun_reps if lch.name == TORCHRUN else reps
    errors: dict[str, str] = {}
    samples = harness.run_alternating(sides, counts, errors, bench.collect)
    print(
        "\n5. --nnodes 2:3, three agents (relaunch: --rdzv-endpoint 127.0.0.1:P,127.0.0.2:P,"
        "127.0.0.3:P);\n   the store's host lost -> the first survivor's restarted worker printed"
        " world 2;\n   ms since the loss, median [min-max]; bounded at "
        f"{HOST_BOUND_S:g} s. SIGKILL: the host's agent (relaunch: default keep-alive,\n"
        "   15 s detection); SIGSTOP: the host's agent and worker, no FIN (keep-alive 1 s x 3)"
    )
    print(f"{'side':<24} {'runs':>4} {'back':>9} {'loss -> running':>18}  ends")
    checks: list[Check] = []
    for key in sides:
        runs: list[HostRun] = samples.get(key, [])
        if not runs:
            continue
        back = [r.back_ms for r in runs if r.back_ms is not None]
        ends = "; ".join(sorted({r.ends for r in runs}))
        name, how = key.rsplit(" ", 1)
        print(
            f"{LABELS[name] + ' ' + how:<24} {len(runs):>4} {len(back):>4} of {len(runs):<2}"
            f" {spread(back):>18}  {ends}"
        )
        if name == RELAUNCH:
            # A SIGKILL is refused at once: the detection time does not apply.
            budget = (STOP_DETECTION_S if how == "SIGSTOP" else 15.0) + SLACK_S
            med = median(back) if len(back) == len(runs) else None
            checks.append(
                Check(
                    f"store host {how} (job of 3) -> survivors' workers",
                    f"{fmt(med, '.0f')} ms",
                    f"<= {budget * 1e3:.0f} ms",
                    med is not None and med <= budget * 1e3,
                )
            )
    note_errors(bench, errors)
    return checks
