"""Building a rendezvous handler from ``--rdzv-*`` flags: the registry of backends.

``static`` takes its rank from the flags; ``c10d``/``tcp`` run the dynamic rendezvous on the
built-in store (hosted by the agent that can bind the endpoint), ``etcd``/``etcd-v2`` on an etcd
v3 cluster, and ``--standalone`` on a store in this process. The dynamic rendezvous, the store
and the network code load only for the backend that needs them.

A handler is built from a ``core.rdzv_conf.RendezvousSpec``, whose ``--rdzv-conf`` keys were
read and checked once (``create_rendezvous_handler``); torch's ``get_rendezvous_handler`` builds
through ``rendezvous_handler_registry``, where the built-in backends are registered (they read a
``RendezvousParameters``' keys into a spec first) and a user's own may be.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from relaunch.core import exclusion, rdzv_conf
from relaunch.core.durations import seconds
from relaunch.core.rdzv_conf import (
    BACKENDS,
    C10D_BACKENDS,
    ETCD_BACKENDS,
    STATIC_BACKEND,
    RendezvousSettings,
    RendezvousSpec,
)
from relaunch.endpoints import is_loopback, parse_endpoint, parse_endpoint_list
from relaunch.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from relaunch.rendezvous.static import StaticRendezvousHandler
from relaunch.store.api import StoreError

if TYPE_CHECKING:
    from relaunch.rendezvous.dynamic import DynamicRendezvousHandler
    from relaunch.rendezvous.last_word import LastWord
    from relaunch.store.server import Elect, TcpStoreServer

DEFAULT_PORT = 29400

log = logging.getLogger(__name__)


def get_rendezvous_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The handler for ``params.backend`` (torch's entry point), built by the creator
    ``rendezvous_handler_registry`` has for it: a built-in backend's reads and checks
    ``config`` (``core.rdzv_conf.parse``), then ``create_rendezvous_handler``. ValueError naming
    the registered backends, or saying which key is wrong."""
    return rendezvous_handler_registry.create_handler(params)


def _create_builtin(params: RendezvousParameters) -> RendezvousHandler:
    """A built-in backend's handler for ``params``."""
    spec = RendezvousSpec(
        backend=params.backend,
        endpoint=params.endpoint,
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        settings=rdzv_conf.parse(params.backend, params.config, is_file=os.path.isfile),
        local_addr=params.local_addr,
    )
    return create_rendezvous_handler(spec)


for _backend in BACKENDS:
    rendezvous_handler_registry.register(_backend, _create_builtin)


def create_rendezvous_handler(spec: RendezvousSpec) -> RendezvousHandler:
    """The handler for ``spec.backend``, built from its settings as they are."""
    if spec.backend == STATIC_BACKEND:
        return create_static_handler(spec)
    if spec.backend in C10D_BACKENDS:
        return create_handler(spec)
    if spec.backend in ETCD_BACKENDS:
        return create_etcd_handler(spec)
    raise ValueError(
        f"unknown rendezvous backend {spec.backend!r}: valid backends are " + ", ".join(BACKENDS)
    )


def _identity(conf: RendezvousSettings) -> str:
    """How the job knows this node (``core.exclusion``): its host, and ``node_name``."""
    return exclusion.node_identity(os.uname().nodename, conf.node_name)


def _policy(conf: RendezvousSettings) -> exclusion.ExclusionPolicy:
    return exclusion.ExclusionPolicy(conf.exclude_after, conf.exclude_cooldown)


def _last_word(where: dict[str, Any]) -> LastWord:
    """What this node's orphan guardian says to the store at ``where`` should its agent die
    (the agent hands it to the guardian: ``JobServices.leave_last_word_with``)."""
    from relaunch.rendezvous.last_word import LastWord

    return LastWord(where)


