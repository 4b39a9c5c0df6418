"""Measurement 3: N nodes as threads of forked processes on one store server, all at once
and one by one: time to every next_rendezvous() back, store operations and HTTP requests per
node, the server's and clients' CPU."""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.harness import BenchError, Check, fmt, log, median, verdict
from benchmarks.rendezvous.shared import BACKENDS, Bench
from benchmarks.rendezvous.simstore import (
    SIM_JOIN_TIMEOUT,
    SIM_LOCAL_WORLD_SIZE,
    SIM_SWITCH_NOTE,
    raise_nofile,
    sim_store,
    simulation,
)
from relaunch.store import Store

SIM_NODES = (256, 1024, 4096)
#: Barrier -> every next_rendezvous() returned, by N (a smaller N gets the budget of the next
#: budgeted one up): issue 14.
SIM_BUDGETS = {"c10d": {4096: 5.0}, "etcd": {1024: 5.0, 4096: 20.0}}
SIM_OPS_RATIO = 1.25  # ops per node at 1024 <= this * ops at 256 + SIM_OPS_SLACK
SIM_OPS_SLACK = 2
STAGGER_NODES = (64, 256)  # the same, with the nodes joining one after another
STAGGER_S = 0.005
ETCD_SIM_NODES = SIM_NODES
SIM_OPS = ("get", "set", "compare_set", "add", "delete", "wait", "watch")
#: EtcdStore's own operations: transactions, keys under a prefix
ETCD_OPS = (
    "txn",
    "count_prefix",
    "await_prefix_count",
    "range_prefix",
    "delete_prefix",
)
LEASE_OPS = ("grant_lease", "keep_alive", "revoke_lease")  # EtcdStore's, for the heartbeats


class CountingStore:
    """A ``Store`` that counts its calls by operation; everything else passes through. On etcd
    (an inner store with ``requests``, see counted_etcd_store) it also notes how many
    compare-and-set transactions each ``add`` took: EtcdStore.add is a CAS loop."""

    def __init__(self, inner: Store) -> None:
        self._inner: Any = inner  # a TcpStore, or an EtcdStore with leases and ``requests``
        self.counts = dict.fromkeys(SIM_OPS + LEASE_OPS + ETCD_OPS, 0)
        self.joined_at: float | None = None  # perf_counter() when the first add() returned
        self.cas_tries: list[int] = []  # etcd: transactions per add()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _count(self, op: str) -> None:
        self.counts[op] += 1

    def requests(self, path: str | None = None) -> int | None:
        """HTTP requests of the inner EtcdStore so far (to ``path``, or all); None on c10d."""
        requests: Counter[str] | None = getattr(self._inner, "requests", None)
        if requests is None:
            return None
        return requests[path] if path is not None else sum(requests.values())

    def get(self, key: str) -> Any:
        self._count("get")
        return self._inner.get(key)

    def set(self, key: str, value: bytes, **kwargs: Any) -> int:
        self._count("set")
        return int(self._inner.set(key, value, **kwargs))  # lease= on etcd

    def compare_set(self, key: str, expected_version: int, value: bytes, **kwargs: Any) -> Any:
        self._count("compare_set")
        return self._inner.compare_set(key, expected_version, value, **kwargs)  # also= on etcd

    def add(self, key: str, amount: int) -> int:
        self._count("add")
        before = self.requests("/v3/kv/txn")
        total = int(self._inner.add(key, amount))
        if before is not None:
            self.cas_tries.append((self.requests("/v3/kv/txn") or 0) - before)
        if self.joined_at is None:
            self.joined_at = time.perf_counter()
        return total

    def delete(self, key: str) -> bool:
        self._count("delete")
        return bool(self._inner.delete(key))

    def txn(self, compare: Any, success: Any, failure: Any) -> Any:
        self._count("txn")
        result = self._inner.txn(compare, success, failure)
        if self.joined_at is None:
            self.joined_at = time.perf_counter()
        return result

    def count_prefix(self, prefix: str) -> Any:
        self._count("count_prefix")
        return self._inner.count_prefix(prefix)

    def await_prefix_count(self, prefix: str, at_least: int, timeout: float) -> Any:
        self._count("await_prefix_count")
        return self._inner.await_prefix_count(prefix, at_least, timeout)

    def range_prefix(self, prefix: str, limit: int = 0) -> Any:
        self._count("range_prefix")
        return self._inner.range_prefix(prefix, limit)

    def delete_prefix(self, prefix: str) -> Any:
        self._count("delete_prefix")
        return self._inner.delete_prefix(prefix)

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        self._count("wait")
        self._inner.wait(keys, timeout)

    def watch(self, key: str, version: int, timeout: float) -> Any:
        self._count("watch")
        return self._inner.watch(key, version, timeout)

    def grant_lease(self, ttl: float) -> int:
        self._count("grant_lease")
        return int(self._inner.grant_lease(ttl))

    def keep_alive(self, lease: int) -> bool:
        self._count("keep_alive")
        return bool(self._inner.keep_alive(lease))

    def revoke_lease(self, lease: int) -> None:
        self._count("revoke_lease")
        self._inner.revoke_lease(lease)

    def total(self) -> int:
        return sum(self.counts.values())


