"""Measurement 4: re-forming at scale: one node of N crashed, or one more joining N, until
every member is back in the new round."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import BenchError, Check, fmt, log, verdict
from benchmarks.rendezvous.shared import BACKENDS, Bench, proc_cpu
from benchmarks.rendezvous.simstore import (
    SIM_JOIN_TIMEOUT,
    SIM_LOCAL_WORLD_SIZE,
    SIM_PROCS,
    SIM_SWITCH_NOTE,
    raise_nofile,
    sim_store,
    simulation,
)
from relaunch.rendezvous.api import RendezvousInfo
from tests.support.simnodes import (
    Back,
    Reform,
    SimJob,
    check_world,
    summarize,
    wait_beating,
    wait_threads_gone,
)

REFORM_NODES = (1024,)
# The default keep-alive, dead after 5 s * 3: with 1 s * 3, etcd, sharing this VM's two cores
# with 1,024 simulated nodes, let live leases expire.
REFORM_INTERVAL_S = 5.0
REFORM_MAX_ATTEMPT = 3
REFORM_ROUND_S = 2.0  # beyond the keep-alive detection: every member back (issue 14)
REFORM_TIMEOUT_S = 120.0  # how long a re-forming may take before it counts as failed


@dataclass
class ReformResult:
    """One re-forming measured (``reform`` None: it could not be), with its bounds."""

    store: str
    event: str  # "lost" or "joined"
    nodes: int  # nodes running before the event
    detection_s: float  # the keep-alive detection bound (lost_node_grace); 0 for a join
    formed_s: float | None  # the first round: release -> all back
    reform: Reform | None
    problems: list[str]
    server_cpu_s: float | None = None  # event -> all back: the store server, or etcd
    client_cpu_s: float | None = None  # the same span: the simulating processes


def reform_settings(event: str, nodes: int, join_timeout: float) -> Any:
    """``lost``: min N - 1, max N (the survivors may re-form); ``joined``: min N, max N + 1
    (room for one more)."""
    from relaunch.core.rendezvous.rounds import Settings

    low, high = (nodes - 1, nodes) if event == "lost" else (nodes, nodes + 1)
    return Settings(
        min_nodes=low,
        max_nodes=high,
        join_timeout=join_timeout,
        last_call_timeout=1,
        keep_alive_interval=REFORM_INTERVAL_S,
        keep_alive_max_attempt=REFORM_MAX_ATTEMPT,
    )


@dataclass
class NodeView:
    """A simulated node as a worker process reports it (picklable; see simnodes.NodeLike)."""

    index: int
    backs: list[Back]
    notified: list[float]
    called: list[float]


def reform_worker(
    conn: Any, job_args: tuple[str, Any, Callable[[], Any], bool], first: int
) -> None:
    """A worker process of the re-form measurement (forked): a SimJob whose nodes are numbered
    from ``first``, driven by the parent's commands over ``conn`` (see ReformWorkers)."""
    run, settings, make_store, leases = job_args
    closed = False
    with simulation():
        job = SimJob(run, settings, make_store, leases, SIM_LOCAL_WORLD_SIZE)
        try:
            while True:
                command, arg = conn.recv()
                if command == "add":
                    job.add(arg)
                    reply: Any = len(job.nodes)
                elif command == "go":  # at perf_counter() ``arg``, every node not started yet
                    time.sleep(max(0.0, arg - time.perf_counter()))
                    fresh = [n for n in job.nodes if n.thread is None]
                    job.start(fresh, barrier=len(fresh) > 1)
                    reply = None
                elif command == "backs":
                    reply = (job.total_backs, job.errors())
                elif command == "views":
                    reply = [
                        NodeView(
                            first + n.index,
                            [Back(b.at, _without_store(b.info)) for b in n.backs],
                            list(n.notified),
                            list(n.called),
                        )
                        for n in job.nodes
                    ]
                elif command == "kill":
                    reply = job.kill(job.nodes[arg - first])
                elif command == "stop":  # nodes stuck in a round that never forms stay: 10 s
                    job.stop(10.0)
                    reply = None
                elif command == "close":
                    closed = True
                    conn.send(job.close(10.0) + wait_threads_gone(10.0))
                    return
                else:
                    reply = f"unknown command {command!r}"
                conn.send(reply)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                conn.send(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            if not closed:
                job.close(10.0)
            conn.close()


class ReformWorkers:
    """The nodes of one re-form job, spread over ``procs`` forked worker processes."""

    def __init__(self, job: SimJob, procs: int, nodes: int) -> None:
        import multiprocessing

        context = multiprocessing.get_context("fork")
        self.job = job  # this process's view: keys, observers; it runs no node
        sizes = [nodes // procs + (1 if i < nodes % procs else 0) for i in range(procs)]
        self.firsts = [sum(sizes[:i]) for i in range(procs)]
        self.sizes = sizes
        self.workers: list[tuple[Any, Any]] = []
        args = (job.run_id, job.settings, job.make_store, job.leases)
        for first in self.firsts:
            parent, child = context.Pipe()
            proc = context.Process(target=reform_worker, args=(child, args, first), daemon=True)
            proc.start()
            child.close()
            self.workers.append((proc, parent))

    def ask(self, command: str, arg: Any = None, only: int | None = None) -> list[Any]:
        """Send ``command`` to every worker (or worker ``only``); their replies."""
        chosen = self.workers if only is None else [self.workers[only]]
        for _, conn in chosen:
            conn.send((command, arg))
        replies = [conn.recv() for _, conn in chosen]
        for reply in replies:
            if isinstance(reply, str):
                raise BenchError(f"a worker process failed: {reply}")
        return replies

    def owner(self, index: int) -> int:
        return max(w for w, first in enumerate(self.firsts) if first <= index)

    def wait_backs(self, total: int, timeout: float) -> list[str]:
        """Wait until the nodes returned ``total`` times in all; the errors (a timeout too)."""
        deadline = time.monotonic() + timeout
        while True:
            replies = self.ask("backs")
            errors = [e for _, errs in replies for e in errs]
            if errors or sum(n for n, _ in replies) >= total:
                return errors
            if time.monotonic() > deadline:
                return [f"not back within {timeout:g}s"]
            time.sleep(0.05)

    def views(self) -> list[NodeView]:
        return [view for views in self.ask("views") for view in views]

    def cpu(self) -> float:
        """CPU seconds the worker processes used so far."""
        return sum(proc_cpu(proc.pid) for proc, _ in self.workers)

    def close(self) -> list[str]:
        left: list[str] = []
        with contextlib.suppress(OSError, EOFError, BenchError):
            self.ask("stop")  # every node stops before any handler shuts down
        for proc, conn in self.workers:
            try:
                conn.send(("close", None))
                left += conn.recv() if conn.poll(60) else ["(no answer)"]
            except (OSError, EOFError):
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
                left.append(f"worker {proc.pid} killed")
            conn.close()
        self.job.close(10.0)
        return left


def reform_run(
    bench: Bench,
    on_etcd: bool,
    event: str,
    nodes: int,
    procs: int = SIM_PROCS,
    *,
    server_clients: int,
) -> ReformResult:
    """N nodes (threads of ``procs`` processes) form a round; then one crashes (``lost``), or
    one more joins (``joined``), and every member that hears of it calls next_rendezvous()
    again, as the agent does."""
    store = "etcd" if on_etcd else "c10d"
    run = f"reform-{event}{nodes}-{uuid.uuid4().hex[:12]}"
    join_timeout = SIM_JOIN_TIMEOUT[store]
    settings = reform_settings(event, nodes, join_timeout)
    detection = 0.0
    if event == "lost":  # the handler's own bound: its lease granularity included on etcd
        from relaunch.rendezvous.kinds_counter import CounterKind
        from relaunch.rendezvous.kinds_etcd import EtcdKind

        detection = (EtcdKind if on_etcd else CounterKind).lost_node_grace(settings)
    with sim_store(bench, on_etcd, run, server_clients, counted=False) as (make_store, server_cpu):
        job = SimJob(run, settings, make_store, on_etcd, SIM_LOCAL_WORLD_SIZE)
        workers = ReformWorkers(job, max(1, min(procs, nodes)), nodes)
        try:
            for w, size in enumerate(workers.sizes):
                workers.ask("add", size, only=w)
            started = time.perf_counter()
            workers.ask("go", time.perf_counter() + 0.05)
            errors = workers.wait_backs(nodes, join_timeout)
            views = workers.views()
            formed_s = max((v.backs[0].at for v in views if v.backs), default=started) - started
            problems = errors or check_world(
                [v.backs[0].info for v in views], nodes, SIM_LOCAL_WORLD_SIZE
            )
            if problems:
                return ReformResult(store, event, nodes, detection, None, None, problems)
            log(f"    first round of {nodes} back in {formed_s:.2f} s (connections included)")
            wanted = {v.index: len(v.backs) + 1 for v in views}
            seen, observer = job.observe_changed(job.current_round(), detection + REFORM_TIMEOUT_S)
            cpu_before = (server_cpu(), workers.cpu())
            if event == "lost":
                victim = next(v for v in views if v.backs[0].info.group_rank == nodes // 2)
                if not wait_beating(job, victim, 60.0):
                    return ReformResult(
                        store, event, nodes, detection, formed_s, None, ["no heartbeat"]
                    )
                (t0,) = workers.ask("kill", victim.index, only=workers.owner(victim.index))
                del wanted[victim.index]
                errors = workers.wait_backs(nodes + nodes - 1, detection + REFORM_TIMEOUT_S)
            else:  # the last worker's next node: numbered N
                late, last = nodes, len(workers.workers) - 1
                workers.ask("add", 1, only=last)
                workers.ask("go", 0.0, only=last)
                wanted[late] = 1
                errors = workers.wait_backs(nodes + nodes + 1, REFORM_TIMEOUT_S)
            server_cpu_s, client_cpu_s = server_cpu() - cpu_before[0], workers.cpu() - cpu_before[1]
            if errors:
                log(f"    {len(errors)} error(s), the first: {errors[0]}")
            views = workers.views()
            members = [v for v in views if v.index in wanted]
            if event == "joined":
                t0 = next(v for v in views if v.index == late).called[0]
            observer.join(REFORM_TIMEOUT_S)  # written before anyone re-formed; seen by now
            reform = summarize(event, t0, members, wanted, seen, errors, SIM_LOCAL_WORLD_SIZE)
            return ReformResult(
                store,
                event,
                nodes,
                detection,
                formed_s,
                reform,
                reform.problems,
                server_cpu_s,
                client_cpu_s,
            )
        finally:
            left = workers.close()
            if left:
                log(f"    left running after the job closed: {sorted(set(left))[:5]}")


def reform_budget(res: ReformResult) -> float:
    """Event -> every member back: the keep-alive detection plus REFORM_ROUND_S."""
    return res.detection_s + REFORM_ROUND_S


def bench_reform(
    bench: Bench, sizes: Sequence[int], procs: int = SIM_PROCS, *, server_clients: int
) -> list[Check]:
    """Measurement 4 for every N in ``sizes``, one node lost and one joining, on a store server
    expecting ``server_clients`` connections: its table and checks."""
    soft, hard = raise_nofile()
    stores = [b for b in BACKENDS if b in bench.backends]
    log(
        f"[4/4] re-forming: N in {tuple(sizes)} nodes as threads ({', '.join(stores)}), one"
        f" crashed, then one joining (RLIMIT_NOFILE {soft}/{hard})"
    )
    results: list[ReformResult] = []
    errors: list[str] = []
    with simulation():
        for store in stores:
            if store == "etcd" and bench.etcd.unavailable is not None:
                errors.append(f"etcd: {bench.etcd.unavailable}")
                continue
            for nodes in sizes:
                if 3 * nodes + 256 > soft:
                    errors.append(f"RLIMIT_NOFILE {soft} is too low for {nodes} nodes")
                    continue
                for event in ("lost", "joined"):
                    log(f"  {store}, N={nodes}: one node {event}")
                    try:
                        res = reform_run(
                            bench,
                            store == "etcd",
                            event,
                            nodes,
                            procs,
                            server_clients=server_clients,
                        )
                    except Exception as exc:  # a failure of relaunch: report it
                        errors.append(f"{store}, N={nodes}, {event}: {type(exc).__name__}: {exc}")
                        log(f"    {errors[-1]}")
                        continue
                    results.append(res)
                    r = res.reform
                    log(
                        f"    all back {fmt(r.all_back if r else None, '.2f')} s after the"
                        f" {'crash' if event == 'lost' else 'call'}; {res.problems or 'valid'}"
                    )

    print(
        f"\n4. Re-forming at scale: N nodes as threads of {procs} forked processes (each a"
        " DynamicRendezvousHandler with its"
        f"\n   rendezvous, heartbeat and watch stores, leases on etcd), keep_alive_interval"
        f" {REFORM_INTERVAL_S:g} s,\n   keep_alive_max_attempt {REFORM_MAX_ATTEMPT},"
        f" local_world_size {SIM_LOCAL_WORLD_SIZE}. lost: min N-1, max N; the node of group"
        " rank N/2\n   crashes"
        " (its stores fail every call from then on: no clean-up, no lease revoked), and its"
        "\n   ring neighbour must see its heartbeat stop. joined: min N, max N+1; one more node"
        " calls\n   next_rendezvous(). Every member hearing of the change (its change listener)"
        " calls next_rendezvous()\n   again, as the agent does. Seconds since the crash (the"
        " new node's call): changed = the round's\n   `changed` record seen written (by a"
        " watcher of our own), notified = a member's listener called,\n   all back = the last"
        " member's next_rendezvous() returned with the new world. Budget: detection\n   (the"
        " handler's lost_node_grace: interval * max_attempt + one beat, on etcd rounded up to"
        " the lease's\n   whole seconds + 1 s; 0 for a join) + 2 s. Worker restart is not"
        " simulated: measurement 2 (death)\n   times it with real agents, SIGKILL -> the"
        " survivor's worker running again. CPU seconds from the event to all back: the"
        " store\n   server (or etcd) and the simulating processes (for a crash, the"
        f" heartbeats of the detection too).\n   {SIM_SWITCH_NOTE}\n"
    )
    print(
        "| N | backend | event | detection bound | changed | first notified | last notified"
        " | all back | budget | round (all back - changed) | server CPU | client CPU |"
    )
    print("|--:|---|---|--:|--:|--:|--:|--:|---|--:|--:|--:|")
    checks: list[Check] = []
    for res in results:
        r = res.reform
        budget = reform_budget(res)
        back = r.all_back if r else None
        ok = None if back is None else back <= budget and not res.problems
        round_s = back - r.changed if r and back is not None and r.changed is not None else None
        label = f"1 of {res.nodes} lost" if res.event == "lost" else f"1 joins {res.nodes}"
        print(
            f"| {res.nodes:,} | {res.store} | {label} | {res.detection_s:.1f}"
            f" | {fmt(r.changed if r else None, '.2f')}"
            f" | {fmt(r.first_notified if r else None, '.2f')}"
            f" | {fmt(r.last_notified if r else None, '.2f')}"
            f" | {fmt(back, '.2f')} | <= {budget:g} s {verdict(ok)} | {fmt(round_s, '.2f')}"
            f" | {fmt(res.server_cpu_s, '.2f')} | {fmt(res.client_cpu_s, '.2f')} |"
        )
        checks.append(
            Check(
                f"{label} -> all back ({res.store})",
                f"{fmt(back, '.2f')} s",
                f"<= {res.detection_s:g} + {REFORM_ROUND_S:g} s",
                ok,
            )
        )
        if res.event == "lost":
            checks.append(
                Check(
                    f"{label}: changed written -> all back ({res.store})",
                    f"{fmt(round_s, '.2f')} s",
                    f"<= {REFORM_ROUND_S:g} s",
                    None if round_s is None else round_s <= REFORM_ROUND_S,
                )
            )
        for problem in res.problems[:10]:
            print(f"  {res.store}, {label}: INVALID: {problem}")
    for error in errors:
        print(f"  not measured: {error}")
        checks.append(Check(f"re-forming: {error}"[:90], "-", "-", None))
    return checks


def _without_store(info: RendezvousInfo) -> RendezvousInfo:
    """``info`` with no store, to send to another process."""
    return RendezvousInfo(
        None,
        info.rank,
        info.world_size,
        info.bootstrap_store_info,
        rank_offset=info.rank_offset,
        global_world_size=info.global_world_size,
        role_rank_offset=info.role_rank_offset,
        role_world_size=info.role_world_size,
    )
