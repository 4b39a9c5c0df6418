"""The dynamic rendezvous over a ``Store``: the I/O loop that carries out ``core.rendezvous``.

Keys, under ``relaunch/{run_id}/``::

    round                   the round nodes join now
    closed                  set once the job finished: late nodes exit cleanly
    r{n}/joins              join counter (ticket and workers so far, see core.rendezvous)
    r{n}/node/{ticket}      workers up to and including that node
    r{n}/final              the completed round: members, world size, master address
    r{n}/changed            set when the round must be re-formed, with the reason
    r{n}/hb/{ticket}        heartbeat of a member: a counter it bumps, or on etcd a key bound
                            to its lease, which etcd deletes when the member stops renewing it
    r{n}/done               members whose workers finished (the exit barrier)
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from relaunch.core import rendezvous as plan
from relaunch.endpoints import find_free_port, is_loopback, parse_endpoint
from relaunch.rendezvous.api import (
    TOKEN_ENV,
    RendezvousClosedError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
)
from relaunch.runtime import start_without_signals
from relaunch.store.api import Store, StoreConnectionError, StoreError, StoreTimeout

if TYPE_CHECKING:
    from relaunch.store.etcd import EtcdStore

log = logging.getLogger(__name__)

DEFAULT_PORT = 29400
CLOSED = b"closed"


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


class DynamicRendezvousHandler(RendezvousHandler):
    """Elastic membership on a shared store: join, complete, heartbeat, re-form, close."""

    def __init__(
        self,
        run_id: str,
        store: Store,
        settings: plan.Settings,
        local_world_size: int,
        local_addr: str,
        heartbeat_store: Store,
        backend: str = "c10d",
        on_shutdown: tuple[Any, ...] = (),
        watch_store: Store | None = None,
        leases: bool = False,
    ) -> None:
        self._run_id = run_id
        self._store = store
        self._hb_store = heartbeat_store
        self._watch_store = watch_store
        self._leases = leases
        self.settings = settings
        self._local_world_size = local_world_size
        self._local_addr = local_addr
        self._backend = backend
        self._prefix = f"relaunch/{run_id}"
        self._on_shutdown = on_shutdown
        self._round: int | None = None
        self._ticket = 0
        self._final: plan.Final | None = None
        self._change: str | None = None
        self._change_lock = threading.Lock()
        self._changed = threading.Event()
        self._change_listener: Callable[[], None] | None = None
        self._stop_heartbeat = threading.Event()
        self._heartbeat: threading.Thread | None = None
        # Set once the job is over for this node (closed, or its store gone with the node that
        # hosted it): from then on nothing more is written, and nothing waits to reconnect.
        self._finished = False
        # Set once the store could not be reached within the deadlines: shutting down then
        # writes nothing (it would only wait for the store again).
        self._store_lost = False
        self._restart_reason = ""

    # -- keys ---------------------------------------------------------------------------------

    def _key(self, name: str, round_: int | None = None) -> str:
        if round_ is None:
            return f"{self._prefix}/{name}"
        return f"{self._prefix}/r{round_}/{name}"

    def _get_int(self, key: str) -> int:
        value = self._store.get(key).value
        return int(value) if value else 0

    def _final_of(self, round_: int) -> plan.Final | None:
        value = self._store.get(self._key("final", round_)).value
        if value is None:
            return None
        if value == CLOSED:
            raise RendezvousClosedError(f"the job {self._run_id!r} has already finished")
        data = json.loads(value)
        return plan.Final(
            data["count"], data["world_size"], data["master_addr"], data["master_port"]
        )

    # -- RendezvousHandler ----------------------------------------------------------------------

    def get_backend(self) -> str:
        return self._backend

    def get_run_id(self) -> str:
        return self._run_id

    @property
    def watches_membership(self) -> bool:
        return True

    def is_closed(self) -> bool:
        return self._store.get(self._key("closed")).value is not None

    def next_rendezvous(self) -> RendezvousInfo:
        try:
            return self._next_rendezvous()
        except StoreError as exc:
            self._store_lost = True
            raise RendezvousError(f"rendezvous of job {self._run_id!r}: {exc}") from None

    def _next_rendezvous(self) -> RendezvousInfo:
        try:
            self._leave_round()
        except StoreError as exc:
            # A connection that stalled while this node was cut off fails once, then the next
            # call reconnects (retrying for join_timeout): marking the old round is best effort.
            log.warning(
                "could not mark round %s for re-forming (%s); joining again", self._round, exc
            )
        started_at = time.monotonic()
        round_ = self._round_to_join()
        while True:
            total = self._store.add(
                self._key("joins", round_), plan.join_increment(self._local_world_size)
            )
            ticket, through = plan.unpack_join(total)
            self._store.set(self._key(f"node/{ticket}", round_), str(through).encode())
            final = self._await_round(round_, ticket, started_at)
            if final is not None:
                break
            self._announce_late(round_)
            round_ = self._advance_round(round_)
        self._round, self._ticket, self._final = round_, ticket, final
        with self._change_lock:
            self._change = None
            self._changed.clear()
        group_rank, offset = plan.assign(ticket, through, self._local_world_size)
        self._start_heartbeat()
        log.info(
            "rendezvous round %d complete: group rank %d of %d", round_, group_rank, final.count
        )
        return RendezvousInfo(
            group_rank=group_rank,
            group_world_size=final.count,
            master_addr=final.master_addr,
            master_port=final.master_port,
            rank_offset=offset,
            world_size=final.world_size,
            store=self._store,
        )

    def num_nodes_waiting(self) -> int:
        if self._round is None:
            return 0
        total = self._get_int(self._key("joins", self._round + 1))
        return plan.unpack_join(total)[0]

    def note_restart(self, reason: str) -> None:
        self._restart_reason = reason

    def wait_membership_change(self, timeout: float) -> str | None:
        self._changed.wait(timeout)
        return self.membership_change()

    @property
    def lost_node_grace(self) -> float:
        # The neighbour's silence counts from its last beat seen, checked once a beat; an etcd
        # lease lasts whole seconds, and etcd looks for expired leases every half second or so.
        settings = self.settings
        if self._leases:
            return math.ceil(settings.dead_after) + 1.0 + settings.keep_alive_interval
        return settings.dead_after + settings.keep_alive_interval

    def membership_change(self) -> str | None:
        with self._change_lock:
            return self._change

    def exit_barrier(self, timeout: float) -> None:
        if self._round is None or self._final is None:
            return
        done_key = self._key("done", self._round)
        changed_key = self._key("changed", self._round)
        deadline = time.monotonic() + timeout
        try:
            self._store.add(done_key, 1)
            while True:
                current = self._store.get(done_key)
                if int(current.value or b"0") >= self._final.count:
                    return
                if self._store.get(changed_key).value is not None:
                    return  # a member was lost: the live ones are done
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("exit barrier: not every node finished within %gs", timeout)
                    return
                self._store.watch(
                    done_key, current.version, min(left, self.settings.keep_alive_interval)
                )
        except StoreConnectionError:
            self._finished = True  # the hosting node finished and left: everyone is done

    def set_closed(self) -> None:
        if self._finished:
            return
        self._finished = True
        round_ = self._round or 0
        try:
            self._store.set(self._key("closed"), b"1")
            if self._round is not None and self._final is not None:
                self._supersede(self._round, "the job finished", self._final.count)
            # Wake and dismiss anyone waiting to join the next round.
            self._store.compare_set(self._key("final", round_ + 1), 0, CLOSED)
            self._store.add(self._key("joins", round_ + 1), 0)
        except StoreError as exc:
            log.debug("could not mark the rendezvous closed: %s", exc)

    def shutdown(self) -> bool:
        self._stop_heartbeat.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        if (
            self._round is not None
            and self._final is not None
            and not self._finished
            and not self._store_lost
        ):
            try:
                # Leaving before the job finished: the others re-form without this node. This
                # also wakes this node's own watcher, so its connection can close.
                self._supersede(
                    self._round,
                    f"node of group rank {self._ticket - 1} left the job",
                    self._final.count - 1,
                )
            except StoreError:
                pass
        for close in (self._hb_store.close, self._store.close, *self._on_shutdown):
            try:
                close()
            except Exception:  # shutting down: note it and go on
                log.debug("error while shutting down the rendezvous", exc_info=True)
        return True

    # -- joining --------------------------------------------------------------------------------

    def _round_to_join(self) -> int:
        """The first round that has not completed (or that this node was told to move to)."""
        if self.is_closed():
            raise RendezvousClosedError(f"the job {self._run_id!r} has already finished")
        round_ = self._get_int(self._key("round"))
        while self._final_of(round_) is not None:
            self._announce_late(round_)  # a no-op for rounds already re-formed
            round_ = self._advance_round(round_)
        return round_

    def _advance_round(self, round_: int) -> int:
        """Record that round ``round_ + 1`` is the one to join now; return it."""
        key = self._key("round")
        while True:
            current = self._store.get(key)
            if int(current.value or b"0") > round_:
                return round_ + 1
            if self._store.compare_set(key, current.version, str(round_ + 1).encode()).succeeded:
                return round_ + 1

    def _previous(self, round_: int) -> tuple[bool, int | None]:
        """Whether round ``round_ - 1`` still forms or runs, and how many nodes its re-forming
        expects. Until its members mark it re-formed, this round must not complete: a node
        that came too late for it would otherwise start a second world beside it."""
        if round_ == 0:
            return False, None
        changed = self._store.get(self._key("changed", round_ - 1)).value
        if changed is None:
            return True, None
        return False, json.loads(changed).get("expected")

    def _await_round(self, round_: int, ticket: int, started_at: float) -> plan.Final | None:
        """Wait for round ``round_`` to complete; its final record, or None if this node is late."""
        joins_key, final_key = self._key("joins", round_), self._key("final", round_)
        min_reached_at: float | None = None
        while True:
            final = self._final_of(round_)
            joined = plan.unpack_join(self._get_int(joins_key))[0]
            now = time.monotonic()
            if min_reached_at is None and joined >= self.settings.min_nodes:
                min_reached_at = now
            previous_running, expected = (False, None)
            if ticket == 1 and final is None:
                previous_running, expected = self._previous(round_)
            decision = plan.decide_join(
                self.settings,
                ticket,
                joined,
                final,
                started_at,
                min_reached_at,
                now,
                previous_running,
                expected,
            )
            if decision.step is plan.Step.MEMBER:
                return final
            if decision.step is plan.Step.LATE:
                return None
            if decision.step is plan.Step.FAIL:
                raise RendezvousError(
                    f"rendezvous of job {self._run_id!r} failed: {decision.reason}"
                )
            if decision.step is plan.Step.COMPLETE:
                self._complete(round_, decision.count)
                continue
            assert decision.deadline is not None
            # One wait per threshold, not one wake-up per join: O(1) operations for ticket 1 too.
            if ticket != 1:
                awaited = final_key
            elif previous_running:
                awaited = self._key("changed", round_ - 1)
            else:
                threshold = (
                    self.settings.min_nodes
                    if min_reached_at is None
                    else plan.completion_target(self.settings, expected)
                )
                awaited = self._key(f"node/{threshold}", round_)
            timeout = max(0.0, decision.deadline - time.monotonic())
            if ticket == 1:
                # Look at the join counter again now and then: a node that took a ticket but
                # died before registering never writes the key awaited here.
                timeout = min(timeout, self.settings.keep_alive_interval)
            try:
                self._store.wait([awaited], timeout)
            except StoreTimeout:
                pass  # a deadline passed: decide again

    def _complete(self, round_: int, count: int) -> None:
        """As the holder of ticket 1: write the final record of ``round_`` with ``count`` nodes.

        The last member's record gives the world size. A node that took a ticket but died
        before writing its record is left out (it is the last one here); one in the middle is
        caught by the heartbeats once the workers start.
        """
        for members in range(count, self.settings.min_nodes - 1, -1):
            last = self._key(f"node/{members}", round_)
            try:
                self._store.wait([last], self.settings.keep_alive_interval)
                break
            except StoreTimeout:
                log.warning(
                    "rendezvous: the node holding ticket %d joined but never "
                    "registered; completing the round without it",
                    members,
                )
        else:
            raise RendezvousError(
                f"rendezvous of job {self._run_id!r} failed: fewer than "
                f"{self.settings.min_nodes} joined nodes registered"
            )
        world_size = int(self._store.get(last).value or b"0")
        record = {
            "count": members,
            "world_size": world_size,
            "master_addr": self._local_addr,
            "master_port": find_free_port(self._local_addr),
        }
        self._store.compare_set(self._key("final", round_), 0, json.dumps(record).encode())

    def _supersede(self, round_: int, reason: str, expected: int) -> None:
        """Mark ``round_`` for re-forming (the first reason wins); its members see it at once."""
        record = {"reason": reason, "expected": expected}
        self._store.compare_set(self._key("changed", round_), 0, json.dumps(record).encode())

    def _announce_late(self, round_: int) -> None:
        """Having come too late for ``round_``: ask its members to make room, if there is any
        and none of them has finished yet (a finishing job is closed, not grown)."""
        final = self._final_of(round_)
        if final is None or final.count >= self.settings.max_nodes:
            return
        if self._get_int(self._key("done", round_)) == 0:
            self._supersede(round_, "1 node(s) waiting to join", final.count + 1)

    def _leave_round(self) -> None:
        """Before joining again: mark the current round as re-formed, so others follow."""
        self._stop_heartbeat.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        if self._round is None or self._final is None:
            return
        waiting = self.num_nodes_waiting()
        with self._change_lock:
            reason = self._change or self._restart_reason or "the worker group is restarting"
            self._restart_reason = ""
            lost = 1 if self._change and "lost" in self._change else 0
        self._supersede(self._round, reason, self._final.count - lost + waiting)

    # -- heartbeats -----------------------------------------------------------------------------

    def _start_heartbeat(self) -> None:
        self._stop_heartbeat = threading.Event()
        assert self._round is not None and self._final is not None
        self._heartbeat = threading.Thread(
            target=self._beat,
            args=(self._round, self._ticket, self._final.count, self._stop_heartbeat),
            name="relaunch-heartbeat",
            daemon=True,
        )
        start_without_signals(self._heartbeat)
        if self._watch_store is not None:
            start_without_signals(
                threading.Thread(
                    target=self._watch_changes,
                    args=(self._round, self._stop_heartbeat),
                    name="relaunch-rdzv-watch",
                    daemon=True,
                )
            )

    def _watch_changes(self, round_: int, stop: threading.Event) -> None:
        """Block on this round's ``changed`` key: a re-form anywhere reaches us at once."""
        assert self._watch_store is not None
        key = self._key("changed", round_)
        try:
            while not stop.is_set():
                changed = self._watch_store.watch(key, 0, self.settings.keep_alive_interval)
                if changed.value is not None:
                    if not stop.is_set():
                        self._flag(json.loads(changed.value)["reason"])
                    return
        except StoreError as exc:
            if not stop.is_set():
                self._flag(f"lost the rendezvous store: {exc}")

    def set_change_listener(self, listener: Callable[[], None] | None) -> None:
        self._change_listener = listener

    def _flag(self, reason: str) -> None:
        with self._change_lock:
            if self._change is None:
                self._change = reason
            self._changed.set()
        listener = self._change_listener
        if listener is not None:
            listener()

    def _beat(self, round_: int, ticket: int, count: int, stop: threading.Event) -> None:
        """Heartbeat, watch one neighbour, and notice re-forming or waiting nodes: O(1) a beat."""
        store, settings = self._hb_store, self.settings
        pulse: _CounterPulse | _LeasePulse
        if self._leases:
            pulse = _LeasePulse(cast("EtcdStore", store), settings)
        else:
            pulse = _CounterPulse(store, settings)
        neighbour = plan.ring_neighbour(ticket, count)
        try:
            while True:
                pulse.beat(self._key(f"hb/{ticket}", round_))
                if self._watch_store is None:  # nobody blocks on ``changed``: look each beat
                    changed = store.get(self._key("changed", round_)).value
                    if changed is not None:
                        self._flag(json.loads(changed)["reason"])
                if neighbour is not None:
                    lost = pulse.lost(self._key(f"hb/{neighbour}", round_), time.monotonic())
                    if lost:
                        self._flag(f"node of group rank {neighbour - 1} lost ({lost})")
                if stop.wait(settings.keep_alive_interval):
                    pulse.end()
                    return
        except StoreError as exc:
            if not stop.is_set():
                self._flag(f"lost the rendezvous store: {exc}")


