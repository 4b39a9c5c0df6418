"""The progress reporter and the node bar as an attempt hook: each attempt's status posts
(``agent.status.NodeReporter``) and bar on the console (``agent.report.NodeBar``), and the
last outcome and progress of a stopped attempt, for the summary."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from relaunch.agent.hooks import AttemptHook, Run
from relaunch.agent.report import NodeBar
from relaunch.agent.status import Group
from relaunch.core.run.stop_plan import StopPhase


class ProgressHook(AttemptHook):
    """Posts the attempt's progress and draws its node bar."""

    def __init__(self, run: Run) -> None:
        self._bar = NodeBar(run.group, run.sampler.latest, lambda: run.reporter.job_line, run.clock)
        self._console = run.console

    def started(self, run: Run) -> None:
        self._bar.restart()
        if run.draws_console:
            self._console.add_source(self._bar)
        group, spec = run.group, run.group.spec
        assert group.group_rank is not None and group.group_world_size is not None
        run.reporter.start(
            Group(
                getattr(spec.rdzv_handler, "identity", "") or os.uname().nodename,
                group.group_rank,
                group.group_world_size,
                {worker.local_rank: worker.global_rank for worker in group.workers},
                run.sampler.latest,
            ),
            run.job,
        )

    def stop_phases(self, run: Run) -> Mapping[StopPhase, Callable[[], None]]:
        return {
            StopPhase.STOP_POSTS: run.reporter.stop,
            StopPhase.RECORD_OUTCOME: lambda: _record_outcome(run),
            StopPhase.FINAL_BAR: self.close,  # prints the bar's final state
        }

    def close(self) -> None:
        self._console.remove_source(self._bar)


def _record_outcome(run: Run) -> None:
    """How the stopped attempt ended, and what its ranks reported last, for the summary."""
    assert run.pcontext is not None
    run.report.last_outcome = run.pcontext.wait(0)
    run.sampler.observed(run.report.last_outcome)
    if run.channel is not None:
        run.report.last_progress = run.sampler.take().progresses()
