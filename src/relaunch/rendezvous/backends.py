"""Building a rendezvous handler from ``--rdzv-*`` flags: the registry of backends.

``static`` takes its rank from the flags; ``c10d``/``tcp`` run the dynamic rendezvous on the
built-in store (hosted by the agent that can bind the endpoint), ``etcd``/``etcd-v2`` on an etcd
v3 cluster, and ``--standalone`` on a store in this process. The dynamic rendezvous, the store
and the network code load only for the backend that needs them.

A handler is built from a ``core.rendezvous.rdzv_conf.RendezvousSpec``, whose ``--rdzv-conf`` keys
were read and checked once (``create_rendezvous_handler``); torch's ``get_rendezvous_handler``
builds through ``rendezvous_handler_registry``, where the built-in backends are registered (they
read a
``RendezvousParameters``' keys into a spec first) and a user's own may be.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from relaunch.core.rendezvous import rdzv_conf
from relaunch.core.rendezvous.rdzv_conf import (
    BACKENDS,
    C10D_BACKENDS,
    C10D_DEFAULT_PORT,
    STATIC_BACKEND,
    RendezvousSpec,
    registered_kind,
)
from relaunch.core.rendezvous.store_roles import StoreRole, StoreSetup, store_roles
from relaunch.endpoints import parse_endpoint, parse_endpoint_list
from relaunch.rendezvous.api import (
    RendezvousHandler,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from relaunch.rendezvous.kind_registry import kind_module

if TYPE_CHECKING:
    from relaunch.rendezvous.dynamic import DynamicRendezvousHandler
    from relaunch.rendezvous.static import StaticRendezvousHandler

__all__ = ["create_rendezvous_handler", "get_rendezvous_handler"]


def get_rendezvous_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The handler for ``params.backend`` (torch's entry point), built by the creator
    ``rendezvous_handler_registry`` has for it: a built-in backend's reads and checks
    ``config`` (``core.rendezvous.rdzv_conf.parse``), then ``create_rendezvous_handler``. ValueError
    naming the registered backends, or saying which key is wrong."""
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
    """The handler for ``spec.backend``, built from its settings as they are: ``static``'s, the
    in-process one (``--standalone``), or its store kind's (``kind_registry``)."""
    if spec.backend == STATIC_BACKEND:
        return create_static_handler(spec)
    if registered_kind(spec.backend) is None:
        raise ValueError(
            f"unknown rendezvous backend {spec.backend!r}: valid backends are "
            + ", ".join(BACKENDS)
        )
    if spec.backend in C10D_BACKENDS and _standalone(spec):
        return create_standalone_handler(spec)  # its kind's module is not loaded
    return kind_module(spec.backend).create_handler(spec)


def _standalone(spec: RendezvousSpec) -> bool:
    """Whether the job's store is this process's (``core.rendezvous.store_roles``)."""
    endpoints = parse_endpoint_list(spec.endpoint or "127.0.0.1", C10D_DEFAULT_PORT)
    setup = StoreSetup(len(endpoints), endpoints[0][1], spec.max_nodes, spec.settings.is_host)
    return store_roles(setup) == (StoreRole.STANDALONE,)


def create_standalone_handler(spec: RendezvousSpec) -> DynamicRendezvousHandler:
    """``--standalone``: one node on a port nobody knows, so nobody else can join. The same
    rendezvous runs on the store in this process, with no server and no sockets."""
    from relaunch.rendezvous.dynamic import DynamicRendezvousHandler, node_options
    from relaunch.store.memory import MemoryStore

    memory = MemoryStore()
    conf = spec.settings
    return DynamicRendezvousHandler.on_counters(
        spec.run_id,
        memory,
        conf.round_settings(spec.min_nodes, spec.max_nodes),
        parse_endpoint_list(spec.endpoint or "127.0.0.1", C10D_DEFAULT_PORT)[0][0],
        memory,
        watch_store=memory,
        backend=spec.backend,
        **node_options(conf),
    )


def create_static_handler(spec: RendezvousSpec) -> StaticRendezvousHandler:
    """Build the handler for ``static``: this node's rank, and the master at the endpoint."""
    if spec.min_nodes != spec.max_nodes:
        raise ValueError(
            f"--nnodes {spec.min_nodes}:{spec.max_nodes} needs an elastic rendezvous "
            "backend; the static backend takes a fixed number of nodes"
        )
    from relaunch.rendezvous.static import StaticRendezvousHandler  # a fixed set of nodes only

    host, port = parse_endpoint(spec.endpoint, default_port=29500)
    return StaticRendezvousHandler(
        run_id=spec.run_id,
        node_rank=spec.settings.rank or 0,
        nnodes=spec.max_nodes,
        master_addr=host,
        master_port=port,
        resolve_timeout=spec.settings.join_timeout,
    )
