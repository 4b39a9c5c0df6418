"""Simulated nodes: many ``DynamicRendezvousHandler`` s as threads of one process, on real
stores (a ``TcpStoreServer``, or etcd), each doing what the agent does on a membership change:
calling ``next_rendezvous()`` again. A node can be crashed: from then on its stores fail every
call before it reaches the server, as if its process had died (no clean-up is written, no etcd
lease revoked; its heartbeat stops at its next beat). Used by benchmarks/rendezvous.py (the
re-form measurement) and tests/integration/test_reform_scale.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from relaunch.core.rendezvous.membership import MembershipChange
from relaunch.core.rendezvous.rounds import Settings
from relaunch.rendezvous.api import RendezvousInfo
from relaunch.rendezvous.dynamic import DynamicRendezvousHandler
from relaunch.store.api import Store, StoreConnectionError

if TYPE_CHECKING:
    from relaunch.store.etcd import EtcdStore

#: How long a node thread sleeps between looks at the stop flag while nothing happens.
POLL_S = 0.25


class CrashableStore:
    """A store that passes every call through until ``crash()``; from then on every call fails
    with ``StoreConnectionError`` before anything is sent. ``close`` always passes."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.crashed = False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name == "close" or not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.crashed:
                raise StoreConnectionError("simulated crash of this node")
            return attr(*args, **kwargs)

        return call

    def crash(self) -> None:
        self.crashed = True


@dataclass
class Back:
    """One ``next_rendezvous()`` that returned: when (``perf_counter``) and what."""

    at: float
    info: RendezvousInfo


@dataclass(eq=False)
class SimNode:
    """One simulated node: its handler, its three stores, and what happened to it."""

    index: int
    handler: DynamicRendezvousHandler
    stores: tuple[CrashableStore, ...]
    backs: list[Back] = field(default_factory=list)
    notified: list[float] = field(default_factory=list)  # perf_counter of each change heard
    called: list[float] = field(default_factory=list)  # perf_counter of each call
    error: BaseException | None = None
    killed: bool = False
    thread: threading.Thread | None = None
    wake: threading.Event = field(default_factory=threading.Event)