def create_static_handler(spec: RendezvousSpec) -> StaticRendezvousHandler:
    """Build the handler for ``static``: this node's rank, and the master at the endpoint."""
    if spec.min_nodes != spec.max_nodes:
        raise ValueError(
            f"--nnodes {spec.min_nodes}:{spec.max_nodes} needs an elastic rendezvous "
            "backend; the static backend takes a fixed number of nodes"
        )
    host, port = parse_endpoint(spec.endpoint, default_port=29500)
    return StaticRendezvousHandler(
        run_id=spec.run_id,
        node_rank=spec.settings.rank or 0,
        nnodes=spec.max_nodes,
        master_addr=host,
        master_port=port,
        resolve_timeout=spec.settings.join_timeout,
    )


def create_handler(params: RendezvousSpec) -> DynamicRendezvousHandler:
    """Build the handler for ``c10d``/``tcp``: host the store if this node can bind the endpoint.
    With several endpoints the store may move among them (``failover``): the node joins the one
    that serves the job now, hosts it if none does and it can, and else serves a standby at the
    first other one it can bind."""
    from relaunch.rendezvous.dynamic import DynamicRendezvousHandler

    endpoints = parse_endpoint_list(params.endpoint or "127.0.0.1", DEFAULT_PORT)
    host, port = endpoints[0]
    conf = params.settings
    token = conf.job_token(os.environ)
    timeout = conf.timeout
    settings = conf.round_settings(params.min_nodes, params.max_nodes)
    is_host = conf.is_host
    if port == 0 and params.max_nodes == 1 and is_host is not False and len(endpoints) == 1:
        # --standalone: one node on a port nobody knows, so nobody else can join. The same
        # rendezvous runs on the store in this process, with no server and no sockets.
        from relaunch.store.memory import MemoryStore

        memory = MemoryStore()
        return DynamicRendezvousHandler.on_counters(
            params.run_id,
            memory,
            settings,
            host,
            memory,
            watch_store=memory,
            backend=params.backend,
            identity=_identity(conf),
            exclusion_policy=_policy(conf),
            node_rank=conf.rank,
        )
    import socket

    from relaunch.store.client import TcpStore
    from relaunch.store.server import TcpStoreServer

    failing_over = len(endpoints) > 1
    if failing_over and token is None:
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
    serving = None
    if failing_over:
        from relaunch.rendezvous.failover import find_primary

        try:
            serving = find_primary(endpoints, token)
        except StoreError as exc:
            raise RendezvousConnectionError(f"rendezvous of job {params.run_id!r}: {exc}") from None
        host, port = serving or endpoints[0]
    # Each node connects three times (store, heartbeat, watch): room for all of them.
    clients = 3 * params.max_nodes
    server: TcpStoreServer | None = None
    if is_host is not False and serving is None:
        try:
            server = TcpStoreServer(host, port, token, expected_clients=clients)
            server.start()
            port = server.port
        except OSError as exc:
            if is_host is not None:
                raise RendezvousConnectionError(
                    f"cannot host the store on {host}:{port}: {exc}"
                ) from None
    standby = None
    from relaunch.rendezvous.failover import job_electorate

    elect = job_electorate(params.run_id) if failing_over else None
    if elect is not None and server is None and is_host is not False:
        standby = _serve_standby(endpoints, (host, port), token, clients, elect)
    local_addr = params.local_addr or (host if is_loopback(host) else socket.getfqdn())
    on_shutdown = tuple(hosted.stop for hosted in (server, standby) if hosted is not None)

    def probe(within: float) -> None:
        """Reach the store hosted elsewhere within ``within`` seconds, or ``StoreError``."""
        TcpStore(host, port, token, timeout=within, connect_timeout=within).close()

    def waiting(endpoint: str, within: float, reason: str) -> None:
        """Said once, when the store does not answer at first: what this agent waits for."""
        log.warning(
            "waiting up to %s (join_timeout) for the store at %s%s: it is hosted by the agent of "
            "the node that can bind that address; start relaunch there, or check --rdzv-endpoint",
            seconds(within),
            endpoint,
            f" ({reason})" if reason else "",
        )

    try:
        store = TcpStore(
            host,
            port,
            token,
            timeout=timeout,
            connect_timeout=settings.join_timeout,
            on_wait=waiting,
        )
        heartbeat_store = TcpStore(
            host,
            port,
            token,
            # A beat the store has not taken within the detection time: its host is silent.
            timeout=min(timeout, settings.dead_after) if failing_over else timeout,
            connect_timeout=settings.join_timeout,
        )
        watch_store = TcpStore(
            host, port, token, timeout=timeout, connect_timeout=settings.join_timeout
        )
        if server is None and not failing_over:
            from relaunch.rendezvous.failover import redirected

            moved = redirected(store)  # a standby's address: join where its store moved
            if moved is not None:
                host, port = moved
                for client in (store, heartbeat_store, watch_store):
                    client.move_to(host, port)
    except StoreError as exc:
        for stop in on_shutdown:
            stop()
        raise RendezvousConnectionError(f"rendezvous of job {params.run_id!r}: {exc}") from None
    # The store's host takes the store with it: nobody would hear its last word.
    last_word = (
        None
        if server is not None
        else _last_word({"store": "c10d", "host": host, "port": port, "token": token})
    )
    failover = None
    if elect is not None:
        from relaunch.rendezvous.failover import StoreFailover

        failover = StoreFailover(endpoints, token, (host, port), server or standby, elect)
        for client in (heartbeat_store, store, watch_store):
            failover.add_client(client)
        if last_word is not None:
            failover.on_move(last_word.move_to)
        on_shutdown = (failover.close, *on_shutdown)
    return DynamicRendezvousHandler.on_counters(
        params.run_id,
        store,
        settings,
        local_addr,
        heartbeat_store,
        watch_store=watch_store,
        backend=params.backend,
        on_shutdown=(watch_store.close, *on_shutdown),
        identity=_identity(conf),
        exclusion_policy=_policy(conf),
        store_host_probe=probe if server is None else None,
        node_rank=conf.rank,
        last_word=last_word,
        failover=failover,
        token=token,
    )


