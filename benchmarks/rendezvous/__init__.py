"""The dynamic rendezvous (c10d and etcd): joining, losing a node, N simulated nodes, re-forming.

Run by hand (not part of the test suite): ``python -m benchmarks rendezvous [--quick]``
(``--backends etcd``: the etcd parts alone; ``--only sim``, ``--only reform``: one part).

Five measurements, the first four on two rendezvous backends: the built-in store (``c10d``) and etcd
(``etcd``, a single-member etcd v3 that the benchmark starts from ``/usr/bin/etcd`` with
tests/etcd_cluster.py and stops at the end). The first two run the ``relaunch`` command on both
backends and, where ``torch`` can be imported, torchrun (``python -m torch.distributed.run``) on
c10d with the same flags (only the heartbeat settings differ, see ``DEATH_CONF``), alternating:
K agents started at once until all K workers run, and a node SIGKILLed until the survivor's
worker runs again. The third runs relaunch's rendezvous for 256, 1,024 and 4,096 nodes as
threads of 8 processes, on real sockets to one store server (a TcpStoreServer in a process of
its own, or the etcd member), all at once and then one by one, and counts the store operations
of each node (and, on etcd, the HTTP requests) and the server's and clients' CPU. The fourth
runs 1,024 such nodes with heartbeats, crashes one (or adds one) and times the re-forming
(tests/support/simnodes.py). The fifth loses the built-in store's host in a job of 3 (c10d,
relaunch naming three hosts so that the store moves; torchrun for comparison). Only
relaunch's numbers are checked against budgets; torchrun's
are for comparison. Standard library only (plus the etcd binary for the etcd side); the exit
status is 0 when every relaunch budget was measured and holds. See benchmarks/README.md for
what each measurement means.

One module per measurement: ``join`` (1), ``death`` (2), ``sim`` (3), ``reform`` (4) and ``host``
(5); what they
share is in ``shared`` (the sides, the etcd member, the agents of a run) and ``simstore`` (the
store server of the simulated nodes of 3 and 4). This module is the benchmark: its options and
``run``.
"""

from __future__ import annotations

import argparse

from benchmarks import harness
from benchmarks.harness import RELAUNCH, TORCHRUN, BenchError, Check, log
from benchmarks.rendezvous.death import DEATH_BOUND_S, bench_death
from benchmarks.rendezvous.host import bench_host
from benchmarks.rendezvous.join import JOIN_NODES, bench_join, join_run
from benchmarks.rendezvous.reform import REFORM_NODES, bench_reform
from benchmarks.rendezvous.shared import (
    BACKENDS,
    ETCD,
    Bench,
    Launcher,
    etcd_version,
    start_etcd,
    stop_etcd,
)
from benchmarks.rendezvous.sim import ETCD_SIM_NODES, SIM_NODES, STAGGER_NODES, bench_sim
from benchmarks.rendezvous.simstore import SIM_PROCS


def warm_up(bench: Bench) -> None:
    """One untimed single-node run of each launcher (on its backend): fills the bytecode cache
    with every module the measurements import, and drops a launcher that cannot run at all."""
    for lch in bench.launchers():
        try:
            join_run(bench, lch, 1)
        except (BenchError, OSError) as exc:
            lch.unavailable = f"the warm-up run failed: {exc}"
            log(f"  {lch.name}: {lch.unavailable}")
        bench.collect(lch.name)


def backend_list(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in BACKENDS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a comma-separated list of {', '.join(BACKENDS)}"
        )
    return names