class SimJob:
    """One job of simulated nodes on stores from ``make_store`` (three per node: rendezvous,
    heartbeat and watch, like ``rendezvous/backends.py`` builds them; ``leases``: etcd)."""

    def __init__(
        self,
        run_id: str,
        settings: Settings,
        make_store: Callable[[], Any],
        leases: bool,
        local_world_size: int = 1,
    ) -> None:
        self.run_id = run_id
        self.settings = settings
        self.make_store = make_store
        self.leases = leases
        self.local_world_size = local_world_size
        self.nodes: list[SimNode] = []
        self.changed = threading.Condition()  # notified whenever any node records something
        self.stopping = threading.Event()
        self.total_backs = 0  # next_rendezvous() calls that returned, all nodes together
        self.failed = 0  # nodes whose next_rendezvous() raised
        self._observers: list[threading.Thread] = []
        self._observer_stores: list[Any] = []

    # -- building and running ----------------------------------------------------------------

    def add(self, count: int) -> list[SimNode]:
        """Build ``count`` more nodes (their stores connect now); not started."""
        added = []
        for _ in range(count):
            stores = tuple(CrashableStore(self.make_store()) for _ in range(3))
            if self.leases:  # each passes every call through to an EtcdStore
                from relaunch.rendezvous.kinds_etcd import handler_on_etcd

                etcd, etcd_heartbeat, etcd_watch = (cast("EtcdStore", s) for s in stores)
                handler = handler_on_etcd(
                    self.run_id,
                    etcd,
                    self.settings,
                    "127.0.0.1",
                    etcd_heartbeat,
                    watch_store=etcd_watch,
                    backend="etcd",
                    on_shutdown=(etcd_watch.close,),
                )
            else:
                store, heartbeat, watch = (cast(Store, s) for s in stores)
                handler = DynamicRendezvousHandler.on_counters(
                    self.run_id,
                    store,
                    self.settings,
                    "127.0.0.1",
                    heartbeat,
                    watch_store=watch,
                    on_shutdown=(watch.close,),
                )
            handler.job.set_workers("default", self.local_world_size)
            node = SimNode(len(self.nodes), handler, stores)
            handler.job.set_change_listener(self._listener_for(node))
            self.nodes.append(node)
            added.append(node)
        return added

    def start(self, nodes: list[SimNode], barrier: bool = True) -> None:
        """Start a thread per node; with ``barrier`` they all call ``next_rendezvous()`` at
        once (released together once every thread runs)."""
        gate = threading.Barrier(len(nodes)) if barrier and len(nodes) > 1 else None
        for node in nodes:
            node.thread = threading.Thread(
                target=self._run, args=(node, gate), name=f"sim-node-{node.index}", daemon=True
            )
            node.thread.start()

    def _run(self, node: SimNode, gate: threading.Barrier | None) -> None:
        """Join; on each membership change, join again (what the agent does)."""
        if gate is not None:
            try:
                gate.wait()
            except threading.BrokenBarrierError:
                return
        handler = node.handler
        while not self.stopping.is_set():
            node.wake.clear()
            node.called.append(time.perf_counter())
            try:
                info = handler.next_rendezvous()
            except Exception as exc:  # the caller reports it
                if not node.killed and not self.stopping.is_set():
                    with self.changed:
                        node.error = exc
                        self.failed += 1
                        self.changed.notify_all()
                return
            back = Back(time.perf_counter(), info)
            with self.changed:
                node.backs.append(back)
                self.total_backs += 1
                self.changed.notify_all()
            while not node.wake.wait(POLL_S):
                if self.stopping.is_set():
                    return
            if node.killed or self.stopping.is_set():
                return

    def _listener_for(self, node: SimNode) -> Callable[[MembershipChange], None]:
        return lambda _change: self._heard(node)

    def _heard(self, node: SimNode) -> None:
        """The change listener: note when, and wake the node's thread."""
        now = time.perf_counter()
        if not node.killed:
            node.notified.append(now)
        node.wake.set()

    def wait_for(self, predicate: Callable[[], bool], timeout: float, backs: int = 0) -> bool:
        """Wait until ``predicate()`` holds or any node failed; whether it holds. It is looked
        at whenever a node records something (once the nodes have returned ``backs`` times in
        all: an O(1) test, so that a thousand nodes coming back cost O(N) looks, not O(N^2)),
        and at least every ``POLL_S``."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not (self.total_backs >= backs and predicate()):
                left = deadline - time.monotonic()
                if left <= 0 or self.failed:
                    return predicate()
                self.changed.wait(min(left, POLL_S))
        return True

    def back_at_least(self, nodes: list[SimNode], times: int) -> Callable[[], bool]:
        """A predicate: every one of ``nodes`` returned from ``next_rendezvous()`` ``times``
        times."""
        return lambda: all(len(node.backs) >= times for node in nodes)

    def errors(self) -> list[str]:
        return [f"node {n.index}: {n.error!r}"[:200] for n in self.nodes if n.error is not None]

    def kill(self, node: SimNode) -> float:
        """Crash ``node``: its stores fail every call from now on (nothing more reaches the
        server: its heartbeat stops, no lease is revoked, no ``changed`` written), then their
        connections close. Returns ``perf_counter()`` at the crash."""
        node.killed = True
        for store in node.stores:
            store.crash()
        crashed_at = time.perf_counter()
        node.wake.set()
        for store in node.stores:
            try:
                store.close()
            except Exception:  # a connection closing under a crash: nothing to do
                pass
        return crashed_at

    # -- watching the store from outside -----------------------------------------------------

    def key(self, name: str) -> str:
        return f"relaunch/{self.run_id}/{name}"

    def current_round(self) -> int:
        """The round the job's nodes join now (its ``round`` record; 0 before any)."""
        store = self.make_store()
        try:
            value = store.get(self.key("round")).value
        finally:
            store.close()
        return int(value) if value else 0

    def observe_changed(self, round_: int, timeout: float) -> tuple[list[float], threading.Thread]:
        """Watch round ``round_``'s ``changed`` record from a store of our own: the returned
        list gets the ``perf_counter()`` at which it was seen written, and the returned thread
        ends then (or after ``timeout``)."""
        seen: list[float] = []
        store = self.make_store()
        self._observer_stores.append(store)
        key = self.key(f"news/r{round_}/changed")

        def observe() -> None:
            deadline = time.monotonic() + timeout
            try:
                while not self.stopping.is_set() and time.monotonic() < deadline:
                    if store.watch(key, 0, min(POLL_S * 4, timeout)).value is not None:
                        seen.append(time.perf_counter())
                        return
            except Exception:  # the store went away at the end: nothing was seen
                pass

        thread = threading.Thread(target=observe, name="sim-observer", daemon=True)
        thread.start()
        self._observers.append(thread)
        return seen, thread

    # -- the end ---------------------------------------------------------------------------

    def stop(self, timeout: float = 30.0) -> None:
        """Stop every node thread (no node joins again after this): before any handler shuts
        down, since shutting down writes ``changed``, which would call the others back."""
        self.stopping.set()
        for node in self.nodes:
            node.wake.set()
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            if node.thread is not None:
                node.thread.join(max(0.0, deadline - time.monotonic()))

    def close(self, timeout: float = 30.0) -> list[str]:
        """Stop every node thread, shut every handler down, close the observers; what is
        still running after ``timeout`` (thread names), which should be nothing."""
        deadline = time.monotonic() + timeout
        self.stop(timeout)
        for node in self.nodes:
            node.handler.shutdown()
        for thread in self._observers:
            thread.join(max(0.0, deadline - time.monotonic()))
        for store in self._observer_stores:
            store.close()
        left = [n.thread for n in self.nodes if n.thread is not None] + self._observers
        return [t.name for t in left if t.is_alive()]


