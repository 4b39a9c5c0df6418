"""The static rendezvous: every node is told its rank and the number of nodes up front."""

from __future__ import annotations

import logging
import time

from relaunch.core.durations import seconds
from relaunch.endpoints import find_free_port
from relaunch.rendezvous.api import (
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
)
from relaunch.runtime import SYSTEM_CLOCK, Clock

log = logging.getLogger(__name__)

#: Seconds a master address that does not resolve is waited for, on a node of several
#: (``--rdzv-conf join_timeout``, as for the elastic backends): a cluster's DNS may publish
#: the master's name after this node starts (a Kubernetes Service, a PyTorchJob's master).
RESOLVE_TIMEOUT = 600.0


def check_master_addr(host: str, port: int, wait_for: float, clock: Clock = SYSTEM_CLOCK) -> None:
    """Return once ``host`` resolves on this node; ``RendezvousError`` in one line if it does not
    within ``wait_for`` seconds (0: at once), on ``clock``. The first failure is said at once, in
    one line.

    The workers connect to ``MASTER_ADDR``; torch retries an unresolvable one for its whole
    store timeout (30 minutes) with a warning every few seconds, so it is checked here, before
    any worker starts.
    """
    import socket  # here: a single-node launch loads no network code (test_api)

    ends = clock.monotonic() + wait_for
    delay = 0.1
    while True:
        try:
            socket.getaddrinfo(host, port or None, type=socket.SOCK_STREAM)
            return
        except socket.gaierror as exc:
            if clock.monotonic() + delay >= ends:
                waited = f" within {seconds(wait_for)}" if wait_for else ""
                raise RendezvousError(
                    f"--master-addr {host!r} cannot be resolved on this node{waited} "
                    f"({exc.strerror}): give a host name or address of the node with "
                    "--node-rank 0 that every node can resolve"
                ) from None
            if delay == 0.1:
                log.warning(
                    "--master-addr %r cannot be resolved on this node yet (%s): waiting up to %s "
                    "for it to resolve; check the name if it is not a cluster's name to come",
                    host,
                    exc.strerror,
                    seconds(wait_for),
                )
            time.sleep(delay)  # backoff between resolution attempts, bounded by ``ends``
            delay = min(delay * 2, 1.0)


class StaticRendezvousHandler(RendezvousHandler):
    """Fixed membership: ``nnodes`` nodes, this one at ``node_rank``. ``master_port`` 0 picks a
    free port (the single-node ``--standalone`` case). The wait for the master's name to
    resolve keeps its deadline on ``clock``.

    There is no store to share the nodes' workers through: the agent takes every node to run
    as many workers as its own, of one role (torch's ``TORCH_ELASTIC_WORKER_IDENTICAL``)."""

    def __init__(
        self,
        run_id: str,
        node_rank: int,
        nnodes: int,
        master_addr: str,
        master_port: int,
        resolve_timeout: float = RESOLVE_TIMEOUT,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not 0 <= node_rank < nnodes:
            raise ValueError(
                f"--node-rank {node_rank} is outside 0..{nnodes - 1} for --nnodes {nnodes}"
            )
        self._run_id = run_id
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.master_addr = master_addr
        self.master_port = master_port
        self.resolve_timeout = resolve_timeout
        self._clock = clock

    def next_rendezvous(self) -> RendezvousInfo:
        # One node has no master elsewhere whose name may come later: a name that does not
        # resolve is a mistake, said at once.
        check_master_addr(
            self.master_addr,
            self.master_port,
            self.resolve_timeout if self.nnodes > 1 else 0.0,
            self._clock,
        )
        if self.master_port == 0:
            try:
                self.master_port = find_free_port(self.master_addr)
            except OSError as exc:
                raise RendezvousError(
                    f"cannot pick a free port on --master-addr {self.master_addr!r}: "
                    f"{exc.strerror or exc}; with one node, leave --master-addr out or name "
                    "an address of this machine, or give --master-port"
                ) from None
        master = RendezvousStoreInfo(self.master_addr, self.master_port)
        return RendezvousInfo(None, self.node_rank, self.nnodes, master)

    def get_backend(self) -> str:
        return "static"

    def get_run_id(self) -> str:
        return self._run_id