class _CounterPulse:
    """Heartbeats as a counter each member bumps; a neighbour whose counter stands still died."""

    def __init__(self, store: Store, settings: plan.Settings) -> None:
        self._store, self._settings = store, settings
        self._seen: dict[str, tuple[int, float]] = {}

    def beat(self, key: str) -> None:
        self._store.add(key, 1)

    def lost(self, key: str, now: float) -> str | None:
        """Why the member beating at ``key`` counts as dead, or None while it lives."""
        version = self._store.get(key).version
        seen_version, seen_at = self._seen.get(key, (-1, now))
        if version != seen_version:
            self._seen[key] = (version, now)
            return None
        if plan.is_dead(seen_at, now, self._settings):
            return f"no heartbeat for {self._settings.dead_after:g}s"
        return None

    def end(self) -> None:
        pass


class _LeasePulse:
    """Heartbeats as an etcd lease the member renews, holding its key: when the member dies,
    etcd lets the lease expire and deletes the key, which is how its neighbour learns it."""

    def __init__(self, store: EtcdStore, settings: plan.Settings) -> None:
        self._store, self._settings = store, settings
        self._lease: int | None = None
        self._started = time.monotonic()
        self._seen: set[str] = set()

    def beat(self, key: str) -> None:
        if self._lease is not None and self._store.keep_alive(self._lease):
            return
        self._lease = self._store.grant_lease(self._settings.dead_after)
        self._store.set(key, b"", lease=self._lease)

    def lost(self, key: str, now: float) -> str | None:
        if self._store.get(key).value is not None:
            self._seen.add(key)
            return None
        if key in self._seen:
            return "its etcd lease expired"
        if plan.is_dead(self._started, now, self._settings):
            return f"no heartbeat for {self._settings.dead_after:g}s"
        return None

    def end(self) -> None:
        """Revoke the lease, so the key goes at once rather than when the lease runs out."""
        if self._lease is not None:
            try:
                self._store.revoke_lease(self._lease)
            except StoreError:
                pass