@dataclass
class SimRun:
    nodes: int
    seconds: float  # release -> the last next_rendezvous() returned
    joined_s: float  # release -> the last node's join (its add) returned
    first_s: float  # release -> the first next_rendezvous() returned
    connect_s: float  # opening the 2 * N connections (not timed in ``seconds``)
    ops: list[int]  # rendezvous store operations per node
    by_op: dict[str, float]  # mean per node, by operation
    busiest: tuple[int, dict[str, int]]  # the busiest node: group rank, its ops by kind
    hb_ops: list[int]  # heartbeat store operations per node, once the first beat ran
    problems: list[str]  # validation failures
    cpu_s: float = 0.0  # CPU seconds of this process (all threads), release -> all back
    server_cpu_s: float = 0.0  # CPU seconds of the store server (etcd member), the same span
    requests: list[int] = field(default_factory=list)  # etcd: HTTP requests per node
    cas: list[int] = field(default_factory=list)  # etcd: transactions per join (add)
    by_path: dict[str, float] = field(default_factory=dict)  # etcd: requests per node, by path


@dataclass
class NodeRecord:
    """What one simulated node did (picklable: it may come from a worker process)."""

    result: tuple[int, int, int, int, str, int] | str  # RendezvousInfo's fields, or the error
    ended: float  # perf_counter() when next_rendezvous() returned (CLOCK_MONOTONIC: shared)
    counts: dict[str, int]  # rendezvous store operations, by kind
    joined_at: float | None
    requests: int | None  # etcd: HTTP requests
    by_path: dict[str, int]  # etcd: HTTP requests by path
    cas: list[int]  # etcd: transactions per add
    hb_ops: int = 0  # heartbeat store operations (its first beat)


@dataclass
class Batch:
    """Some of a round's simulated nodes, run by one process: when they were released and
    how much CPU that process used until they were all back."""

    connect_s: float
    released: float
    cpu_s: float
    records: list[NodeRecord]


