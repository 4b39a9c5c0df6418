"""Re-forming after a lost node: a spare that waits against a replacement node started cold.

Run by hand: ``python -m benchmarks spares [--quick] [--backends c10d etcd] [--reps N]``.

A job of ``--nnodes 2:2`` (one worker a node, benchmarks/workers/world.py) runs on two agents;
one of them (on c10d, the one that does not host the store) is SIGKILLed. Two variants,
alternating:

- ``spare``: a third agent was started with the job already full, and waits as a spare (its
  stderr says so) for ``SETTLE_S`` s (plus a step a repetition, so that the kill lands at every
  point of the heartbeat period) before the kill;
- ``cold``: the third agent is started right after the kill (the moment a scheduler could
  replace the node), with nothing running before.

Measured from the kill (``time.time()``) to the later of the two ``started`` lines of the new
world of 2 (each worker stamps its line with ``time.time()``): both nodes' workers running again.
The heartbeats count a node dead after ``keep_alive_interval * keep_alive_max_attempt``
(``CONF``: 0.5 s x 2), so the figure is that detection, the re-forming and the workers' start;
the spare is connected and waiting in the next round already, the cold node first starts
Python, relaunch and its store connections (in parallel with the detection).

The checks: the spare's median is within the detection bound plus 2 s (issue 15: "measure the
re-form time with a waiting spare against a node starting cold"), and every run of either
variant recovered.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time
from dataclasses import dataclass

from benchmarks import harness
from benchmarks.harness import RELAUNCH, BenchError, Check, fmt, log, median
from benchmarks.rendezvous.shared import (
    ETCD,
    STARTED_RE,
    Agents,
    Bench,
    Launcher,
    run_id,
    spread,
    start_etcd,
    stop_etcd,
)

VARIANTS = ("spare", "cold")
#: Dead after 0.5 s x 2 = 1 s without a beat (etcd: a lease of ceil(1.0) = 1 s).
CONF = "keep_alive_interval=0.5,keep_alive_max_attempt=2,last_call_timeout=1,join_timeout=60"
DETECTION_S = 1.0
BUDGET_OVER_DETECTION_S = 2.0
SETTLE_S = 1.0  # the spare waits this long (and the world of 2 runs) before the kill, plus
PHASE_STEP_S = 0.1  # this much more per repetition (mod 5): the kill lands at every point of
#: the heartbeat period, the same points for both variants (the detection depends on it)
BOUND_S = 30.0  # how long a run may take to recover
LINE_TIMEOUT_S = 60.0

QUICK = {"reps": 1}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=5, help="runs per variant and backend")
    parser.add_argument(
        "--backends",
        nargs="+",
        choices=("c10d", "etcd"),
        default=["c10d", "etcd"],
        help="rendezvous backends (default: both)",
    )


@dataclass
class Run:
    """One run: seconds from the kill to the new world's last worker line (None: no
    recovery), and whether a spare said it waits."""

    recovered_s: float | None
    said_spare: bool


def reform_run(bench: Bench, launcher: Launcher, variant: str, rep: int) -> Run:
    run_dir = bench.run_dir(f"{variant}-{launcher.backend}")
    done = os.path.join(run_dir, "done")
    endpoint, rdzv_id = bench.endpoint(launcher), run_id(launcher, f"spares-{variant}")
    host_conf, other_conf = (
        (CONF, CONF) if launcher.backend == "etcd" else (f"{CONF},is_host=1", f"{CONF},is_host=0")
    )
    script = bench.script("world.py")
    worlds: dict[int, list[tuple[int, float]]] = {}  # agent -> [(world, printed at)]
    with Agents(bench, run_dir) as agents:

        def read(timeout: float) -> None:
            item = agents.next(timeout)
            if item is not None and (match := STARTED_RE.search(item[2])) is not None:
                worlds.setdefault(item[0], []).append((int(match.group(3)), float(match.group(1))))

        def wait_for(done_yet: object, what: str, bound: float = LINE_TIMEOUT_S) -> None:
            deadline = time.monotonic() + bound
            while not done_yet():  # type: ignore[operator]
                if time.monotonic() > deadline or set(agents.exited_at) - {killed_agent}:
                    raise BenchError(f"{what} ({agents.stderr_tail()})")
                read(0.02)

        killed_agent = 1  # ``other``: its exit after the kill is expected
        host = agents.start(launcher.argv("2:2", endpoint, rdzv_id, host_conf, script, done))
        other = agents.start(launcher.argv("2:2", endpoint, rdzv_id, other_conf, script, done))
        wait_for(lambda: host in worlds and other in worlds, "no world of 2 nodes")
        said_spare = False
        if variant == "spare":
            third = agents.start(launcher.argv("2:2", endpoint, rdzv_id, other_conf, script, done))
            stderr = agents.stderr_file(third)

            def waits() -> bool:
                with open(stderr, errors="replace") as file:
                    return "waiting as a spare" in file.read()

            wait_for(waits, "the spare did not say it waits")
            said_spare = True
        settle = time.monotonic() + SETTLE_S + (rep % 5) * PHASE_STEP_S
        while time.monotonic() < settle:
            read(settle - time.monotonic())
        killed = time.time()
        os.kill(agents.procs[other].pid, signal.SIGKILL)
        if variant == "cold":
            third = agents.start(launcher.argv("2:2", endpoint, rdzv_id, other_conf, script, done))

        def back() -> bool:
            return all(
                any(at >= killed and world == 2 for world, at in worlds.get(agent, []))
                for agent in (host, third)
            )

        recovered: float | None = None
        try:
            wait_for(back, "no recovery", BOUND_S)
        except BenchError as exc:
            log(f"{launcher.backend} {variant}: {exc}")
        else:
            recovered = max(
                max(at for world, at in worlds[agent] if at >= killed) for agent in (host, third)
            )
        with open(done, "w"):
            pass
        with contextlib.suppress(BenchError):
            agents.wait_all(10.0)
    return Run(None if recovered is None else recovered - killed, said_spare)


def run(ctx: harness.Context) -> list[Check]:
    opts = ctx.opts
    relaunch, torchrun = ctx.launchers(Launcher)
    torchrun.unavailable = "relaunch only (torchrun's spares are not measured here)"
    etcd = Launcher(ETCD, relaunch.prefix, "not started", "etcd")
    bench = ctx.bench(Bench, relaunch, torchrun, etcd=etcd, backends=tuple(opts.backends))
    checks: list[Check] = []
    budget = DETECTION_S + BUDGET_OVER_DETECTION_S
    print(
        "\n--nnodes 2:2, one worker a node; SIGKILL of one node -> both workers of the new world"
        f"\nof 2 running (s since the kill; median [min-max] of {opts.reps}); --rdzv-conf {CONF}"
    )
    print(f"{'backend':<8} {'variant':<6} {'recovered':>9} {'kill -> world of 2 again':>26}")
    try:
        if "etcd" in opts.backends:
            start_etcd(bench)
        for backend in opts.backends:
            launcher = relaunch if backend == "c10d" else etcd
            if launcher.unavailable is not None:
                print(f"{backend:<8} not measured: {launcher.unavailable}")
                continue
            log(f"{backend}: {opts.reps} runs of each variant, alternating")
            sides = {
                variant: (lambda rep, v=variant, lch=launcher: reform_run(bench, lch, v, rep))
                for variant in VARIANTS
            }
            errors: dict[str, str] = {}
            samples = harness.run_alternating(
                sides, dict.fromkeys(sides, opts.reps), errors, bench.collect
            )
            medians: dict[str, float | None] = {}
            for variant in VARIANTS:
                runs: list[Run] = samples.get(variant, [])
                times = [r.recovered_s for r in runs if r.recovered_s is not None]
                medians[variant] = median(times) if times else None
                shown = spread([t * 1e3 for t in times]) + " ms" if times else "-"
                note = f"  ({errors[variant]})" if variant in errors else ""
                print(
                    f"{backend:<8} {variant:<6} {len(times):>4} of {len(runs):<2} {shown:>26}{note}"
                )
                checks.append(
                    Check(
                        f"{backend}: {variant} -> every run recovered",
                        f"{len(times)} of {len(runs)}",
                        f"{opts.reps} of {opts.reps}",
                        bool(runs) and len(times) == len(runs) == opts.reps,
                    )
                )
            spare, cold = medians["spare"], medians["cold"]
            ctx.data[backend] = {"spare_s": spare, "cold_s": cold}
            checks.append(
                Check(
                    f"{backend}: kill -> world of 2, spare (cold: {fmt(cold, '.2f')} s)",
                    f"{fmt(spare, '.2f')} s",
                    f"<= {budget:g} s",
                    None if spare is None else spare <= budget,
                )
            )
        bench.collect(RELAUNCH)
    finally:
        checks += stop_etcd(bench)
    return checks
