"""Kept state (``--state``) as an attempt hook: the ``StateKeeper`` of the run, the step every
node's workers resume from, and the just-in-time save before running workers are stopped."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping

from relaunch.agent.hooks import AttemptHook, Run
from relaunch.agent.state import JustInTime, StateKeeper
from relaunch.core.durations import seconds
from relaunch.core.run.stop_plan import Feature, StopPhase
from relaunch.procs.worker_process import FailureGrace

log = logging.getLogger("relaunch.agent.workers")


def attach(run: Run) -> KeptStateHook | None:
    return None if run.state_settings is None else KeptStateHook()


class KeptStateHook(AttemptHook):
    """Keeps the workers' ``save_state`` (``agent.state``)."""

    def __init__(self) -> None:
        self._state: StateKeeper | None = None
        self._run: Run | None = None
        self._told = False  # this attempt's workers were told of a failure

    def open(self, run: Run) -> None:
        assert run.state_settings is not None
        self._run = run
        assert run.channel is not None
        settings, job = run.state_settings, run.job
        self._state = state = StateKeeper(settings, job.local_addr, job.peer_key, run.channel)
        run.save_just_in_time = self._save_just_in_time
        run.saved_step = state.newest_saved_step

    def starting(self, run: Run) -> None:
        self._told = False

    def environment(self, run: Run) -> Mapping[str, str]:
        """The step the attempt's workers resume from (``load_state``), agreed by every node."""
        group, state = run.group, self._state
        assert state is not None and group.group_rank is not None
        assert group.group_world_size is not None
        step = state.agree(
            run.job,
            group.group_rank,
            group.group_world_size,
            {worker.local_rank: worker.global_rank for worker in group.workers},
            group.workers[0].world_size if group.workers else 0,
        )
        return state.env(step)

    def grace(self, run: Run) -> FailureGrace | None:
        assert self._state is not None and run.channel is not None
        return JustInTime(self._state, run.channel, self._state.jit_save_timeout)

    def worker_failed(self) -> None:
        assert self._state is not None
        self._state.hold_copies()  # the CPU is the restart's now, not a copy's

    def started(self, run: Run) -> None:
        assert self._state is not None
        self._state.prune()

    def features(self) -> Collection[Feature]:
        return (Feature.KEPT_STATE,)

    def stop_phases(self, run: Run) -> Mapping[StopPhase, Callable[[], None]]:
        assert self._state is not None
        return {
            StopPhase.SAVE_JUST_IN_TIME: self._save_just_in_time,
            StopPhase.HOLD_COPIES: self._state.hold_copies,
        }

    def close(self) -> None:
        if self._state is not None:
            self._state.close()

    def _save_just_in_time(self, hung: Collection[int] = ()) -> None:
        """Before running workers are stopped because another node's failed, or asked for
        their stacks because a rank (``hung``, here) is hung: tell them (``failure_pending``)
        and give those that listen, ``hung`` aside, up to ``--jit-save-timeout`` seconds to
        ``save_state``; once an attempt. (A failure of this node's own workers is told from
        the monitor: ``agent.state.JustInTime``.)"""
        run, state = self._run, self._state
        if run is None or state is None or not state.jit_save_timeout or self._told:
            return
        channel, pcontext = run.channel, run.pcontext
        if channel is None or pcontext is None:
            return
        self._told = True
        listening = channel.failure_listeners(set(pcontext.running()) - set(hung))
        if not listening:
            return
        missing = state.wait_for_saves(
            listening, pcontext.running, state.jit_save_timeout, channel.announce_failure
        )
        if missing:
            log.warning(
                "local rank(s) %s did not save within --jit-save-timeout %s of the failure notice",
                ",".join(map(str, sorted(missing))),
                seconds(state.jit_save_timeout),
            )