def _setting(params: RendezvousParameters, key: str, default: float, whole: bool = False) -> Any:
    value = params.get(key, default)
    try:
        return int(value) if whole else float(value)
    except (TypeError, ValueError):
        kind = "a whole number" if whole else "a number of seconds"
        raise ValueError(f"--rdzv-conf {key}={value!r}: expected {kind}") from None


def _plan_settings(params: RendezvousParameters) -> plan.Settings:
    return plan.Settings(
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        join_timeout=_setting(params, "join_timeout", 600),
        last_call_timeout=_setting(params, "last_call_timeout", 30),
        keep_alive_interval=_setting(params, "keep_alive_interval", 5),
        keep_alive_max_attempt=_setting(params, "keep_alive_max_attempt", 3, whole=True),
    )


def create_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """Build the handler for ``c10d``/``tcp``: host the store if this node can bind the endpoint."""
    host, port = parse_endpoint(params.endpoint or "127.0.0.1", DEFAULT_PORT)
    token = params.get("token") or os.environ.get(TOKEN_ENV) or None
    timeout = _setting(params, "timeout", 60)
    settings = _plan_settings(params)
    is_host = params.get("is_host")
    local_world_size = int(params.get("local_world_size", 1))
    if port == 0 and params.max_nodes == 1 and (is_host is None or _truthy(is_host)):
        # --standalone: one node on a port nobody knows, so nobody else can join. The same
        # rendezvous runs on the store in this process, with no server and no sockets.
        from relaunch.store.memory import MemoryStore

        memory = MemoryStore()
        return DynamicRendezvousHandler(
            params.run_id,
            memory,
            settings,
            local_world_size,
            host,
            memory,
            backend=params.backend,
            watch_store=memory,
        )
    import socket

    from relaunch.store.client import TcpStore
    from relaunch.store.server import TcpStoreServer

    server: TcpStoreServer | None = None
    if is_host is None or _truthy(is_host):
        try:
            server = TcpStoreServer(host, port, token).start()
            port = server.port
        except OSError as exc:
            if is_host is not None:
                raise RendezvousError(f"cannot host the store on {host}:{port}: {exc}") from None
    local_addr = params.local_addr or (host if is_loopback(host) else socket.getfqdn())
    on_shutdown = (server.stop,) if server is not None else ()
    try:
        store = TcpStore(host, port, token, timeout=timeout, connect_timeout=settings.join_timeout)
        heartbeat_store = TcpStore(
            host, port, token, timeout=timeout, connect_timeout=settings.join_timeout
        )
        watch_store = TcpStore(
            host, port, token, timeout=timeout, connect_timeout=settings.join_timeout
        )
    except StoreError as exc:
        for stop in on_shutdown:
            stop()
        raise RendezvousError(f"rendezvous of job {params.run_id!r}: {exc}") from None
    return DynamicRendezvousHandler(
        params.run_id,
        store,
        settings,
        local_world_size,
        local_addr,
        heartbeat_store,
        backend=params.backend,
        on_shutdown=(watch_store.close, *on_shutdown),
        watch_store=watch_store,
    )


