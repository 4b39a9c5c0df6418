"""How the agent judges a failed attempt: its cause in one line (named a start-up failure when
the worker had said nothing yet), and the crash loop it belongs to (``core.restart``: backoff,
and a stop after restarts that made no progress), from what the workers said in the channel."""

from __future__ import annotations

import time

from relaunch.agent.channel import Channel
from relaunch.agent.spec import WorkerGroup
from relaunch.core.failures import one_line, root_cause_rank
from relaunch.core.restart import Backoff, CrashLoop, Mark, stalled_out, startup_failure
from relaunch.procs.context import RunProcsResult


class Attempts:
    """The attempts of one agent's run: ``started`` at each, ``cause`` and ``failed`` when one
    fails."""

    def __init__(self, backoff: Backoff, max_stalled: int) -> None:
        self.backoff = backoff
        self._max_stalled = max_stalled
        self.loop = CrashLoop()
        self._started = time.monotonic()
        self._workers_spoke = False  # some rank used the channel, in any attempt

    def started(self) -> None:
        self._started = time.monotonic()

    def cause(self, group: WorkerGroup, outcome: RunProcsResult, channel: Channel) -> str:
        """The root cause of a failed attempt in one line."""
        failures = group.by_global_rank(outcome.failures)
        rank = root_cause_rank(failures)
        line = one_line(rank, failures[rank])
        local = next((w.local_rank for w in group.workers if w.global_rank == rank), 0)
        spoke = [
            channel.progress(r) is not None or (live is not None and live.used)
            for r in range(channel.slots)
            for live in (channel.liveness(r),)
        ]
        self._workers_spoke = self._workers_spoke or any(spoke)
        if startup_failure(spoke[local], self._workers_spoke):
            ran_for = time.monotonic() - self._started
            return f"during start-up ({ran_for:.1f}s after it started): {line}"
        return line

    def failed(self, channel: Channel) -> tuple[str | None, float]:
        """Count a failed attempt in the crash loop: why the job stops for want of progress
        (None: it goes on), and the seconds to wait before the restart."""
        steps, signs = [], 0
        for rank in range(channel.slots):
            progress = channel.progress(rank)
            if progress is not None:
                steps.append(progress.step)
            live = channel.liveness(rank)
            if live is not None:
                signs += live.sections_done + live.beats
        ran_for = time.monotonic() - self._started
        self.loop = self.loop.after_failure(
            ran_for, Mark(max(steps, default=None), signs), self.backoff
        )
        return stalled_out(self.loop, self._max_stalled), self.backoff.delay(self.loop.in_a_row)