def node_list(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(n) for n in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected node counts, e.g. 256,1024")
    return sizes


QUICK = {
    "reps": 1,
    "torchrun_reps": 1,
    "death_torchrun_reps": 1,
    "sim_reps": 1,
    "join_nodes": (2, 4),
    "sim_nodes": (64, 256),
    "stagger_nodes": (16, 64),
    "etcd_sim_nodes": (64, 256),
    "reform_nodes": (64,),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=5, help="relaunch repetitions (1 and 2)")
    parser.add_argument(
        "--torchrun-reps", type=int, default=3, help="torchrun repetitions of measurement 1"
    )
    parser.add_argument(
        "--death-torchrun-reps",
        type=int,
        default=2,
        help=f"torchrun repetitions of measurement 2 (each takes ~{DEATH_BOUND_S + 12:.0f} s)",
    )
    parser.add_argument("--sim-reps", type=int, default=3, help="repetitions per N of 3 (c10d)")
    parser.add_argument(
        "--etcd-sim-reps",
        type=int,
        default=1,
        help="repetitions per N of 3 on etcd",
    )
    parser.add_argument(
        "--etcd-sim-nodes",
        type=node_list,
        default=",".join(map(str, ETCD_SIM_NODES)),
        help="N of 3 on etcd, at once (default: %(default)s)",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=("join", "death", "sim", "reform", "host"),
        help="run only these measurements (repeatable)",
    )
    parser.add_argument(
        "--backends",
        type=backend_list,
        default=BACKENDS,
        help="rendezvous backends to measure, comma-separated: c10d (with torchrun), etcd "
        "(default: c10d,etcd; etcd alone: --backends etcd)",
    )
    parser.add_argument(
        "--join-nodes", type=node_list, default=JOIN_NODES, help="K of 1 (default: 2,4,8)"
    )
    parser.add_argument(
        "--sim-nodes",
        type=node_list,
        default=",".join(map(str, SIM_NODES)),
        help="N of 3 on c10d, at once (default: %(default)s)",
    )
    parser.add_argument(
        "--sim-procs",
        type=int,
        default=SIM_PROCS,
        help="spread the nodes of 3 (at once) over this many processes (default: %(default)s)",
    )
    parser.add_argument(
        "--reform-nodes",
        type=node_list,
        default=",".join(map(str, REFORM_NODES)),
        help="N of 4, re-forming (default: %(default)s)",
    )
    parser.add_argument(
        "--stagger-nodes",
        type=node_list,
        default=STAGGER_NODES,
        help="N of 3, one by one (default: 64,256)",
    )


def run(ctx: harness.Context) -> list[Check]:
    """The measurements asked for, on the sides asked for; relaunch's checks (the etcd side's
    are printed apart, out of the exit status)."""
    opts = ctx.opts
    only = set(opts.only or ("join", "death", "sim", "reform", "host"))
    checks: list[Check] = []
    relaunch, torchrun = ctx.launchers(Launcher)
    if "c10d" not in opts.backends:
        torchrun.unavailable = f"--backends {','.join(opts.backends)}"
    etcd = Launcher(ETCD, relaunch.prefix, "not started", "etcd")
    bench = ctx.bench(Bench, relaunch, torchrun, etcd=etcd, backends=opts.backends)
    try:
        if "etcd" in opts.backends:
            start_etcd(bench)
            where = (
                f"one member at {bench.cluster.endpoints} (tests/etcd_cluster.py)"
                if bench.cluster is not None
                else f"not run: {etcd.unavailable}"
            )
            print(f"  etcd: {etcd_version()}, {where}")
        if only & {"join", "death", "host"}:
            log("warm-up: one single-node run of each launcher")
            warm_up(bench)
        if "join" in only:
            checks += bench_join(bench, opts.reps, opts.torchrun_reps, opts.join_nodes)
        if "death" in only:
            checks += bench_death(bench, opts.reps, opts.death_torchrun_reps)
        if "host" in only:
            checks += bench_host(bench, opts.reps, opts.death_torchrun_reps)
        if "sim" in only:
            checks += bench_sim(
                bench,
                opts.sim_reps,
                opts.etcd_sim_reps,
                opts.etcd_sim_nodes,
                opts.sim_procs,
                opts.sim_nodes,
                opts.stagger_nodes,
            )
        if "reform" in only:
            # The store server of 3's largest N, so that 3 and 4 measure the same server.
            checks += bench_reform(
                bench, opts.reform_nodes, opts.sim_procs, server_clients=2 * max(opts.sim_nodes)
            )
        bench.collect(RELAUNCH)
    finally:
        checks += stop_etcd(bench)
    bench.collect(ETCD if "c10d" not in opts.backends else RELAUNCH)
    # Only relaunch's leftovers fail the run; torchrun's are shown.
    ours = [item for side in (RELAUNCH, ETCD) for item in bench.by_side.get(side, [])]
    ctx.leftovers[:] = ours
    if bench.etcd_checks:
        harness.print_summary(
            bench.etcd_checks,
            "etcd side, against the same budgets (for comparison, not in the exit status)",
        )
    for leftover in bench.by_side.get(TORCHRUN, []):
        print(f"  left behind by torchrun (killed): {leftover}")
    return checks
