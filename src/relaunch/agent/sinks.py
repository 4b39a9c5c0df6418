"""Where the agent's run events go (``core.run.run_events``): each is announced once, to every sink.

A sink takes what it writes from the run events it knows and ignores the others. The agent's
sinks, in the order they are told: the run report (status events, the summary's restart and
straggler lines: ``agent.report.RunReport``), the Prometheus counters
(``agent.metrics.AgentMetrics``), torchelastic's metric puts (``MetricPuts``), the status
posts (``agent.status.NodeReporter``) and the log (``LogSink``). The order is the order in
which the lines of one run event reach a shared stream (stderr takes the console event and
metric handlers and the log alike).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol

from relaunch.core.run.run_events import (
    EVICTED,
    AttemptEnded,
    RestartCosted,
    Restarted,
    RunEvent,
)
from relaunch.events import Metrics


class Sink(Protocol):
    """Something told of what happens."""

    def on_run_event(self, run_event: RunEvent) -> None: ...


class Sinks:
    """The sinks of one agent, told of each run event in order."""

    def __init__(self, sinks: Iterable[Sink]) -> None:
        self._sinks = tuple(sinks)

    def on_run_event(self, run_event: RunEvent) -> None:
        for sink in self._sinks:
            sink.on_run_event(run_event)


class MetricPuts:
    """torchelastic's metrics through ``relaunch.events.Metrics``: at the end of each attempt,
    the restarts left and the group's state (``workers.<role>.remaining_restarts`` and
    ``workers.<role>.<state>``)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def on_run_event(self, run_event: RunEvent) -> None:
        if isinstance(run_event, AttemptEnded):
            role = run_event.role
            self._metrics.put_metric(f"workers.{role}.remaining_restarts", run_event.restarts_left)
            self._metrics.put_metric(f"workers.{role}.{run_event.state.lower()}", 1)


class LogSink:
    """The agent's log lines for what happens (to ``log``: the agent's own logger)."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log

    def on_run_event(self, run_event: RunEvent) -> None:
        if isinstance(run_event, RestartCosted):
            cost = run_event.cost
            self._log.info(
                "restart %d cost %.2fs: %s",
                cost.restart,
                cost.total,
                ", ".join(f"{cause} {seconds:.2f}s" for cause, seconds in cost.seconds.items()),
            )
        elif isinstance(run_event, Restarted) and run_event.cause == EVICTED:
            # The group re-forms with a spare, on the budget of no restart: say that, not a count
            self._log.warning("[%s] %s; no restart spent", run_event.role, run_event.decision)
        elif isinstance(run_event, Restarted):
            self._log.warning(
                "[%s] restarting the worker group (%s); %d restart(s) left",
                run_event.role,
                run_event.decision,
                run_event.restarts_left,
            )
