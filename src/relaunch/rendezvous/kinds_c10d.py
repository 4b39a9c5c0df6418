"""The built-in store as a store kind of the dynamic rendezvous (``c10d``/``tcp``): what
``kind_registry`` asks of it.

The store is hosted by the agent that can bind the endpoint; with several endpoints it may move
among them (``failover``). Which part this node takes is ``core.rendezvous.store_roles``' choice;
this module binds, connects and builds the handler on ``kinds_counter.CounterKind``.
(``--standalone``, the store in this process, is ``backends``'.)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from relaunch.core.durations import seconds
from relaunch.core.rendezvous import rdzv_conf
from relaunch.core.rendezvous import rounds as plan
from relaunch.core.rendezvous.rdzv_conf import C10D_DEFAULT_PORT, RendezvousSettings, RendezvousSpec
from relaunch.core.rendezvous.store_roles import StoreRole, StoreSetup, store_roles
from relaunch.endpoints import is_loopback, parse_endpoint_list
from relaunch.rendezvous.api import RendezvousConnectionError
from relaunch.rendezvous.kinds import SeatShutdown
from relaunch.store.api import StoreError

if TYPE_CHECKING:
    from relaunch.rendezvous.death_notice import DeathNotice
    from relaunch.rendezvous.dynamic import DynamicRendezvousHandler
    from relaunch.rendezvous.failover import StoreFailover
    from relaunch.rendezvous.reader import JobReader
    from relaunch.store.client import TcpStore
    from relaunch.store.replication import Elect
    from relaunch.store.server import TcpStoreServer

#: What ``relaunch status`` suggests when the store cannot be read.
UNREACHABLE_HINT = "is the job running? Its store lives as long as the agent that serves it"

Endpoint = tuple[str, int]
log = logging.getLogger(__name__)


def create_handler(params: RendezvousSpec) -> DynamicRendezvousHandler:
    """Build the handler for ``c10d``/``tcp``: host the store if this node can bind the endpoint.
    With several endpoints the store may move among them (``failover``): the node joins the one
    that serves the job now, hosts it if none does and it can, and else serves a standby at the
    first other one it can bind."""
    from relaunch.rendezvous.death_notice import DeathNotice
    from relaunch.rendezvous.dynamic import DynamicRendezvousHandler, node_options
    from relaunch.rendezvous.failover import StoreFailover, format_endpoint, job_electorate

    endpoints = parse_endpoint_list(params.endpoint or "127.0.0.1", C10D_DEFAULT_PORT)
    conf = params.settings
    token = conf.job_token(os.environ)
    settings = conf.round_settings(params.min_nodes, params.max_nodes)
    _check_token(params, endpoints, token)
    serving = _find_serving(params.run_id, endpoints, token)
    setup = StoreSetup(
        len(endpoints), endpoints[0][1], params.max_nodes, conf.is_host, serving is not None
    )
    roles = store_roles(setup)
    elect = job_electorate(params.run_id) if len(endpoints) > 1 else None
    # Each node connects three times (store, heartbeat, watch): room for all of them.
    server, standby, (host, port) = _serve(
        roles, endpoints, serving or endpoints[0], token, 3 * params.max_nodes, elect
    )
    local_addr = params.local_addr or (host if is_loopback(host) else _fqdn())
    on_shutdown = tuple(hosted.stop for hosted in (server, standby) if hosted is not None)
    try:
        clients, (host, port) = _connect(host, port, token, conf, settings, server, elect)
    except StoreError as exc:
        for stop in on_shutdown:
            stop()
        raise RendezvousConnectionError(f"rendezvous of job {params.run_id!r}: {exc}") from None
    store, heartbeat_store, watch_store = clients
    # The store's host takes the store with it: nobody would hear its death notice.
    where = {"store": "c10d", "host": host, "port": port, "token": token}
    death_notice = None if server is not None else DeathNotice(where)
    failover = None
    if elect is not None:
        failover = StoreFailover(endpoints, token, (host, port), server or standby, elect)
        _follow_moves(failover, clients, death_notice)
    seat = C10dSeat((host, port), token, conf.timeout, server, failover, local_addr)
    seat.hold(standby, settings.dead_after)
    return DynamicRendezvousHandler.on_counters(
        params.run_id,
        store,
        settings,
        local_addr,
        heartbeat_store,
        watch_store=watch_store,
        backend=params.backend,
        on_shutdown=(seat.end, watch_store.close, seat.let_go),
        store_host_probe=_probe(host, port, token) if server is None else None,
        death_notice=death_notice,
        failover=failover,
        token=token,
        where=format_endpoint((host, port)),
        seat=seat,
        **node_options(conf),
    )


class C10dSeat(SeatShutdown):
    """The built-in store, for what runs beside the rendezvous (``kinds.StoreSeat``): hosted by
    this node while its server is the one serving the job (with failover, until it moves)."""

    hosted = True

    def __init__(
        self,
        endpoint: Endpoint,
        token: str | None,
        timeout: float,
        server: TcpStoreServer | None,
        failover: StoreFailover | None,
        local_addr: str,
    ) -> None:
        super().__init__()
        self._endpoint, self._token, self._timeout = endpoint, token, timeout
        self._server, self._failover = server, failover
        self._servers: tuple[TcpStoreServer, ...] = () if server is None else (server,)
        self._silence, self._outlive = 0.0, False
        self.local_addr = local_addr
        self.lease_ttl = 0.0

    def connect(self) -> TcpStore:
        from relaunch.store.client import TcpStore

        failover = self._failover
        host, port = self._endpoint if failover is None else failover.primary
        store = TcpStore(host, port, self._token, timeout=self._timeout)
        if failover is not None:
            failover.add_client(store)
        return store

    def host_here(self) -> str | None:
        failover = self._failover
        if failover is not None:
            return failover.primary[0] if failover.hosting else None
        return self._endpoint[0] if self._server is not None else None

    def on_move(self, moved: Callable[[], None]) -> None:
        if self._failover is not None:
            self._failover.on_move(lambda host, port: moved())

    # -- the store's life: with the rendezvous, or past it (``outlive``) -----------------------

    def hold(self, standby: TcpStoreServer | None, silence: float) -> None:
        """This node's standby too is stopped by ``let_go``; ``silence``: how long the other
        agents of a store kept past the rendezvous (``outlive``) may send nothing before it
        ends anyway (the rendezvous' detection time: a node silent that long counts as
        lost)."""
        if standby is not None:
            self._servers += (standby,)
        self._silence = silence

    def outlive(self) -> None:
        self._outlive = True

    @property
    def kept(self) -> bool:
        return self._outlive and self._serving() is not None

    def let_go(self) -> None:
        """The rendezvous shuts down: the failover's watch stops, and this node's servers too,
        unless one serves the job and ``outlive`` was asked (``end_store`` stops them then)."""
        if self._failover is not None:
            self._failover.close()
        if not self.kept:
            self._stop()

    def end_store(self, wait: bool, say: Callable[[str], None]) -> None:
        server = self._serving() if self._outlive else None
        self._outlive = False
        try:
            if wait and server is not None:
                _serve_the_others(server, self._silence, say)
        finally:
            self._stop()

    def _serving(self) -> TcpStoreServer | None:
        """This node's server that serves the job now (not a standby, not fenced)."""
        for server in self._servers:
            if not server.standby and not server.fenced:
                return server
        return None

    def _stop(self) -> None:
        for server in self._servers:
            server.stop()