def run_batch(
    make_store: Callable[[], Any],
    on_etcd: bool,
    run: str,
    settings: Any,
    count: int,
    offset: int,
    stagger: float,
    release: Callable[[], float],
    back: Callable[[], None],
) -> tuple[Batch, Callable[[], None]]:
    """Connect ``count`` nodes; ``release()`` blocks until they go and returns that
    ``perf_counter()``; run them (node ``offset + i`` starts ``(offset + i) * stagger`` late);
    ``back()`` once all are back. The batch, and what shuts its handlers down."""
    from relaunch.rendezvous.dynamic import DynamicRendezvousHandler
    from relaunch.rendezvous.kinds_etcd import handler_on_etcd

    handlers: list[Any] = []
    proxies: list[tuple[CountingStore, CountingStore, CountingStore | None]] = []

    def shutdown() -> None:
        for handler in handlers:
            handler.shutdown()

    try:
        started = time.perf_counter()
        for _ in range(count):
            store, heartbeat = CountingStore(make_store()), CountingStore(make_store())
            # etcd: the store the node's feed of the job's news follows (its one watch)
            watch = CountingStore(make_store()) if on_etcd else None
            proxies.append((store, heartbeat, watch))
            # A CountingStore passes every call through: on etcd, to an EtcdStore.
            build: Any = handler_on_etcd if on_etcd else DynamicRendezvousHandler.on_counters
            handler = build(
                run,
                store,
                settings,
                "127.0.0.1",
                heartbeat,
                watch_store=watch,
                backend="etcd" if on_etcd else "c10d",
            )
            handler.job.set_workers("default", SIM_LOCAL_WORLD_SIZE)
            handlers.append(handler)
        connect_s = time.perf_counter() - started
        results: list[Any] = [None] * count
        ended = [0.0] * count
        go = threading.Event()
        released: list[float] = []

        def node(index: int) -> None:
            go.wait()
            if stagger:
                wait = released[0] + (offset + index) * stagger - time.perf_counter()
                time.sleep(max(0.0, wait))
            try:
                info = handlers[index].next_rendezvous()
                results[index] = (
                    info.group_rank,
                    info.group_world_size,
                    info.global_world_size,
                    info.rank_offset,
                    info.master_addr,
                    info.master_port,
                )
            except Exception as exc:  # reported as a validation failure
                results[index] = f"{exc!r}"[:160]
            ended[index] = time.perf_counter()

        threads = [
            threading.Thread(target=node, args=(i,), name=f"node{offset + i}") for i in range(count)
        ]
        for thread in threads:
            thread.start()
        released.append(release())
        cpu_at = time.process_time()
        go.set()
        for thread in threads:
            thread.join()
        cpu_s = time.process_time() - cpu_at
        back()
        # Every member's heartbeat thread makes its first beat at once (the next one is
        # keep_alive_interval = 30 s away): wait until the counts stay still for 0.5 s.
        settle, still_since, last = time.monotonic() + 60, time.monotonic(), -1
        while time.monotonic() < settle:
            now_total = sum(hb.total() for _, hb, _ in proxies)
            if now_total != last:
                still_since, last = time.monotonic(), now_total
            elif time.monotonic() - still_since > 0.5 and all(hb.total() for _, hb, _ in proxies):
                break
            time.sleep(0.01)
        records = [
            NodeRecord(
                results[i],
                ended[i],
                {op: n for op, n in store.counts.items() if n},
                store.joined_at,
                requests_of(store, watch),
                dict(
                    Counter(getattr(store._inner, "requests", {}))
                    + Counter(getattr(getattr(watch, "_inner", None), "requests", {}))
                ),
                store.cas_tries,
                heartbeat.total(),
            )
            for i, (store, heartbeat, watch) in enumerate(proxies)
        ]
        return Batch(connect_s, released[0], cpu_s, records), shutdown
    except BaseException:
        shutdown()
        raise


def requests_of(store: CountingStore, watch: CountingStore | None) -> int | None:
    """The HTTP requests of a node's rendezvous store and its feed's store (None on c10d)."""
    requests = store.requests()
    if watch is None or requests is None:
        return requests
    return requests + (watch.requests() or 0)


#: run_batch's arguments up to ``stagger``
BatchArgs = tuple[Callable[[], Any], bool, str, Any, int, int, float]


