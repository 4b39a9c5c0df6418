"""torch's store served by the agent, as torchrun's agent serves it
(``TORCHELASTIC_USE_AGENT_STORE=True``), for every job and without torch: while this node is
group rank 0, a server of torch's ``TCPStore`` wire protocol (``store.torch_wire``) answers at
``MASTER_ADDR:MASTER_PORT``.

Workers that connect as clients only (torchft's ``Manager``, code written for torchrun) find a
store there; a rank that asks before rank 0's ``init_process_group`` is never refused. The port
is bound and listened on as the attempt starts (``starting``, before the state record lets the
other nodes start their workers), and served on one thread once this node's workers started
(``started``: the server's imports are off their way; a rank that connects first waits in the
listener's backlog); each attempt has a new, empty store, stopped with the attempt's workers
(the port is free again for the next). A port that cannot be bound is said once, and worker
rank 0 serves the store instead (``TORCHELASTIC_USE_AGENT_STORE=False``), as torch does without
an agent's store.
"""

from __future__ import annotations

import logging
import os
import resource
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

from relaunch.agent.hooks import AttemptHook, Run
from relaunch.core.run.stop_plan import Feature, StopPhase
from relaunch.endpoints import is_loopback
from relaunch.runtime import raise_open_file_limit
from relaunch.server_loop import adopt, bind_tcp

if TYPE_CHECKING:
    from relaunch.store.torch_wire import TorchWireServer

log = logging.getLogger("relaunch.agent.workers")

#: Connections a server holds at the least, whatever the job's size.
MIN_CONNECTIONS = 1024
#: Connections a rank may open to the store: its own client and the clones torch and torchft
#: make of it (a process group's, a manager's).
CONNECTIONS_PER_RANK = 4


def attach(run: Run) -> TorchStoreHook:
    return TorchStoreHook()


class TorchStoreHook(AttemptHook):
    """Serves torch's store for each attempt while this node is group rank 0."""

    def __init__(self) -> None:
        self._server: TorchWireServer | None = None
        #: The port's listening descriptor, bound for the attempt and not served yet, and the
        #: connections its server will hold.
        self._bound: int | None = None
        self._max_connections = MIN_CONNECTIONS
        self._unbound_said = False

    def starting(self, run: Run) -> None:
        self._stop()
        group = run.group
        run.agent_store = True  # rank 0's agent serves it (where it cannot, it says so)
        if group.group_rank != 0:
            return
        assert group.master_addr is not None and group.master_port is not None
        host = group.master_addr if is_loopback(group.master_addr) else None
        bound, why = bind_tcp(group.master_port, host)  # one node's on loopback only
        if bound is None:
            run.agent_store = False
            if not self._unbound_said:
                self._unbound_said = True
                log.warning(
                    "cannot serve torch's store on port %d (%s): worker rank 0 serves it "
                    "(TORCHELASTIC_USE_AGENT_STORE=False)",
                    group.master_port,
                    why,
                )
            return
        ranks = (group.group_world_size or 1) * group.spec.local_world_size
        self._bound, self._max_connections = bound, max_connections(ranks)  # before the workers

    def started(self, run: Run) -> None:
        bound, self._bound = self._bound, None
        if bound is not None:
            from relaunch.store.torch_wire import TorchWireServer  # sockets: once served

            self._server = TorchWireServer(adopt(bound), self._max_connections).start()

    def features(self) -> Collection[Feature]:
        return (Feature.TORCH_STORE,)

    def stop_phases(self, run: Run) -> Mapping[StopPhase, Callable[[], None]]:
        return {StopPhase.STOP_TORCH_STORE: self._stop}

    def note(self) -> str | None:
        """Why the ranks lost torch's store, when the agent's server of it ended first."""
        server = self._server
        if server is None or server.running():
            return None
        return (
            "torch's store, served by this agent, ended during the attempt (its error above): "
            "every rank's call to the store failed from then on (the next attempt has a new one)"
        )

    def close(self) -> None:
        self._stop()

    def _stop(self) -> None:
        bound, self._bound = self._bound, None
        if bound is not None:  # the workers never started
            os.close(bound)
        server, self._server = self._server, None
        if server is not None:
            server.stop()


def max_connections(ranks: int) -> int:
    """How many connections the store holds for a job of ``ranks`` ranks: room for each rank's
    clients, within half the open-file limit. The limit is raised (to the hard one) only where
    the ranks need it: the workers inherit it."""
    needed = CONNECTIONS_PER_RANK * ranks
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft // 2 < needed:
        soft, _ = raise_open_file_limit(2 * needed)
    wanted = max(MIN_CONNECTIONS, needed)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(64, min(wanted, soft // 2))