def create_etcd_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """Build the handler for ``etcd``: the same rendezvous, on an etcd v3 cluster.

    ``--rdzv-endpoint`` lists the members; ``--rdzv-conf`` may set ``protocol``, ``cacert``,
    ``cert``, ``key``, ``user``, ``password`` and ``timeout`` (seconds, per operation).
    """
    from relaunch.store.etcd import EtcdStore

    settings = _plan_settings(params)
    options = {
        "protocol": str(params.get("protocol", "http")),
        "cacert": params.get("cacert"),
        "cert": params.get("cert"),
        "key": params.get("key"),
        "user": params.get("user"),
        "password": params.get("password"),
        "timeout": _setting(params, "timeout", 60),
    }
    for path_option in ("cacert", "cert", "key"):
        path = options[path_option]
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"--rdzv-conf {path_option}={path}: no such file")
    store, heartbeat_store, watch_store = (
        EtcdStore(params.endpoint or "127.0.0.1", **options) for _ in range(3)
    )
    try:
        store.get(f"relaunch/{params.run_id}/closed")  # reachable, and the credentials work
    except StoreError as exc:
        raise RendezvousError(f"rendezvous of job {params.run_id!r}: {exc}") from None
    if params.local_addr:
        local_addr = params.local_addr
    elif all(is_loopback(endpoint.host) for endpoint in store.endpoints):
        local_addr = "127.0.0.1"
    else:
        import socket

        local_addr = socket.getfqdn()
    return DynamicRendezvousHandler(
        params.run_id,
        store,
        settings,
        int(params.get("local_world_size", 1)),
        local_addr,
        heartbeat_store,
        backend=params.backend,
        on_shutdown=(watch_store.close,),
        watch_store=watch_store,
        leases=True,
    )