def sim_worker(conn: Any, args: BatchArgs) -> None:
    """A worker process of a spread simulation (forked): runs one batch, talking to the parent
    over ``conn``: "ready" -> release time; "back" (its CPU); the batch; "end" -> shut down."""
    cpu: list[float] = []

    def release() -> float:
        conn.send("ready")
        at = float(conn.recv())
        time.sleep(max(0.0, at - time.perf_counter()))
        return at

    try:
        with simulation():
            batch, shutdown = run_batch(*args, release, lambda: conn.send("back"))
            cpu.append(batch.cpu_s)
            conn.send(batch)
            conn.recv()  # "end": every batch is in
            shutdown()
    except BaseException as exc:
        conn.send(f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def sim_run(
    bench: Bench,
    on_etcd: bool,
    nodes: int,
    rep: int,
    stagger: float = 0.0,
    procs: int = 1,
    *,
    server_clients: int,
) -> SimRun:
    """One round of ``nodes`` nodes, each a thread: all call next_rendezvous() at once, or, with
    ``stagger``, one after another that many seconds apart. On etcd, on the bench's cluster
    (EtcdStores, heartbeats by lease); else on a TcpStoreServer in a process of its own,
    expecting ``server_clients`` connections. With ``procs`` > 1 the nodes are spread over that
    many forked processes."""
    from relaunch.core.rendezvous.rounds import Settings

    backend = "etcd" if on_etcd else "c10d"
    run = f"sim{nodes}-{rep}-{uuid.uuid4().hex[:12]}"
    settings = Settings(
        min_nodes=nodes,
        max_nodes=nodes,
        join_timeout=SIM_JOIN_TIMEOUT[backend],
        last_call_timeout=1,
        keep_alive_interval=30,
    )
    procs = max(1, min(procs, nodes))
    with sim_store(bench, on_etcd, run, server_clients) as (make_store, server_cpu):
        server_at: list[float] = []
        if procs == 1:

            def release() -> float:
                server_at.append(server_cpu())
                return time.perf_counter()

            def all_back() -> None:
                server_at.append(server_cpu())

            batch, shutdown = run_batch(
                make_store, on_etcd, run, settings, nodes, 0, stagger, release, all_back
            )
            shutdown()
            batches = [batch]
        else:
            batches = spread_run(
                make_store, on_etcd, run, settings, nodes, stagger, procs, server_cpu, server_at
            )
    return sim_result(nodes, batches, server_at[1] - server_at[0])


def spread_run(
    make_store: Callable[[], Any],
    on_etcd: bool,
    run: str,
    settings: Any,
    nodes: int,
    stagger: float,
    procs: int,
    server_cpu: Callable[[], float],
    server_at: list[float],
) -> list[Batch]:
    """Run the round's nodes in ``procs`` forked processes, released together."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    sizes = [nodes // procs + (1 if i < nodes % procs else 0) for i in range(procs)]
    offsets = [sum(sizes[:i]) for i in range(procs)]
    workers = []
    try:
        for size, offset in zip(sizes, offsets, strict=True):
            parent, child = context.Pipe()
            args: BatchArgs = (make_store, on_etcd, run, settings, size, offset, stagger)
            proc = context.Process(target=sim_worker, args=(child, args), daemon=True)
            proc.start()
            child.close()
            workers.append((proc, parent))

        def expect(what: str) -> list[Any]:
            got = [conn.recv() for _, conn in workers]
            wrong = (
                [g for g in got if g != what] if what else [g for g in got if isinstance(g, str)]
            )
            if wrong:
                raise BenchError(f"a worker process failed: {wrong[0]}")
            return got

        expect("ready")
        release_at = time.perf_counter() + 0.05 + 0.002 * procs
        server_at.append(server_cpu())
        for _, conn in workers:
            conn.send(release_at)
        expect("back")
        server_at.append(server_cpu())
        batches: list[Batch] = expect("")
        for _, conn in workers:
            conn.send("end")
        return batches
    finally:
        for proc, conn in workers:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
                proc.join()
            conn.close()


def sim_result(nodes: int, batches: list[Batch], server_cpu_s: float) -> SimRun:
    """The round's figures from its batches."""
    records = [r for b in batches for r in b.records]
    t0 = min(b.released for b in batches)
    ops = [sum(r.counts.values()) for r in records]
    by_op = {
        op: statistics.fmean(r.counts.get(op, 0) for r in records) for op in SIM_OPS + ETCD_OPS
    }
    worst = max(range(nodes), key=ops.__getitem__)
    result = records[worst].result
    busiest = (result[0] if isinstance(result, tuple) else -1, records[worst].counts)
    joined = [r.joined_at for r in records if r.joined_at is not None]
    on_etcd = any(r.requests is not None for r in records)
    paths = sorted({p for r in records for p in r.by_path})
    ended = [r.ended for r in records]
    return SimRun(
        nodes,
        max(ended) - t0,
        (max(joined) - t0) if joined else float("nan"),
        min(ended) - t0,
        max(b.connect_s for b in batches),
        ops,
        by_op,
        busiest,
        [r.hb_ops for r in records],
        validate([r.result for r in records], nodes),
        sum(b.cpu_s for b in batches),
        server_cpu_s,
        [r.requests or 0 for r in records] if on_etcd else [],
        [n for r in records for n in r.cas],
        {p: statistics.fmean(r.by_path.get(p, 0) for r in records) for p in paths},
    )


def fmean0(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def validate(results: list[Any], nodes: int) -> list[str]:
    problems = [f"node {i}: {r}"[:160] for i, r in enumerate(results) if isinstance(r, str)]
    infos = [r for r in results if isinstance(r, tuple)]
    if problems or len(infos) != nodes:
        return problems or [f"{nodes - len(infos)} node(s) without a result"]
    lws = SIM_LOCAL_WORLD_SIZE
    if sorted(info[0] for info in infos) != list(range(nodes)):
        problems.append("group ranks are not a permutation of 0..N-1")
    if {info[1] for info in infos} != {nodes}:
        problems.append(f"group world sizes {sorted({i[1] for i in infos})}")
    if {info[2] for info in infos} != {nodes * lws}:
        problems.append(f"world sizes {sorted({i[2] for i in infos})} != {nodes * lws}")
    if any(info[3] != info[0] * lws for info in infos):
        problems.append("rank offsets are not group_rank * local_world_size")
    masters = {(info[4], info[5]) for info in infos}
    if len(masters) != 1:
        problems.append(f"{len(masters)} different masters")
    return problems


def sim_budget(store: str, nodes: int) -> float | None:
    """The budget for ``nodes`` at once on ``store``: that of the smallest budgeted N at or
    above it (a smaller job must meet it too); None beyond the largest."""
    fits = [(n, s) for n, s in SIM_BUDGETS[store].items() if n >= nodes]
    return min(fits)[1] if fits else None


def sim_scenario(
    bench: Bench,
    label: str,
    sizes: Sequence[int],
    reps: int,
    stagger: float,
    soft_limit: int,
    on_etcd: bool,
    procs: int = 1,
    *,
    server_clients: int,
) -> tuple[dict[int, list[SimRun]], str | None]:
    """``reps`` rounds of every N in ``sizes``: the runs by N, and why the scenario stopped
    early (None: it did not)."""
    runs: dict[int, list[SimRun]] = {}
    store = "etcd" if on_etcd else "c10d"
    for nodes in sizes:
        # 2 connections a node (the server is another process); on etcd also a watch stream
        if (3 if on_etcd else 2) * nodes + 256 > soft_limit:
            return runs, f"RLIMIT_NOFILE {soft_limit} is too low for {nodes} nodes"
        for rep in range(reps):
            log(f"  {store}, {label}: N={nodes} #{rep + 1}")
            try:
                sim = sim_run(
                    bench, on_etcd, nodes, rep, stagger, procs, server_clients=server_clients
                )
                runs.setdefault(nodes, []).append(sim)
            except Exception as exc:  # a failure of relaunch's store or rendezvous: report it
                log(f"  {store}, {label}, N={nodes}: {type(exc).__name__}: {exc}")
                return runs, f"{store}, {label}, N={nodes}: {type(exc).__name__}: {exc}"
            sim = runs[nodes][-1]
            log(
                f"    all back {sim.seconds:.2f} s, {statistics.fmean(sim.ops):.1f} ops/node"
                f", CPU {sim.cpu_s:.1f} s (server {sim.server_cpu_s:.1f} s)"
                + (
                    f", {statistics.fmean(sim.requests):.1f} requests/node, "
                    f"{statistics.fmean(sim.cas or [0]):.1f} CAS tries/join"
                    if sim.requests
                    else ""
                )
            )
    return runs, None


def ops_checks(label: str, runs: dict[int, list[SimRun]], small: int, big: int) -> list[Check]:
    checks = []
    for kind, pick in (("mean", statistics.fmean), ("max", max)):
        if runs.get(small) and runs.get(big):
            at_small = median([pick(s.ops) for s in runs[small]])
            at_big = median([pick(s.ops) for s in runs[big]])
            checks.append(
                Check(
                    f"store ops per node ({kind}), {label}, {big} vs {small}",
                    f"{at_big:.1f} vs {at_small:.1f}",
                    f"<= {SIM_OPS_RATIO:g}x + {SIM_OPS_SLACK}",
                    at_big <= SIM_OPS_RATIO * at_small + SIM_OPS_SLACK,
                )
            )
        else:
            checks.append(Check(f"store ops per node ({kind}), {label}", "-", "-", None))
    return checks


@dataclass
class SimResults:
    """One store's simulated rounds: at once and one by one, and why any was not measured."""

    store: str
    at_once: dict[int, list[SimRun]]
    staggered: dict[int, list[SimRun]]
    errors: list[str]
    reps: int


def print_sim_table(results: list[SimResults]) -> None:
    """The figures, as a Markdown table (one row per store, arrival and N; medians)."""
    print(
        "| N | backend | arrival | all back (s) | budget | ops/node mean (max) |"
        " requests/node mean (max) | server CPU (s) | client CPU (s) |"
    )
    print("|--:|---|---|--:|---|--:|--:|--:|--:|")
    for res in results:
        for label, runs in (("at once", res.at_once), ("one by one", res.staggered)):
            for nodes, sims in sorted(runs.items()):
                seconds = median([s.seconds for s in sims])
                budget = sim_budget(res.store, nodes) if label == "at once" else None
                verdict_text = (
                    f"<= {budget:g} s {verdict(seconds <= budget)}" if budget is not None else "-"
                )
                requests = (
                    f"{median([statistics.fmean(s.requests) for s in sims]):.1f}"
                    f" ({median([max(s.requests) for s in sims]):.0f})"
                    if res.store == "etcd"
                    else "-"
                )
                invalid = "" if not any(s.problems for s in sims) else " INVALID"
                print(
                    f"| {nodes:,} | {res.store} | {label} | {seconds:.2f}{invalid}"
                    f" | {verdict_text}"
                    f" | {median([statistics.fmean(s.ops) for s in sims]):.1f}"
                    f" ({median([max(s.ops) for s in sims]):.0f})"
                    f" | {requests}"
                    f" | {median([s.server_cpu_s for s in sims]):.2f}"
                    f" | {median([s.cpu_s for s in sims]):.2f} |"
                )


def bench_sim(
    bench: Bench,
    reps: int,
    etcd_reps: int,
    etcd_sizes: Sequence[int],
    procs: int = 1,
    c10d_sizes: Sequence[int] = SIM_NODES,
    stagger_sizes: Sequence[int] = STAGGER_NODES,
) -> list[Check]:
    """Measurement 3: N in ``c10d_sizes`` (``etcd_sizes`` on etcd) at once, and N in
    ``stagger_sizes`` one by one; its tables and checks (etcd's go to ``bench.etcd_checks``
    where there is no etcd to run on)."""
    soft, hard = raise_nofile()
    server_clients = 2 * max(c10d_sizes)
    stores = [b for b in BACKENDS if b in bench.backends]
    log(
        f"[3/4] N nodes as threads on one store server ({', '.join(stores)}): N in "
        f"{tuple(c10d_sizes)}, {reps} repetition(s) (etcd: {etcd_reps}, N in "
        f"{tuple(etcd_sizes)}); then {' and '.join(map(str, stagger_sizes))} nodes joining "
        f"{STAGGER_S * 1e3:g} ms apart (RLIMIT_NOFILE {soft}/{hard})"
    )
    results: list[SimResults] = []
    with simulation():
        for store in stores:
            if store == "etcd" and bench.etcd.unavailable is not None:
                results.append(SimResults(store, {}, {}, [f"etcd: {bench.etcd.unavailable}"], 0))
                continue
            on_etcd = store == "etcd"
            sizes, n = (etcd_sizes, etcd_reps) if on_etcd else (c10d_sizes, reps)
            at_once, error = sim_scenario(
                bench,
                "at once",
                sizes,
                n,
                0.0,
                soft,
                on_etcd,
                procs,
                server_clients=server_clients,
            )
            staggered, stagger_error = sim_scenario(
                bench,
                "one by one",
                stagger_sizes,
                1,
                STAGGER_S,
                soft,
                on_etcd,
                server_clients=server_clients,
            )
            errors = [e for e in (error, stagger_error) if e]
            results.append(SimResults(store, at_once, staggered, errors, n))

    print(
        f"\n3. N nodes as threads of {procs} forked processes (one by one: of one), one store"
        " server (c10d: a TcpStoreServer in a"
        "\n   process of its own; etcd: the etcd member), 2 connections per node, min = max = N,"
        f" local_world_size {SIM_LOCAL_WORLD_SIZE};\n   all back: seconds from the release"
        f" until every next_rendezvous() returned (median of {reps} at once, etcd"
        f" {etcd_reps};\n   1 one by one, {STAGGER_S * 1e3:g} ms apart); ops: store operations"
        " per node in next_rendezvous(); requests:\n   HTTP requests per node (etcd, a watch"
        " stream counting one); CPU: the store server's (etcd member's)\n   and this process's"
        f" (every node), release -> all back.\n   {SIM_SWITCH_NOTE}\n"
    )
    print_sim_table(results)
    print(
        "\n   more: connect = opening the connections (untimed); all joined = the last join"
        " returned;\n   busiest = that node's group rank; hb = heartbeat store operations per"
        " node (its first beat);\n   CAS/join: etcd transactions per join"
    )
    print(
        f"{'store':<5} {'arrival':<11} {'N':>5} {'connect':>8} {'all joined':>11}"
        f" {'first back':>11} {'all back':>9} {'busiest':>8} {'hb mean':>8} {'CAS/join':>9}"
        f" {'CAS max':>8} {'req/s':>7}  valid"
    )
    for res in results:
        for label, runs in (
            ("at once", res.at_once),
            (f"{STAGGER_S * 1e3:g} ms apart", res.staggered),
        ):
            for nodes, sims in sorted(runs.items()):
                etcd = res.store == "etcd"
                req = [s.requests if etcd else s.ops for s in sims]
                rate = median([sum(r) / s.seconds for r, s in zip(req, sims, strict=True)])
                cas_mean = median([fmean0(s.cas) for s in sims])
                cas_max = median([max(s.cas or [0]) for s in sims])
                print(
                    f"{res.store:<5} {label:<11} {nodes:>5}"
                    f" {median([s.connect_s for s in sims]):>8.2f}"
                    f" {median([s.joined_s for s in sims]):>11.3f}"
                    f" {median([s.first_s for s in sims]):>11.3f}"
                    f" {median([s.seconds for s in sims]):>9.3f}"
                    f" {sims[-1].busiest[0]:>8}"
                    f" {median([statistics.fmean(s.hb_ops) for s in sims]):>8.1f}"
                    f" {fmt(cas_mean if etcd else None):>9}"
                    f" {fmt(cas_max if etcd else None, '.0f'):>8}"
                    f" {rate:>7.0f}"
                    f"  {'yes' if not any(s.problems for s in sims) else 'NO'}"
                )
    for res in results:
        for label, runs in (("at once", res.at_once), ("one by one", res.staggered)):
            for nodes, sims in sorted(runs.items()):
                last = sims[-1]
                parts = ", ".join(f"{op} {n:.2f}" for op, n in last.by_op.items() if n)
                rank, counts = last.busiest
                mine = ", ".join(f"{op} {n}" for op, n in counts.items())
                print(
                    f"  {res.store}, {label}, N={nodes}: mean per node {parts}; busiest (group"
                    f" rank {rank}) {mine}"
                )
                if last.by_path:
                    paths = ", ".join(
                        f"{path.removeprefix('/v3/')} {n:.2f}" for path, n in last.by_path.items()
                    )
                    print(f"  {res.store}, {label}, N={nodes}: HTTP requests per node: {paths}")
                for problem in sorted({p for s in sims for p in s.problems})[:10]:
                    print(f"  {res.store}, {label}, N={nodes}: INVALID: {problem}")
        for problem in res.errors:
            print(f"  not measured: {problem}")

    # Budgets: in the exit status on both stores; etcd's only noted when there is no etcd to
    # run on (like torchrun without torch).
    checks: list[Check] = []
    for res in results:
        where = f" ({res.store})"
        absent = res.store == "etcd" and bench.etcd.unavailable is not None
        into = bench.etcd_checks if absent else checks
        sizes = sorted(res.at_once) or sorted(etcd_sizes if res.store == "etcd" else c10d_sizes)
        for nodes in sizes:
            budget = sim_budget(res.store, nodes)
            if budget is None:
                continue
            timed = res.at_once.get(nodes)
            seconds = median([s.seconds for s in timed]) if timed else None
            into.append(
                Check(
                    f"{nodes} nodes at once -> all next_rendezvous() back{where}",
                    f"{fmt(seconds, '.2f')} s",
                    f"<= {budget:g} s",
                    None if seconds is None else seconds <= budget,
                )
            )
        measured = [
            s for runs in (res.at_once, res.staggered) for sims in runs.values() for s in sims
        ]
        into.append(
            Check(
                f"simulated rounds valid{where}",
                f"{sum(not s.problems for s in measured)} of {len(measured)}",
                "all",
                None if not measured or res.errors else not any(s.problems for s in measured),
            )
        )
        if len(sizes) > 1:
            into += ops_checks(f"at once{where}", res.at_once, sizes[0], sizes[-1])
        into += ops_checks(
            f"one by one{where}", res.staggered, min(stagger_sizes), max(stagger_sizes)
        )
    return checks