def _serve_the_others(server: TcpStoreServer, silence: float, say: Callable[[str], None]) -> None:
    """Serve the agents still connected to the job's store (other replica groups') until they
    leave, or until none of them asked anything for ``silence`` seconds; said in a line, and
    how it ended in another."""
    import time

    connections = server.attendance.connected()
    if not connections:
        return
    say(
        f"relaunch: this node hosts the job's store, which the other replica groups' agents "
        f"still use ({connections} connections): it serves them until they leave, or until "
        f"none is heard from for {seconds(silence)} (the rendezvous' detection time)"
    )
    start = time.monotonic()
    left = server.attendance.wait_gone(silence)
    waited = seconds(time.monotonic() - start)
    if left:
        say(f"relaunch: the job's store ends: the other agents left (after {waited})")
    else:
        say(
            f"relaunch: the job's store ends after {waited}: the {server.attendance.connected()} "
            f"connections left sent nothing for {seconds(silence)} (their nodes are gone or cut "
            "off)"
        )


def _follow_moves(
    failover: StoreFailover, clients: tuple[TcpStore, ...], death_notice: DeathNotice | None
) -> None:
    """The node's connections, and its death notice, go where the store moves."""
    store, heartbeat_store, watch_store = clients
    for client in (heartbeat_store, store, watch_store):
        failover.add_client(client)
    if death_notice is not None:
        failover.on_move(death_notice.move_to)


