"""Restarting in place as an attempt hook: the parking lot (``agent.parking``) where ranks that
restart in place wait, the parks a stop for a failure waits for, and the parked ranks kept and
resumed by the next attempt. Only for workers that are a program (a function's return would be
lost)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

from relaunch.agent.hooks import AttemptHook, Run
from relaunch.agent.user_start import can_keep
from relaunch.core.run.stop_plan import Feature, StopPhase
from relaunch.procs.context import PContext
from relaunch.procs.handles import PopenHandle, ProcessHandle
from relaunch.procs.worker_process import FailureGrace

if TYPE_CHECKING:
    from relaunch.agent.parking import ParkingLot


def attach(run: Run) -> ParkingHook | None:
    return ParkingHook(run) if isinstance(run.group.spec.entrypoint, str) else None


class ParkingHook(AttemptHook):
    """Keeps the ranks that park for the next attempt."""

    def __init__(self, run: Run) -> None:
        self._run = run
        self._lot: ParkingLot | None = None
        #: The ranks kept, by local rank, for the next attempt.
        self._kept: dict[int, PopenHandle | ProcessHandle] = {}

    def open(self, run: Run) -> None:
        from relaunch.agent.parking import ParkingLot, parking_path  # sockets: not at import

        assert run.channel is not None
        self._lot = ParkingLot(
            parking_path(run.channel.path),
            self._keep,
            self._worker_pids,
            self._park_wait,
            serve=False,
        )
        run.open_env.update(self._lot.env())

    def wrap_start(self, run: Run, start: Callable[..., PContext]) -> Callable[..., PContext]:
        assert self._lot is not None
        self._lot.starting()  # the pids of the workers are not known until they are started
        if not self._kept:
            return start
        from relaunch.agent.parking import Parked

        kept, self._kept = self._kept, {}
        lot = self._lot
        return functools.partial(
            start, resumes={rank: Parked(handle, lot) for rank, handle in kept.items()}
        )

    def grace(self, run: Run) -> FailureGrace | None:
        from relaunch.agent.parking import ParkGrace

        assert self._lot is not None and run.pcontext is not None
        return ParkGrace(self._lot, run.pcontext.pids)

    def started(self, run: Run) -> None:
        assert self._lot is not None
        self._lot.serve()
        self._lot.new_attempt()  # the kept ranks have their attempt: a park is explained again

    def features(self) -> Collection[Feature]:
        return (Feature.PARKING,)

    def stop_phases(self, run: Run) -> Mapping[StopPhase, Callable[[], None]]:
        return {
            StopPhase.WAIT_FOR_PARKS: self._wait_for_parks,
            StopPhase.KEEP_PARKED: self._keep_parked,
        }

    def close(self) -> None:
        if self._kept:
            from relaunch.agent.parking import let_go

            for handle in self._kept.values():
                let_go(handle)
            self._kept.clear()
        if self._lot is not None:
            self._lot.close()

    def _keep_parked(self) -> None:
        assert self._run.pcontext is not None
        self._kept = self._run.pcontext.kept()

    def _worker_pids(self) -> set[int]:
        """The pids of this agent's workers now (from the lot's thread): the attempt's running
        ones, and those kept for the next."""
        pcontext = self._run.pcontext
        pids = {handle.pid for handle in list(self._kept.values())}
        if pcontext is not None:
            running = pcontext.running()
            pids.update(pid for rank, pid in pcontext.pids().items() if rank in running)
        return pids

    def _keep(self, pid: int) -> None:
        """The rank of ``pid`` parked, and a stop for a failure is under way: keep it."""
        pcontext = self._run.pcontext
        if pcontext is None:
            return
        for rank, rank_pid in pcontext.pids().items():
            if rank_pid == pid:
                pcontext.keep(rank)

    def _park_wait(self) -> float:
        """How long parks are waited for (``agent.parking.park_wait``): by this attempt's
        slowest rank's step."""
        from relaunch.agent.parking import park_wait

        channel = self._run.channel
        ranks = range(self._run.group.spec.local_world_size)
        slowest = 0.0 if channel is None else max(channel.step_seconds(r) for r in ranks)
        return park_wait(slowest)

    def _wait_for_parks(self) -> None:
        """The job restarts for a failure: keep the ranks that park within ``_park_wait``."""
        pcontext, lot = self._run.pcontext, self._lot
        if pcontext is None or lot is None or not can_keep(pcontext):
            return
        parkable = lot.parkable(pcontext.pids(), pcontext.running())
        if parkable:
            lot.explain()
            lot.wait_parked(parkable.values(), lot.wait())
