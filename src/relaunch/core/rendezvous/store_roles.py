"""Which part a node takes in serving the job's built-in store (``rendezvous.kinds_c10d``).

A node runs the store in its own process (standalone), hosts it at the endpoint, serves a
standby of it at another endpoint (``rendezvous.failover``), or only follows it: a client of
the store another node serves. Binding an address may fail, so the choice is the roles to try,
in order; the node takes the first that works.
"""

from __future__ import annotations

import enum

from relaunch.core.value import Value


class StoreRole(enum.Enum):
    """One part a node may take in serving the job's store."""

    #: The store in this process, with no server and no sockets: one node on a port nobody
    #: knows (``--standalone``), so nobody else can join.
    STANDALONE = "standalone"
    #: Serve the store at the first endpoint (binding it may fail: another node serves it).
    HOST = "host"
    #: Serve a standby of the store at another endpoint this node can bind.
    STANDBY = "standby"
    #: Serve nothing: a client of the store another node hosts.
    FOLLOWER = "follower"


class StoreSetup(Value):
    """What the choice depends on. ``endpoints``: how many ``--rdzv-endpoint`` lists (more than
    one: the store may move among them); ``port``: the first one's (0: any free port);
    ``max_nodes``: the job's most nodes; ``is_host``: ``--rdzv-conf is_host`` (True: this node
    must host, False: never, None: if it can bind the endpoint); ``serving_elsewhere``: a store
    of the job already serves at one of the endpoints."""

    __slots__ = ("endpoints", "is_host", "max_nodes", "port", "serving_elsewhere")

    endpoints: int
    port: int
    max_nodes: int
    is_host: bool | None
    serving_elsewhere: bool

    def __init__(
        self,
        endpoints: int,
        port: int,
        max_nodes: int,
        is_host: bool | None,
        serving_elsewhere: bool = False,
    ) -> None:
        self._set(
            endpoints=endpoints,
            port=port,
            max_nodes=max_nodes,
            is_host=is_host,
            serving_elsewhere=serving_elsewhere,
        )


def store_roles(setup: StoreSetup) -> tuple[StoreRole, ...]:
    """The roles to try, in order: each but the last binds an address, and when it cannot the
    next is tried; when the last is ``HOST`` and its bind fails, the node cannot join (it was
    told to host). ``STANDALONE`` and ``FOLLOWER`` always work."""
    if setup.is_host is False:
        return (StoreRole.FOLLOWER,)
    if setup.port == 0 and setup.max_nodes == 1 and setup.endpoints == 1:
        return (StoreRole.STANDALONE,)
    may_move = setup.endpoints > 1
    if not setup.serving_elsewhere:
        if setup.is_host:
            return (StoreRole.HOST,)
        if not may_move:
            return (StoreRole.HOST, StoreRole.FOLLOWER)
        return (StoreRole.HOST, StoreRole.STANDBY, StoreRole.FOLLOWER)
    if may_move:
        return (StoreRole.STANDBY, StoreRole.FOLLOWER)
    return (StoreRole.FOLLOWER,)