def _fqdn() -> str:
    import socket

    return socket.getfqdn()


def _check_token(params: RendezvousSpec, endpoints: list[Endpoint], token: str | None) -> None:
    """A store that may move needs the job's token (ValueError); one that many nodes share is
    said to be open to anyone without it."""
    if len(endpoints) > 1 and token is None:
        raise ValueError(rdzv_conf.failover_without_token(len(endpoints)))
    if token is None and params.max_nodes > 1:
        from relaunch.rendezvous.failover import format_endpoint

        log.warning(
            "job %r may run on up to %d nodes and its store has no token: anyone who reaches "
            "%s can join the job, and read and write its store; set the same --rdzv-conf "
            "token=SECRET (or %s) on every node",
            params.run_id,
            params.max_nodes,
            format_endpoint(endpoints[0]),
            rdzv_conf.TOKEN_ENV,
        )


def _find_serving(run_id: str, endpoints: list[Endpoint], token: str | None) -> Endpoint | None:
    """Of several endpoints, the one whose store serves the job now (None: none does, or there
    is one endpoint)."""
    if len(endpoints) == 1:
        return None
    from relaunch.rendezvous.failover import find_primary

    try:
        return find_primary(endpoints, token)
    except StoreError as exc:
        raise RendezvousConnectionError(f"rendezvous of job {run_id!r}: {exc}") from None


def _serve(
    roles: tuple[StoreRole, ...],
    endpoints: list[Endpoint],
    primary: Endpoint,
    token: str | None,
    clients: int,
    elect: Elect | None,
) -> tuple[TcpStoreServer | None, TcpStoreServer | None, Endpoint]:
    """Take the first of ``roles`` this node can: the store it hosts, the standby it serves, and
    where the job's store is. A ``HOST`` that was the last role to try and cannot bind is a
    ``RendezvousConnectionError``."""
    from relaunch.store.server import TcpStoreServer

    host, port = primary
    for role in roles:
        if role is StoreRole.HOST:
            try:
                server = TcpStoreServer(host, port, token, expected_clients=clients)
                server.start()
                return server, None, (host, server.port)
            except OSError as exc:
                if role is roles[-1]:
                    raise RendezvousConnectionError(
                        f"cannot host the store on {host}:{port}: {exc}"
                    ) from None
        elif role is StoreRole.STANDBY and elect is not None:
            standby = _serve_standby(endpoints, primary, token, clients, elect)
            if standby is not None:
                return None, standby, primary
    return None, None, primary


def _serve_standby(
    endpoints: list[Endpoint],
    primary: Endpoint,
    token: str | None,
    clients: int,
    elect: Elect,
) -> TcpStoreServer | None:
    """A standby of ``primary`` at the first other endpoint this node can bind (its own host's
    address), or None when it can bind none; ``elect`` reads who may vote it in."""
    from relaunch.store.server import TcpStoreServer

    for host, port in endpoints:
        if (host, port) == primary:
            continue
        try:
            standby = TcpStoreServer(host, port, token, expected_clients=clients)
        except OSError:
            continue  # not this machine's address, or another node serves there
        standby.start()
        standby.follow(*primary, elect)
        return standby
    return None


