"""What the agent tells about a run: status events as it goes, the summary at its end, the
one-line cause of each restart (a sink of the agent's run events: ``agent.sinks``) and the
node's progress bar. The directories logs go to are ``procs.logs_specs``'s."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from relaunch.agent.spec import RunResult, WorkerGroup, WorkerState
from relaunch.core.output.status import printable
from relaunch.core.run.failures import has_error_file, signal_meaning
from relaunch.core.run.goodput import Ledger
from relaunch.core.run.run_events import (
    EVICTED,
    Failed,
    Finished,
    Hung,
    NodeSnapshot,
    RestartCosted,
    Restarted,
    RunEvent,
    Started,
    StragglerFlagged,
    WorkerEnd,
)
from relaunch.core.run.summary import RankEnd, RunSummary
from relaunch.core.workers.progress import NodeProgress, Progress
from relaunch.core.workers.stragglers import SlowNode
from relaunch.events import EventHandler, NullEventHandler
from relaunch.procs.context import RunProcsResult
from relaunch.runtime import SYSTEM_CLOCK, Clock

if TYPE_CHECKING:
    from relaunch.core.run.culprit import Verdict

log = logging.getLogger(__name__)


class RunReport:
    """The record of one agent's run: what its status events and its summary are made of.

    It hears what happens (``on_run_event``: a restart adds to ``restart_reasons``); the agent fills
    in ``last_outcome`` and ``last_progress`` when it stops a group, and ``stop_note`` when a
    stop request ends. ``clock`` times the run and stamps the events.
    """

    def __init__(
        self,
        group: WorkerGroup,
        event_handler: EventHandler,
        log_dir: str,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._group = group
        self._event_handler = event_handler
        self._clock = clock
        self.log_dir = log_dir
        self.started_at = clock.monotonic()
        self.restart_reasons: list[str] = []
        #: The nodes evicted as stragglers, one line each (their restarts spend none).
        self.evictions: list[str] = []
        self.stop_note = ""
        self.last_outcome: RunProcsResult | None = None
        self.last_progress: dict[int, Progress | None] = {}
        #: Every restart's cost (``core.run.goodput``), for the summary.
        self.ledger = Ledger()
        #: Straggler lines for the summary, by node rank (the last said of each node).
        self.stragglers: dict[int, str] = {}
        #: The last hang's verdict, for the summary (``core.run.culprit``).
        self.hang_line = ""

    def on_run_event(self, run_event: RunEvent) -> None:
        """Record what happened: its status event, and its line in the summary."""
        if isinstance(run_event, Started):
            self.group_started(run_event.restart_count, run_event.rendezvous_seconds)
        elif isinstance(run_event, Restarted):
            evicted = run_event.cause == EVICTED
            (self.evictions if evicted else self.restart_reasons).append(run_event.reason)
            self.restarting(run_event.restart_count, run_event.cause, run_event.reason)
            if evicted:
                self.agent_event("EVICTED", run_event.restart_count, run_event.reason)
        elif isinstance(run_event, Hung):
            self.hung(run_event.restart_count, run_event.what)
        elif isinstance(run_event, StragglerFlagged):
            self.straggler(run_event.node, run_event.restart_count)
        elif isinstance(run_event, RestartCosted):
            self.restart_cost(run_event)
        elif isinstance(run_event, Failed):
            self.agent_event(WorkerState.FAILED, run_event.restart_count, run_event.error)
        elif isinstance(run_event, Finished):
            self.run_events(run_event)

    def agent_event(
        self, state: WorkerState | str, restart_count: int, raw_error: str | None = None
    ) -> None:
        self._event("AGENT", state, restart_count, raw_error=raw_error)

    def straggler(self, node: SlowNode, restart_count: int) -> None:
        """A ``STRAGGLER`` worker event (relaunch's) for a node flagged slow (its first rank
        found slow as the event's rank; every one in its details), and its line in the
        summary."""
        self.stragglers[node.node_rank] = printable(node.describe())
        self._event(
            "WORKER",
            "STRAGGLER",
            restart_count,
            global_rank=node.ranks[0],
            details={"straggler": node.as_dict()},
        )

    def restart_cost(self, costed: RestartCosted) -> None:
        """A ``RESTART_COST`` agent event (relaunch's): a restart's seconds lost by cause, and
        its part of the summary's goodput line."""
        cost = costed.cost
        self.ledger.costs.append(cost)
        self._event(
            "AGENT",
            "RESTART_COST",
            cost.restart,
            details={
                "lost_seconds": {cause: round(v, 3) for cause, v in cost.seconds.items()},
                "steps_redone": cost.steps_redone,
            },
        )

    def group_started(self, restart_count: int, rendezvous_seconds: float) -> None:
        """A ``HEALTHY`` agent event: a group of workers started, after a rendezvous that took
        ``rendezvous_seconds``."""
        self._event(
            "AGENT",
            WorkerState.HEALTHY,
            restart_count,
            details={"rendezvous_seconds": round(rendezvous_seconds, 3)},
        )

    def restarting(self, restart_count: int, cause: str, reason: str) -> None:
        """A ``RESTARTING`` agent event (relaunch's): the group stops to start again."""
        self._event(
            "AGENT",
            "RESTARTING",
            restart_count,
            raw_error=reason,
            details={"cause": cause},
        )

    def hung(self, restart_count: int, what: str) -> None:
        """A ``HUNG`` agent event (relaunch's): a local rank missed its section's or heartbeat's
        deadline, or fell silent past ``--hang-timeout``; every rank's stack is being taken."""
        self._event("AGENT", "HUNG", restart_count, raw_error=what)

    def hang_verdict(self, verdict: Verdict, restart_count: int) -> None:
        """A ``CULPRIT`` agent event (relaunch's): who a hang's other ranks waited for, from
        every rank's stack, and its line in the summary."""
        self.hang_line = verdict.line
        self._event(
            "AGENT",
            "CULPRIT",
            restart_count,
            raw_error=verdict.line,
            details={"culprit": {"ranks": list(verdict.culprits), "kind": verdict.kind}},
        )

    def run_events(self, finished: Finished) -> None:
        """One event per worker (how it ended, its last progress), then the agent's."""
        for worker in finished.workers:
            progress = self.last_progress.get(worker.local_rank)
            self._event(
                "WORKER",
                worker.state,
                finished.restart_count,
                global_rank=worker.global_rank,
                worker_id=worker.worker_id,
                raw_error=worker.error,
                local_rank=worker.local_rank,
                role_rank=worker.role_rank,
                role_world_size=worker.role_world_size,
                progress=None
                if progress is None
                else {"step": progress.step, "total": progress.total, "desc": progress.desc},
            )
        self.agent_event(finished.state, finished.restart_count)

    def _event(
        self, source: str, state: WorkerState | str, restart_count: int, **fields: Any
    ) -> None:
        """Record a status event from ``source`` (``"AGENT"`` or ``"WORKER"``); none is built
        for the null handler, which drops it."""
        if type(self._event_handler) is NullEventHandler:
            return
        from relaunch.core.output.status_events import EventSource, status_event

        group = self._group
        spec = group.spec
        # When it happened (torchelastic's own timestamp field stays 0, as torchelastic has it).
        fields["details"] = {"time": round(self._clock.time(), 3), **fields.get("details", {})}
        self._event_handler.record(
            status_event(
                source=EventSource(source),
                state=state,  # status_event takes the enum's value
                run_id=spec.rdzv_handler.get_run_id(),
                role=spec.role,
                hostname=os.uname().nodename,
                rdzv_backend=spec.rdzv_handler.get_backend(),
                group_rank=group.group_rank,
                agent_restarts=restart_count,
                total_run_time=int(self._clock.monotonic() - self.started_at),
                group_world_size=group.group_world_size,
                entry_point=spec.get_entrypoint_name(),
                **fields,
            )
        )

    def summary(self, outcome: str) -> RunSummary:
        """The end-of-run summary of the last attempt, for a run that ended with ``outcome``."""
        result = self.last_outcome
        ranks = []
        for worker in self._group.workers:
            local = worker.local_rank
            exitcode = None if result is None else result.exitcodes.get(local)
            duration = 0.0 if result is None else result.durations.get(local, 0.0)
            stopped = result is not None and local in result.stopped
            stuck = None if result is None else result.stuck.get(local)
            note = "stopped by relaunch" if stopped else ""
            if stuck is not None:
                note = f"did not die of SIGKILL: {stuck}; relaunch went on without it"
            ranks.append(RankEnd(worker.global_rank, local, exitcode, duration, note))
        elapsed = self._clock.monotonic() - self.started_at
        return RunSummary(
            outcome,
            elapsed,
            ranks,
            list(self.restart_reasons),
            self.log_dir if _holds_files(self.log_dir) else "",
            self.stop_note,
            [self.stragglers[rank] for rank in sorted(self.stragglers)],
            self.ledger.line(elapsed) or "",
            self.hang_line,
            list(self.evictions),
        )


def _holds_files(directory: str) -> bool:
    """Whether ``directory`` holds a file, at any depth: a directory of empty attempt and
    rank directories (every stream went to the console) is not worth pointing at."""
    return bool(directory) and any(files for _, _, files in os.walk(directory))


class NodeBar:
    """The per-node bar (a ``Console`` bar source): the slowest local rank's progress in the
    tick's snapshot (``snapshot()``), and under it, on the console of group rank 0 of a job of
    several nodes, ``job_line()``: the job-wide bar (``agent.status``)."""

    def __init__(
        self,
        group: WorkerGroup,
        snapshot: Callable[[], NodeSnapshot],
        job_line: Callable[[], str | None] = lambda: None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._group = group
        self._snapshot = snapshot
        self._job_line = job_line
        self._clock = clock
        self._tracker: NodeProgress | None = None

    def restart(self) -> None:
        """A new group of workers started."""
        self._tracker = NodeProgress(self._clock.time())

    def __call__(self) -> dict[str, bytes]:
        tracker = self._tracker
        if tracker is None:
            return {}
        now = self._clock.time()
        tracker.update(self._snapshot().progresses(), now)
        bars = {}
        line = tracker.line(now)
        group = self._group
        if line is not None:
            bars["node"] = f"[{group.spec.role} node {group.group_rank}]:{line}".encode()
        job = self._job_line()
        if job is not None:
            bars["job"] = f"[{group.spec.role}]:{job}".encode()
        return bars


def finished(group: WorkerGroup, result: RunResult, restart_count: int) -> Finished:
    """The run's end as a run event: how each worker of ``group`` ended in ``result``."""
    ends = []
    for worker in group.workers:
        failure = result.failures.get(worker.global_rank)
        state, error = result.state.value, None
        if failure is not None:
            state = WorkerState.FAILED.value
            error = json.dumps(
                failure.error_file_data
                if has_error_file(failure)
                # no error file: relaunch's words, or what the signal that killed it means
                else {"message": failure.details or signal_meaning(failure.exitcode)}
            )
        elif worker.global_rank in result.stopped:
            state = WorkerState.STOPPED.value
        ends.append(
            WorkerEnd(
                worker.global_rank,
                worker.local_rank,
                worker.role_rank,
                worker.role_world_size,
                None if worker.id is None else str(worker.id),
                state,
                error,
            )
        )
    return Finished(result.state.value, restart_count, tuple(ends))
