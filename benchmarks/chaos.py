"""Chaos runs: faults at random moments in real relaunch jobs, and whether each job survives.

The long version of tests/chaos/test_chaos.py, on the same library (tests/chaos/harness.py):
``--runs`` runs chosen by a seeded generator, each on one of three topologies (one node, two
nodes on the built-in store, two on etcd) with one fault (SIGKILL, SIGTERM or SIGSEGV to a
worker, an exit code, or SIGKILL to a node's agent). Every run must survive with the right
result, leave no process behind, lose no log line and name the fault in its report. Examples::

    python -m benchmarks chaos --runs 70 --seed 1 --table
    python -m benchmarks chaos --runs 20 --no-etcd
    python -m benchmarks chaos --seed 1 --only 2 -v     # rerun run 2 of seed 1, with stderr
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time
from typing import Any

from benchmarks.harness import Check, Context, log
from tests.chaos import harness as chaos

LAUNCHERS = False  # relaunch only
ORPHANS = False  # every process of a run carries the run's mark: that is what counts

QUICK = {"runs": 3, "seed": 24}


def _names(text: str) -> list[str]:
    names = [name for name in text.split(",") if name]
    for name in names:
        if name not in chaos.TOPOLOGIES:
            known = ", ".join(chaos.TOPOLOGIES)
            raise argparse.ArgumentTypeError(f"unknown topology {name!r} ({known})")
    return names


def _indexes(text: str) -> list[int]:
    return [int(index) for index in text.split(",") if index]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=20, help="number of runs (default: 20)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    parser.add_argument(
        "--topologies",
        type=_names,
        default=list(chaos.TOPOLOGIES),
        help="comma-separated: single,c10d,etcd (default: all)",
    )
    parser.add_argument(
        "--etcd",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="include the etcd topology (default: yes)",
    )
    parser.add_argument(
        "--only", type=_indexes, default=None, help="run only these runs of the seed, e.g. 3,17"
    )
    parser.add_argument("--steps", type=int, default=chaos.STEPS, help="steps of the job")
    parser.add_argument(
        "--keep", action="store_true", help="keep all run directories (failed ones are always kept)"
    )
    parser.add_argument("--dir", default=None, help="where the run directories go")
    parser.add_argument("--table", action="store_true", help="also print a markdown table")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="show the agents' stderr for a failed run"
    )


def start_etcd() -> Any:
    """A single-member etcd (tests/etcd_cluster.py) for the etcd topology."""
    if shutil.which("etcd") is None:
        raise SystemExit(
            "chaos: no etcd binary on PATH (Debian: apt-get install etcd-server); "
            "use --no-etcd to leave the etcd topology out"
        )
    from tests.etcd_cluster import EtcdCluster

    return EtcdCluster(1).start()


def run(ctx: Context) -> list[Check]:
    opts = ctx.opts
    topologies = [name for name in opts.topologies if opts.etcd or name != "etcd"]
    if not topologies:
        raise SystemExit("chaos: no topology left")
    seed = opts.seed if opts.seed is not None else random.randrange(1 << 31)
    runs = max(opts.only) + 1 if opts.only else opts.runs
    plans = chaos.plan_runs(seed, runs, topologies)
    if opts.only:
        plans = [plan for plan in plans if plan.index in opts.only]
    base = opts.dir or tempfile.mkdtemp(prefix="relaunch-chaos-")
    os.makedirs(base, exist_ok=True)
    started = time.monotonic()
    print(f"  seed {seed}, {len(plans)} runs, topologies {','.join(topologies)}")
    print(
        f"  reproduce: python -m benchmarks chaos --seed {seed} --runs {runs} "
        f"--topologies {','.join(topologies)}; directories under {base}",
        flush=True,
    )
    cluster = start_etcd() if "etcd" in {plan.topology for plan in plans} else None
    outcomes = []
    try:
        for plan in plans:
            endpoints = cluster.endpoints if cluster else ""
            outcome = chaos.run_plan(plan, base, endpoints, mark=ctx.mark, steps=opts.steps)
            outcomes.append(outcome)
            print(outcome.line() if outcome.ok else outcome.explain(opts.verbose), flush=True)
            if outcome.ok and not opts.keep:
                shutil.rmtree(outcome.run_dir, ignore_errors=True)
    except KeyboardInterrupt:
        log("interrupted")
    finally:
        if cluster is not None:
            cluster.stop()
    print(f"\nchaos summary (seed {seed}, {time.monotonic() - started:.0f} s)")
    print("\n".join(chaos.summarize(outcomes)))
    if opts.table:
        print()
        print("\n".join(chaos.table(outcomes)))
    failed = [o for o in outcomes if not o.ok]
    if failed:
        print(
            f"\nfailed runs: {', '.join(str(o.plan.index) for o in failed)} (rerun one with "
            f"--seed {seed} --only N; directories kept under {base})"
        )
    elif not opts.keep and not opts.dir:
        shutil.rmtree(base, ignore_errors=True)
    n = len(plans)
    ctx.data.update(
        seed=seed,
        runs=[
            {
                "plan": outcome.plan.label(),
                "ok": outcome.ok,
                "seconds": round(outcome.seconds, 2),
                "recovery": outcome.recovery,
                "problems": outcome.problems(),
            }
            for outcome in outcomes
        ],
    )
    leaked = sum(len(o.leaked) for o in outcomes)
    lost = sum(len(o.lost) for o in outcomes)
    lines = sum(o.lines for o in outcomes)
    return [
        Check(
            "runs passing every check",
            f"{len(outcomes) - len(failed)} of {n}",
            f"{n}",
            not failed and len(outcomes) == n,
        ),
        Check(
            "survived (exit 0, right result)",
            f"{sum(o.survived for o in outcomes)} of {n}",
            f"{n}",
            all(o.survived for o in outcomes),
        ),
        Check("processes leaked by the runs", str(leaked), "0", not leaked),
        Check("log lines lost", f"{lost} of {lines}", "0", not lost),
        Check(
            "reports naming the fault",
            f"{sum(o.report_ok for o in outcomes)} of {n}",
            f"{n}",
            all(o.report_ok for o in outcomes),
        ),
    ]