def _connect(
    host: str,
    port: int,
    token: str | None,
    conf: RendezvousSettings,
    settings: plan.Settings,
    server: TcpStoreServer | None,
    elect: Elect | None,
) -> tuple[tuple[TcpStore, TcpStore, TcpStore], Endpoint]:
    """The node's three connections to the store at ``host:port`` (store, heartbeat, watch),
    and where they reach it: a standby's address redirects them to where the store moved.
    StoreError when it cannot be reached."""
    from relaunch.store.client import TcpStore

    timeout, failing_over = conf.timeout, elect is not None

    def waiting(endpoint: str, within: float, reason: str) -> None:
        """Said once, when the store does not answer at first: what this agent waits for."""
        log.warning(
            "waiting up to %s (join_timeout) for the store at %s%s: it is hosted by the agent of "
            "the node that can bind that address; start relaunch there, or check --rdzv-endpoint",
            seconds(within),
            endpoint,
            f" ({reason})" if reason else "",
        )

    join = settings.join_timeout
    store = TcpStore(host, port, token, timeout=timeout, connect_timeout=join, on_wait=waiting)
    # A beat the store has not taken within the detection time: its host is silent.
    beat_timeout = min(timeout, settings.dead_after) if failing_over else timeout
    heartbeat_store = TcpStore(host, port, token, timeout=beat_timeout, connect_timeout=join)
    watch_store = TcpStore(host, port, token, timeout=timeout, connect_timeout=join)
    clients = (store, heartbeat_store, watch_store)
    if server is None and not failing_over:
        from relaunch.rendezvous.failover import redirected

        moved = redirected(store)  # a standby's address: join where its store moved
        if moved is not None:
            host, port = moved
            for client in clients:
                client.move_to(host, port)
    return clients, (host, port)


def _probe(host: str, port: int, token: str | None) -> Callable[[float], None]:
    def probe(within: float) -> None:
        """Reach the store hosted elsewhere within ``within`` seconds, or ``StoreError``."""
        from relaunch.store.client import TcpStore

        TcpStore(host, port, token, timeout=within, connect_timeout=within).close()

    return probe


def write_death_notice(
    where: Mapping[str, Any], changed: str, round_signal: str, record: bytes, timeout: float
) -> bool:
    """A dead agent's death notice (``death_notice``): the change and its round signal, on the store
    at ``where``, within ``timeout`` seconds a request."""
    from relaunch.rendezvous.kinds_counter import supersede_on_counters
    from relaunch.store.client import TcpStore

    host, port, token = where["host"], where["port"], where["token"]
    store = TcpStore(host, port, token, timeout=timeout, connect_timeout=timeout)
    try:
        return supersede_on_counters(store, changed, round_signal, record)
    finally:
        store.close()


def open_reader(
    endpoint: str,
    run_id: str,
    conf: RendezvousSettings,
    timeout: float,
    environ: Mapping[str, str],
) -> tuple[JobReader, str]:
    """``relaunch status``'s reader of job ``run_id`` on the store at ``endpoint`` (the one that
    serves the job now, of several), and the store's address in words. ``EndpointError`` when
    ``endpoint`` is not one."""
    from relaunch.rendezvous.kind_registry import EndpointError
    from relaunch.rendezvous.reader import JobReader
    from relaunch.store.client import TcpStore

    try:
        endpoints = parse_endpoint_list(endpoint, C10D_DEFAULT_PORT)
    except ValueError as exc:
        raise EndpointError(str(exc)) from None
    token = conf.job_token(environ)
    host, port = endpoints[0]
    if len(endpoints) > 1:  # the store may have moved among them: ask which one serves
        from relaunch.rendezvous.failover import find_primary

        host, port = find_primary(endpoints, token, min(timeout, 1.0)) or endpoints[0]
    store = TcpStore(host, port, token, timeout=timeout, connect_timeout=min(timeout, 5.0))
    return JobReader(store, run_id), store.endpoint
