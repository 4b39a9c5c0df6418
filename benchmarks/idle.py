"""Wake-ups per second of an idle job's launcher: relaunch vs torchrun, standalone and c10d.

``LAUNCHER --standalone --nproc-per-node 8 ready.py DIR`` (and the elastic path,
``--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT --nnodes 1:2``): once all 8 workers have
written their pid files (they then sleep) and a settling second has passed, the launcher's
context switches (voluntary + involuntary, summed over /proc/PID/task/*/status) are counted
over a window of ``--window`` seconds. An idle launcher should sleep until something happens:
each switch is a wake-up. Only relaunch is held to the budgets. The busiest threads are listed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass

from benchmarks import harness
from benchmarks.harness import RELAUNCH, TORCHRUN, BenchError, Check, fmt, log, median
from relaunch.endpoints import find_free_port

NPROC = 8
BUDGETS = {"standalone": 2.0, "c10d": 3.0}  # relaunch's wake-ups per second, at most
START_TIMEOUT_S = 120.0  # until every worker runs
#: One node of ``--nnodes 1:2`` completes its round after ``last_call_timeout`` (default 30 s).
C10D_CONF = "last_call_timeout=1"

LAUNCHERS = True
QUICK = {"window": 2.0, "settle": 0.5}


Launcher = harness.Launcher
Bench = harness.Bench[Launcher]


def flags(variant: str) -> list[str]:
    common = ["--nproc-per-node", str(NPROC)]
    if variant == "standalone":
        return ["--standalone", *common]
    endpoint = f"127.0.0.1:{find_free_port('127.0.0.1')}"
    return [
        *common,
        "--nnodes",
        "1:2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        "idle",
        "--rdzv-conf",
        C10D_CONF,
    ]


def switches(pid: int) -> dict[str, int]:
    """Context switches so far of each thread of ``pid``: ``"tid name"`` -> count."""
    counts: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            total, name = 0, "?"
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/status") as file:
                for line in file:
                    if line.startswith("Name:"):
                        name = line.split(None, 1)[1].strip()
                    elif line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        total += int(line.split()[1])
            counts[f"{tid} {name}"] = total
    return counts


@dataclass
class Sample:
    rate: float  # wake-ups per second, all threads
    threads: int
    busiest: list[tuple[str, float]]  # (thread, wake-ups per second), most first


def idle_run(
    bench: Bench, launcher: Launcher, variant: str, window: float, settle: float
) -> Sample:
    pid_dir = tempfile.mkdtemp(prefix=f"idle-{launcher.name}-", dir=bench.tmp)
    argv = launcher.argv(flags(variant), bench.script("ready.py"), pid_dir)
    err_path = os.path.join(pid_dir, "stderr")
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=bench.env
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while len([n for n in os.listdir(pid_dir) if n.endswith(".pid")]) < NPROC:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = harness.last_line(err_path)
                raise BenchError(f"the workers did not all start (exit {proc.poll()}): {tail}")
            time.sleep(0.02)
        time.sleep(settle)  # the measurement's settling time, not a synchronisation
        before = switches(proc.pid)
        started = time.monotonic()
        time.sleep(window)
        after = switches(proc.pid)
        elapsed = time.monotonic() - started
        if proc.poll() is not None:
            raise BenchError(f"the launcher exited during the window ({proc.returncode})")
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                harness.kill_pid(proc.pid)
                proc.wait()
    per_thread = {name: (count - before.get(name, 0)) / elapsed for name, count in after.items()}
    busiest = sorted(per_thread.items(), key=lambda item: -item[1])[:3]
    return Sample(sum(per_thread.values()), len(after), busiest)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--window", type=float, default=5.0, help="seconds counted (default 5)")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds before the window")
    parser.add_argument("--reps", type=int, default=1, help="windows per side and variant")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=tuple(BUDGETS),
        default=list(BUDGETS),
        help="standalone and/or c10d (default: both)",
    )


def run(ctx: harness.Context) -> list[Check]:
    opts = ctx.opts
    relaunch, torchrun = ctx.launchers(Launcher)
    bench: Bench = ctx.bench(Bench, relaunch, torchrun)
    checks: list[Check] = []
    print(
        f"\nwake-ups per second of the launcher of an idle {NPROC}-worker job "
        f"({opts.window:g} s window, medians of {opts.reps}; the 3 busiest threads of the last)"
    )
    print(f"{'variant':<11} {'launcher':<9} {'wake-ups/s':>10} {'threads':>7}  busiest threads")
    for variant in opts.variants:
        log(f"idle {variant}: {opts.reps} x {opts.window:g} s per side")
        sides = {
            lch.name: (
                lambda _rep, lch=lch, v=variant: idle_run(bench, lch, v, opts.window, opts.settle)
            )
            for lch in (relaunch, torchrun)
            if lch.unavailable is None
        }
        errors: dict[str, str] = {}
        samples = harness.run_alternating(
            sides, dict.fromkeys(sides, opts.reps), errors, bench.collect
        )
        rates: dict[str, float] = {}
        for name in (RELAUNCH, TORCHRUN):
            runs: list[Sample] = samples.get(name, [])
            if not runs:
                why = errors.get(name) or (torchrun.unavailable if name == TORCHRUN else "?")
                print(f"{variant:<11} {name:<9} {'-':>10} {'-':>7}  not measured: {why}")
                continue
            rates[name] = median([s.rate for s in runs])
            busiest = ", ".join(f"{thread} {rate:.1f}" for thread, rate in runs[-1].busiest)
            print(f"{variant:<11} {name:<9} {rates[name]:>10.1f} {runs[-1].threads:>7}  {busiest}")
        ratio = rates[TORCHRUN] / rates[RELAUNCH] if len(rates) == 2 and rates[RELAUNCH] else None
        print(f"{'':<11} torchrun / relaunch: {fmt(ratio, '.2f')}")
        ctx.data[variant] = {**rates, "torchrun/relaunch": ratio}
        budget = BUDGETS[variant]
        ours = rates.get(RELAUNCH)
        checks.append(
            Check(
                f"idle {variant}: launcher wake-ups/s",
                f"{fmt(ours)} (torchrun {fmt(rates.get(TORCHRUN))})",
                f"<= {budget:g}",
                None if ours is None else ours <= budget,
            )
        )
    return checks
