"""The agent's marks of each restart's moments, for the goodput ledger (``core.run.goodput``): when
the failure happened and was seen, when the old group was gone, how long admission and the join
took, when the new workers started, and when they were back (``load_state`` in the channel, or
a first progress report)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from relaunch.agent.channel import Channel
from relaunch.core.run.goodput import RestartCost, RestartMarks, Restored, cost_of
from relaunch.core.run.run_events import Joined, RunEvent, Started
from relaunch.core.workers.progress import Progress
from relaunch.procs.context import PContext
from relaunch.runtime import Clock


class GoodputMarks:
    """One run's restarts as they happen; ``on_cost`` hears each restart's cost once the
    workers are back (the sinks keep the ledger: the summary, the metrics, the events).

    A sink itself (``agent.sinks``): a join and a start are the ``Joined`` and ``Started``
    run events; the agent tells it the rest (a failure seen, an attempt over, a look at the
    workers, the end)."""

    def __init__(self, clock: Clock, on_cost: Callable[[RestartCost], None]) -> None:
        self._costs = 0  # restarts costed so far
        self._clock = clock
        self._on_cost = on_cost
        self._pending: RestartMarks | None = None
        self._seen_at = 0.0  # when a failure or a change was first seen, this attempt
        self._started = False  # the pending restart's workers started

    def on_run_event(self, run_event: RunEvent) -> None:
        if isinstance(run_event, Joined):
            self.joined(run_event.seconds)
        elif isinstance(run_event, Started):
            self.started()

    def seen(self) -> None:
        """The agent saw the attempt fail or the membership change (the first sight counts)."""
        if not self._seen_at:
            self._seen_at = self._clock.time()

    def leaving(
        self,
        exit_times: Mapping[int, float],
        failed: Mapping[int, object],
        last_progress: Mapping[int, Progress | None],
        step_seconds: float,
        saved_step: int | None = None,
        hung_since: Mapping[int, float] | None = None,
    ) -> None:
        """The attempt is over and the node is about to join the next round: ``exit_times``
        by local rank, ``failed`` its failed local ranks, ``last_progress`` what they reported
        last, ``step_seconds`` the time a step took, ``saved_step`` the newest step they kept
        with ``save_state`` (the furthest step reached, when they report no progress),
        ``hung_since`` the hung local ranks and when each last made progress (its hang's
        time is lost: the failure began there, not at the exit that ended it)."""
        now = self._clock.time()
        failed_at = min(
            [exit_times[rank] for rank in failed if exit_times.get(rank)]
            + [since for since in (hung_since or {}).values() if since],
            default=0,
        )
        # The agent knows when its loop saw the failure: later than the exit where the exit's
        # status came late (a lost zygote's worker).
        noticed = max(failed_at, self._seen_at) or now
        steps = [p.step for p in last_progress.values() if p is not None]
        self._pending = RestartMarks(
            restart=self._costs + 1,
            failed_at=failed_at or noticed,
            noticed_at=noticed,
            stopped_at=max([noticed, *exit_times.values()]),
            last_step=max(steps) if steps else saved_step,
            step_seconds=step_seconds,
        )
        self._seen_at = 0.0
        self._started = False

    def attempt_over(
        self,
        pcontext: PContext,
        channel: Channel,
        ranks: int,
        last_progress: Mapping[int, Progress | None],
        saved_step: int | None,
        hung_since: Mapping[int, float],
    ) -> None:
        """The attempt of ``pcontext`` (``ranks`` local ranks, with ``channel``) is over
        (``leaving``): when its workers exited and failed, and the time a step took."""
        outcome = pcontext.wait(0)
        failed = {} if outcome is None else outcome.failures
        seconds_a_step = max((channel.step_seconds(rank) for rank in range(ranks)), default=0.0)
        self.leaving(
            pcontext.exit_times(), failed, last_progress, seconds_a_step, saved_step, hung_since
        )

    def joined(self, rendezvous_seconds: float) -> None:
        """The node got its place in the next round, after a join of ``rendezvous_seconds``."""
        pending = self._pending
        if pending is not None:
            pending.join_ended_at = self._clock.time()
            pending.join_began_at = pending.join_ended_at - rendezvous_seconds

    def started(self) -> None:
        """The new workers started."""
        pending = self._pending
        if pending is not None:
            self._started = True
            if pending.last_step is None:  # no progress, no state: no way to see them back
                now = self._clock.time()
                self._close(Restored(now, now, None), now)

    def look(self, channel: Channel, ranks: int) -> None:
        """Close the pending restart once every rank restored its state, or one reported
        progress without keeping state."""
        if self._pending is None or not self._started:
            return
        restores = [channel.restore(rank) for rank in range(ranks)]
        if all(restore is not None for restore in restores):
            began = max(restore[0] for restore in restores if restore is not None)
            ended = max(restore[1] for restore in restores if restore is not None)
            steps = [restore[2] for restore in restores if restore is not None]
            step = None if min(steps) < 0 else min(steps)
            self._close(Restored(began, ended, step), ended)
            return
        if any(restore is not None for restore in restores):
            return  # the others are still restoring
        firsts = [p.time for p in map(channel.progress, range(ranks)) if p is not None]
        if firsts:
            self._close(Restored(min(firsts), min(firsts), None), min(firsts))

    def end(self) -> None:
        """The run ended: a restart whose workers never came back costs what was left."""
        if self._pending is not None and self._started:
            self._close(None, self._clock.time())
        self._pending = None

    def _close(self, restored: Restored | None, at: float) -> None:
        assert self._pending is not None
        cost = cost_of(self._pending, restored, at)
        self._pending = None
        self._costs += 1
        self._on_cost(cost)