def _serve_standby(
    endpoints: list[tuple[str, int]],
    primary: tuple[str, int],
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


def create_etcd_handler(params: RendezvousSpec) -> DynamicRendezvousHandler:
    """Build the handler for ``etcd``: the same rendezvous, on an etcd v3 cluster.

    ``--rdzv-endpoint`` lists the members; ``--rdzv-conf`` may set ``protocol``, ``cacert``,
    ``cert``, ``key``, ``user``, ``password`` and ``timeout`` (seconds, per operation).
    """
    from relaunch.rendezvous.dynamic import DynamicRendezvousHandler
    from relaunch.store.etcd import EtcdStore

    conf = params.settings
    settings = conf.round_settings(params.min_nodes, params.max_nodes)
    options = conf.etcd_store_arguments()
    store, heartbeat_store, watch_store = (
        EtcdStore(params.endpoint or "127.0.0.1", **options) for _ in range(3)
    )
    try:
        store.get(f"relaunch/{params.run_id}/news/closed")  # reachable, and the credentials work
    except StoreError as exc:
        raise RendezvousConnectionError(f"rendezvous of job {params.run_id!r}: {exc}") from None
    if params.local_addr:
        local_addr = params.local_addr
    elif all(is_loopback(endpoint.host) for endpoint in store.endpoints):
        local_addr = "127.0.0.1"
    else:
        import socket

        local_addr = socket.getfqdn()
    return DynamicRendezvousHandler.on_etcd(
        params.run_id,
        store,
        settings,
        local_addr,
        heartbeat_store,
        watch_store=watch_store,
        backend=params.backend,
        on_shutdown=(watch_store.close,),
        identity=_identity(conf),
        exclusion_policy=_policy(conf),
        node_rank=conf.rank,
        last_word=_last_word(
            {"store": "etcd", "endpoints": params.endpoint or "127.0.0.1", "options": options}
        ),
        token=conf.job_token(os.environ),  # for the state copies alone
    )
