"""One ``launch_agent`` call, through torch 2.13 or through relaunch, with a rendezvous backend
the user registered torch's way; run as a script by tests/compat/test_compat_launch_agent.py.

``python compat_launch_agent_fns.py SIDE OUTCOME MARK``: SIDE is ``torch`` or ``relaunch`` (the
same program, imports changed), or ``relaunch-c10d`` (relaunch's own c10d backend on one node,
its real handler's ``shutdown()`` counted on the way through). The one worker (``python -c``)
touches the file MARK, then exits 0 (OUTCOME ``succeed``) or sleeps for the test to signal this
process (``wait``). Prints one JSON line: how ``launch_agent`` ended, how often the handler's
``shutdown()`` was called, and ``TORCHELASTIC_SIGNALS_TO_HANDLE`` in ``os.environ`` after it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

#: The backend name this program registers.
BACKEND = "compat-recording"


def worker_args(outcome: str, mark: str) -> list[str]:
    """``python -c`` of a worker that touches ``mark``, then ends or waits to be stopped."""
    then = "" if outcome == "succeed" else "; time.sleep(120)"
    return ["-u", "-c", f"import pathlib, time; pathlib.Path({mark!r}).touch(){then}"]


def main(side: str, outcome: str, mark: str) -> dict[str, Any]:
    if side == "relaunch-c10d":
        return own_c10d(outcome, mark)
    from torch.distributed import HashStore

    if side == "torch":
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.rendezvous import (
            RendezvousHandler,
            RendezvousInfo,
            RendezvousParameters,
            RendezvousStoreInfo,
            rendezvous_handler_registry,
        )
        from torch.distributed.launcher.api import LaunchConfig, launch_agent
    else:
        from relaunch.launcher import LaunchConfig, launch_agent
        from relaunch.procs.errors import SignalException
        from relaunch.rendezvous import (
            RendezvousHandler,
            RendezvousInfo,
            RendezvousParameters,
            RendezvousStoreInfo,
            rendezvous_handler_registry,
        )

    shutdowns: list[str] = []

    class RecordingHandler(RendezvousHandler):  # type: ignore[misc, valid-type]
        """One node; records each ``shutdown()`` (a real one closes the rendezvous for good)."""

        def __init__(self, params: RendezvousParameters) -> None:
            self._params = params
            self._store = HashStore()

        def next_rendezvous(self) -> RendezvousInfo:
            return RendezvousInfo(self._store, 0, 1, RendezvousStoreInfo("127.0.0.1", 29500))

        def get_backend(self) -> str:
            return BACKEND

        def get_run_id(self) -> str:
            return str(self._params.run_id)

        def is_closed(self) -> bool:
            return False

        def set_closed(self) -> None:
            pass

        def num_nodes_waiting(self) -> int:
            return 0

        def shutdown(self) -> bool:
            shutdowns.append("shutdown")
            return True

    rendezvous_handler_registry.register(BACKEND, RecordingHandler)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=1,
        run_id="recording",
        rdzv_backend=BACKEND,
        rdzv_endpoint="127.0.0.1:29500",
        max_restarts=0,
        monitor_interval=0.05,
    )
    run = partial(launch_agent, config, sys.executable, worker_args(outcome, mark))
    return ending(run, SignalException, shutdowns)


def own_c10d(outcome: str, mark: str) -> dict[str, Any]:
    """relaunch's c10d backend on one node: its real handler, each ``shutdown()`` counted."""
    from relaunch.launcher import LaunchConfig, launch_agent, rendezvous_handler
    from relaunch.procs.errors import SignalException

    config = LaunchConfig(1, 1, 1, rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0)
    handler = rendezvous_handler(config)
    shutdowns: list[str] = []
    real_shutdown = handler.shutdown

    def shutdown() -> bool:
        shutdowns.append("shutdown")
        return real_shutdown()

    handler.shutdown = shutdown  # type: ignore[method-assign]
    run = partial(launch_agent, config, sys.executable, worker_args(outcome, mark), handler=handler)
    return ending(run, SignalException, shutdowns)


def ending(
    run: Callable[[], object], signal_exception: type[Exception], shutdowns: list[str]
) -> dict[str, Any]:
    """How ``run()`` (a ``launch_agent`` call) ended, and what it left."""
    ended = "returned"
    try:
        run()
    except signal_exception as exc:
        ended = f"SignalException({exc.sigval.name})"  # type: ignore[attr-defined]
    return {
        "ended": ended,
        "shutdowns": len(shutdowns),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE"),
    }


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])), flush=True)
