"""Expiry timers and hang detection (``agent.expiry.ExpiryWatch``) as an attempt hook: what
every worker gets for them, each attempt's workers watched, and ranks asked for their stacks
given the time to write them before a stop's signal."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from relaunch.agent.hooks import AttemptHook, Run
from relaunch.core.run.stop_plan import StopPhase


class ExpiryHook(AttemptHook):
    """Watches each attempt's workers for expired timers and hangs."""

    def __init__(self, run: Run) -> None:
        self._expiry = run.expiry

    def environment(self, run: Run) -> Mapping[str, str]:
        return self._expiry.worker_env()

    def started(self, run: Run) -> None:
        pcontext = run.pcontext
        assert pcontext is not None
        pids = pcontext.pids()
        stdouts, stderrs = pcontext.stdouts, pcontext.stderrs
        log_files = {
            rank: [path for path in (stdouts.get(rank), stderrs.get(rank)) if path] for rank in pids
        }
        self._expiry.watch(
            pids, log_files, run.sampler.take, pcontext.hold_group_stop, run.save_just_in_time
        )

    def stop_phases(self, run: Run) -> Mapping[StopPhase, Callable[[], None]]:
        return {StopPhase.WAIT_FOR_STACKS: lambda: self._wait_for_stacks(run)}

    def _wait_for_stacks(self, run: Run) -> None:
        """Ranks asked for their stacks: let them write them before the signal."""
        dumping = self._expiry.dumping()
        if dumping and run.pcontext is not None:
            run.pcontext.wait(dumping)