def relaunch_threads() -> list[str]:
    """Names of the live threads that relaunch's rendezvous or these simulations started."""
    return [
        t.name
        for t in threading.enumerate()
        if t.name.startswith(("relaunch-heartbeat", "relaunch-rdzv-watch", "sim-"))
    ]


def wait_threads_gone(timeout: float) -> list[str]:
    """Wait until ``relaunch_threads()`` is empty; what is left after ``timeout``."""
    deadline = time.monotonic() + timeout
    while (left := relaunch_threads()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


# -- the scenarios: a round of N, then one node lost or one more joining ------------------------


@dataclass
class Reform:
    """One re-forming, in seconds since ``t0`` (the crash, or the new node's call): when the
    round's ``changed`` record was seen written, the first and last member notified, and the
    last ``next_rendezvous()`` back; None where it did not happen. ``problems``: what was wrong
    with the new world (or why it did not form)."""

    event: str  # "lost" or "joined"
    members: int  # nodes in the re-formed round
    t0: float
    changed: float | None
    first_notified: float | None
    last_notified: float | None
    all_back: float | None
    problems: list[str]


def check_world(infos: list[RendezvousInfo], nodes: int, local_world_size: int) -> list[str]:
    """What is wrong with ``infos`` as one world of ``nodes`` nodes (nothing: [])."""
    problems = []
    if len(infos) != nodes:
        problems.append(f"{len(infos)} results for {nodes} nodes")
    if sorted(info.group_rank for info in infos) != list(range(len(infos))):
        problems.append("group ranks are not a permutation of 0..N-1")
    if {info.group_world_size for info in infos} != {nodes}:
        problems.append(f"group world sizes {sorted({i.group_world_size for i in infos})}")
    if {info.global_world_size for info in infos} != {nodes * local_world_size}:
        problems.append(f"world sizes {sorted({i.global_world_size or 0 for i in infos})}")
    if any(info.rank_offset != info.group_rank * local_world_size for info in infos):
        problems.append("rank offsets are not group_rank * local_world_size")
    if len({(info.master_addr, info.master_port) for info in infos}) > 1:
        problems.append("more than one master")
    return problems


def form(job: SimJob, count: int, timeout: float) -> tuple[list[SimNode], list[str]]:
    """Start ``count`` nodes at once; the nodes, and what is wrong with their first world."""
    nodes = job.add(count)
    job.start(nodes)
    if not job.wait_for(job.back_at_least(nodes, 1), timeout, job.total_backs + count):
        back = sum(1 for node in nodes if node.backs)
        return nodes, job.errors() or [f"{back} of {count} nodes back within {timeout:g}s"]
    return nodes, check_world([n.backs[0].info for n in nodes], count, job.local_world_size)


def wait_beating(job: SimJob, node: NodeLike, timeout: float) -> bool:
    """Wait until ``node``'s heartbeat is in the store (on the built-in store: beaten twice, so
    its neighbour has seen it move); whether it is."""
    key = job.key(f"r{job.current_round()}/hb/{node.backs[-1].info.group_rank + 1}")
    store = job.make_store()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            value = store.get(key).value
            if value is not None and (job.leases or int(value) >= 2):
                return True
            time.sleep(0.05)
        return False
    finally:
        store.close()


class NodeLike(Protocol):
    """What ``summarize`` reads of a node: a SimNode, or a copy from another process."""

    index: int
    backs: list[Back]
    notified: list[float]


def summarize(
    event: str,
    t0: float,
    members: Sequence[NodeLike],
    wanted: dict[int, int],
    seen: list[float],
    problems: list[str],
    local_world_size: int,
) -> Reform:
    """The re-forming of ``members`` after an event at ``t0``: done when each has returned
    ``wanted[index]`` times from ``next_rendezvous()``. Members already back before ``t0`` are
    to be notified; the others (a node joining) are not."""
    done = all(len(n.backs) >= wanted[n.index] for n in members)
    told = [n for n in members if wanted[n.index] > 1]
    firsts = [min((t for t in n.notified if t >= t0), default=None) for n in told]
    known = [t for t in firsts if t is not None]
    problems = list(problems)
    if not done:
        back = sum(1 for n in members if len(n.backs) >= wanted[n.index])
        problems.append(f"{back} of {len(members)} back")
    else:
        infos = [n.backs[wanted[n.index] - 1].info for n in members]
        problems += check_world(infos, len(members), local_world_size)
    return Reform(
        event,
        len(members),
        t0,
        seen[0] - t0 if seen else None,
        min(known) - t0 if known else None,
        max(known) - t0 if known and len(known) == len(told) else None,
        max(n.backs[wanted[n.index] - 1].at for n in members) - t0 if done else None,
        problems,
    )


def _reform(
    job: SimJob,
    event: str,
    t0: float,
    members: list[SimNode],
    wanted: dict[int, int],
    target: int,
    observed: tuple[list[float], threading.Thread],
    timeout: float,
) -> Reform:
    """Wait until every one of ``members`` has returned ``wanted[index]`` times from
    ``next_rendezvous()`` (``target``: the job's ``total_backs`` by then, at least), and for
    the observer of the ``changed`` record, which was written by then (its own watch may
    report it later, on a loaded machine); then ``summarize``."""
    job.wait_for(lambda: all(len(n.backs) >= wanted[n.index] for n in members), timeout, target)
    seen, observer = observed
    observer.join(timeout)
    return summarize(event, t0, members, wanted, seen, job.errors(), job.local_world_size)


def lose_one(job: SimJob, members: list[SimNode], victim: SimNode, timeout: float) -> Reform:
    """Crash ``victim``, a member of the running round; the survivors re-form without it."""
    survivors = [n for n in members if n is not victim]
    wanted = {n.index: len(n.backs) + 1 for n in survivors}
    target = job.total_backs + len(survivors)
    observed = job.observe_changed(job.current_round(), timeout)
    t0 = job.kill(victim)
    return _reform(job, "lost", t0, survivors, wanted, target, observed, timeout)


def join_one(job: SimJob, members: list[SimNode], timeout: float) -> Reform:
    """A new node joins the running round of ``members`` (room left): all re-form with it."""
    wanted = {n.index: len(n.backs) + 1 for n in members}
    target = job.total_backs + len(members) + 1
    observed = job.observe_changed(job.current_round(), timeout)
    (late,) = job.add(1)
    wanted[late.index] = 1
    job.start([late], barrier=False)
    job.wait_for(lambda: bool(late.called), timeout)
    members = [*members, late]
    return _reform(job, "joined", late.called[0], members, wanted, target, observed, timeout)
