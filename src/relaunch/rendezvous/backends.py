"""Building a rendezvous handler from ``--rdzv-*`` flags: the registry of backends.

``static`` takes its rank from the flags; ``c10d``/``tcp`` run the dynamic rendezvous on the
built-in store (hosted by the agent that can bind the endpoint), ``etcd``/``etcd-v2`` on an etcd
v3 cluster, and ``--standalone`` on a store in this process. The store and network code load
only for the backend that needs them.
"""

from __future__ import annotations

import logging
import os

from relaunch.config import RdzvSettings, etcd_options, rdzv_settings
from relaunch.core import exclusion
from relaunch.core import rendezvous as plan
from relaunch.core.durations import seconds
from relaunch.endpoints import is_loopback, parse_endpoint
from relaunch.rendezvous.api import (
    BACKENDS,
    TOKEN_ENV,
    RendezvousError,
    RendezvousHandler,
    RendezvousParameters,
)
from relaunch.rendezvous.dynamic import DynamicRendezvousHandler
from relaunch.rendezvous.static import StaticRendezvousHandler
from relaunch.store.api import StoreError

DEFAULT_PORT = 29400

log = logging.getLogger(__name__)


def get_rendezvous_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The handler for ``params.backend``; ValueError naming the valid backends otherwise."""
    if params.backend == "static":
        return StaticRendezvousHandler.from_parameters(params)
    if params.backend in ("c10d", "tcp"):
        return create_handler(params)
    if params.backend in ("etcd", "etcd-v2"):
        return create_etcd_handler(params)
    raise ValueError(
        f"unknown rendezvous backend {params.backend!r}: valid backends are " + ", ".join(BACKENDS)
    )


def _identity(conf: RdzvSettings) -> str:
    """How the job knows this node (``core.exclusion``): its host, and ``node_name``."""
    return exclusion.node_identity(os.uname().nodename, conf.node_name)


def _policy(conf: RdzvSettings) -> exclusion.ExclusionPolicy:
    return exclusion.ExclusionPolicy(conf.exclude_after, conf.exclude_cooldown)


def _plan_settings(params: RendezvousParameters, conf: RdzvSettings) -> plan.Settings:
    return plan.Settings(
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        join_timeout=conf.join_timeout,
        last_call_timeout=conf.last_call_timeout,
        keep_alive_interval=conf.keep_alive_interval,
        keep_alive_max_attempt=conf.keep_alive_max_attempt,
    )


def create_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """Build the handler for ``c10d``/``tcp``: host the store if this node can bind the endpoint."""
    host, port = parse_endpoint(params.endpoint or "127.0.0.1", DEFAULT_PORT)
    conf = rdzv_settings(params.config)
    token = conf.token or os.environ.get(TOKEN_ENV) or None
    timeout = conf.timeout
    settings = _plan_settings(params, conf)
    is_host = conf.is_host
    local_world_size = int(params.get("local_world_size", 1))
    if port == 0 and params.max_nodes == 1 and is_host is not False:
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
            identity=_identity(conf),
            exclusion_policy=_policy(conf),
        )
    import socket

    from relaunch.store.client import TcpStore
    from relaunch.store.server import TcpStoreServer

    server: TcpStoreServer | None = None
    if is_host is not False:
        try:
            # Each node connects three times (store, heartbeat, watch): room for all of them.
            server = TcpStoreServer(host, port, token, expected_clients=3 * params.max_nodes)
            server.start()
            port = server.port
        except OSError as exc:
            if is_host is not None:
                raise RendezvousError(f"cannot host the store on {host}:{port}: {exc}") from None
    local_addr = params.local_addr or (host if is_loopback(host) else socket.getfqdn())
    on_shutdown = (server.stop,) if server is not None else ()

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
        identity=_identity(conf),
        exclusion_policy=_policy(conf),
        store_host_probe=probe if server is None else None,
    )


def create_etcd_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """Build the handler for ``etcd``: the same rendezvous, on an etcd v3 cluster.

    ``--rdzv-endpoint`` lists the members; ``--rdzv-conf`` may set ``protocol``, ``cacert``,
    ``cert``, ``key``, ``user``, ``password`` and ``timeout`` (seconds, per operation).
    """
    from relaunch.store.etcd import EtcdStore

    conf = rdzv_settings(params.config)
    settings = _plan_settings(params, conf)
    options = etcd_options(params.config)
    store, heartbeat_store, watch_store = (
        EtcdStore(params.endpoint or "127.0.0.1", **options) for _ in range(3)
    )
    try:
        store.get(f"relaunch/{params.run_id}/news/closed")  # reachable, and the credentials work
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
        identity=_identity(conf),
        exclusion_policy=_policy(conf),
    )
