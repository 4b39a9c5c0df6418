"""Where the agent's happenings go (``core.happenings``): each is announced once, to every sink.

A sink takes what it writes from the happenings it knows and ignores the others. The agent's
sinks, in the order they are told: the run report (status events, the summary's restart and
straggler lines: ``agent.report.RunReport``), the Prometheus counters
(``agent.metrics.AgentMetrics``), torchelastic's metric puts (``MetricPuts``), the status
posts (``agent.status.NodeReporter``) and the log (``LogSink``). The order is the order in
which the lines of one happening reach a shared stream (stderr takes the console event and
metric handlers and the log alike).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol

from relaunch.core.happenings import AttemptEnded, Happening, RestartCosted, Restarted
from relaunch.events import Metrics


class Sink(Protocol):
    """Something told of what happens."""

    def happened(self, happening: Happening) -> None: ...


class Sinks:
    """The sinks of one agent, told of each happening in order."""

    def __init__(self, sinks: Iterable[Sink]) -> None:
        self._sinks = tuple(sinks)

    def happened(self, happening: Happening) -> None:
        for sink in self._sinks:
            sink.happened(happening)


class MetricPuts:
    """torchelastic's metrics through ``relaunch.events.Metrics``: at the end of each attempt,
    the restarts left and the group's state (``workers.<role>.remaining_restarts`` and
    ``workers.<role>.<state>``)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def happened(self, happening: Happening) -> None:
        if isinstance(happening, AttemptEnded):
            role = happening.role
            self._metrics.put_metric(f"workers.{role}.remaining_restarts", happening.restarts_left)
            self._metrics.put_metric(f"workers.{role}.{happening.state.lower()}", 1)


class LogSink:
    """The agent's log lines for what happens (to ``log``: the agent's own logger)."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log

    def happened(self, happening: Happening) -> None:
        if isinstance(happening, RestartCosted):
            cost = happening.cost
            self._log.info(
                "restart %d cost %.2fs: %s",
                cost.restart,
                cost.total,
                ", ".join(f"{cause} {seconds:.2f}s" for cause, seconds in cost.seconds.items()),
            )
        elif isinstance(happening, Restarted):
            self._log.warning(
                "[%s] restarting the worker group (%s); %d restart(s) left",
                happening.role,
                happening.decision,
                happening.restarts_left,
            )
