"""Prometheus metrics of one agent (``--metrics-port [ADDR:]PORT``): the values it serves,
through ``agent.metrics_server``.

The agent's run events are counted as they come (a sink: ``on_run_event``: restarts by cause,
rendezvous rounds and their durations); the rest is read when Prometheus scrapes, from what the
agent already keeps: its group's state, the tick's ``NodeSnapshot`` (each rank's steps, signs
of life and process state: ``agent.sampler``), the ``NodeReporter``'s rates and the last job
view it saw (the ranks flagged stragglers), and the time its last status write to the store
took. A scrape never touches the store, and adds no load to it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from relaunch.agent.spec import WorkerGroup, WorkerState
from relaunch.agent.status import NodeReporter
from relaunch.core.output import metrics as core
from relaunch.core.output.status import RankStatus
from relaunch.core.run.goodput import CAUSES, Ledger
from relaunch.core.run.run_events import Joined, NodeSnapshot, RestartCosted, Restarted, RunEvent
from relaunch.runtime import SYSTEM_CLOCK, Clock

if TYPE_CHECKING:
    from relaunch.agent.metrics_server import MetricsServer


class AgentMetrics:
    """The values one agent serves: counters it is told of, and probes read at each scrape
    (``snapshot()``: the tick's view of the ranks; ``clock``: when a scrape happens)."""

    def __init__(
        self,
        group: WorkerGroup,
        reporter: NodeReporter,
        snapshot: Callable[[], NodeSnapshot],
        restarts_used: Callable[[], int],
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._group = group
        self._reporter = reporter
        self._snapshot = snapshot
        self._restarts_used = restarts_used
        self._clock = clock
        self._lock = threading.Lock()
        self._ledger = Ledger()
        self._started = clock.monotonic()
        self._restarts = dict.fromkeys(core.RESTART_CAUSES, 0)
        self._rounds = 0
        self._durations = core.Histogram()
        self._server: MetricsServer | None = None

    # -- what the agent tells --------------------------------------------------------------------

    def on_run_event(self, run_event: RunEvent) -> None:
        """A sink of the agent's run events: restarts and joins are counted."""
        if isinstance(run_event, Restarted):
            self.restarted(run_event.cause)
        elif isinstance(run_event, Joined):
            self.joined(run_event.seconds)
        elif isinstance(run_event, RestartCosted):
            with self._lock:
                self._ledger.costs.append(run_event.cost)

    def restarted(self, cause: str) -> None:
        """The group restarts, for ``cause`` (one of ``core.output.metrics.RESTART_CAUSES``)."""
        with self._lock:
            self._restarts[cause or "unknown"] = self._restarts.get(cause or "unknown", 0) + 1

    def joined(self, seconds: float) -> None:
        """The agent joined a rendezvous round, after ``seconds``."""
        with self._lock:
            self._rounds += 1
            self._durations.observe(seconds)

    # -- serving ---------------------------------------------------------------------------------

    def bind(self, host: str, port: int) -> int:
        """Bind the server to ``host:port`` (host "": every interface; port 0: a free one) and
        return the port; ``ConfigError`` when that cannot be. Serving starts with ``start``."""
        from relaunch.agent.metrics_server import MetricsServer  # only with --metrics-port

        self._server = MetricsServer(host, port, self.render, self._clock)
        return self._server.port

    def start(self) -> None:
        if self._server is not None:
            self._server.start()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    # -- a scrape --------------------------------------------------------------------------------

    def render(self) -> bytes:
        """The exposition of the values now."""
        return core.exposition(self.families(self._clock.time())).encode()

    def _rank_families(
        self, base: core.Labels, now: float
    ) -> tuple[core.Family, list[core.Family]]:
        """The ranks' states, and their gauges (``core.RANK_GAUGES``), from one snapshot."""
        snapshot = self._snapshot()
        status = self._reporter.status(snapshot)
        view = self._reporter.view
        slow = set() if view is None else view.slow_ranks()
        ranks = [] if status is None else status.ranks
        group_rank = self._group.group_rank
        at = str(group_rank if group_rank is not None else "")

        def labels(rank: RankStatus) -> core.Labels:
            where = (("rank", str(rank.rank)), ("local_rank", str(rank.local_rank)))
            return (*base, ("group_rank", at), *where)

        def per_rank(value: core.RankValue) -> list[core.Sample]:
            got = [
                (rank, value(rank, snapshot.rank(rank.local_rank), rank.rank in slow, now))
                for rank in ranks
            ]
            return [core.Sample(labels(rank), v) for rank, v in got if v is not None]

        worker_states = [
            sample
            for rank in ranks
            for sample in core.enum_samples(
                labels(rank), core.WORKER_STATES, snapshot.rank(rank.local_rank).outcome
            )
        ]
        gauges = [
            core.Family(name, per_rank(value)) for name, (_, value) in core.RANK_GAUGES.items()
        ]
        return core.Family("relaunch_worker_state", worker_states), gauges

    def families(self, now: float) -> list[core.Family]:
        """Every metric of ``core.output.metrics.CATALOGUE``, sampled at ``now`` (``time.time()``),
        from one snapshot of the ranks."""
        group, spec = self._group, self._group.spec
        handler = spec.rdzv_handler
        node = getattr(handler, "identity", "") or os.uname().nodename
        base: core.Labels = (("run_id", handler.get_run_id()), ("node", node))
        with self._lock:
            restarts = dict(self._restarts)
            rounds = self._rounds
            durations = self._durations.samples(base)
            lost = self._ledger.totals()
            ratio = self._ledger.effective_ratio(self._clock.monotonic() - self._started)
        worker_states, rank_gauges = self._rank_families(base, now)
        info = (*base, ("role", spec.role), ("backend", handler.get_backend()))
        rtt = self._reporter.store_round_trip
        return [
            core.Family("relaunch_agent_info", [core.Sample(info, 1)]),
            core.Family(
                "relaunch_group_state",
                core.enum_samples(base, [s.value for s in WorkerState], group.state.value),
            ),
            core.Family(
                "relaunch_group_rank",
                [] if group.group_rank is None else [core.Sample(base, group.group_rank)],
            ),
            core.Family(
                "relaunch_group_world_size",
                []
                if group.group_world_size is None
                else [core.Sample(base, group.group_world_size)],
            ),
            worker_states,
            core.Family(
                "relaunch_group_restarts_total",
                [core.Sample((*base, ("cause", c)), n) for c, n in restarts.items()],
            ),
            core.Family("relaunch_restarts_used", [core.Sample(base, self._restarts_used())]),
            core.Family("relaunch_max_restarts", [core.Sample(base, spec.max_restarts)]),
            core.Family("relaunch_rendezvous_rounds_total", [core.Sample(base, rounds)]),
            core.Family("relaunch_rendezvous_duration_seconds", durations),
            *rank_gauges,
            core.Family(
                "relaunch_store_round_trip_seconds",
                [] if rtt is None else [core.Sample(base, rtt)],
            ),
            core.Family(
                "relaunch_restart_lost_seconds_total",
                [core.Sample((*base, ("cause", cause)), lost[cause]) for cause in CAUSES],
            ),
            core.Family("relaunch_goodput_ratio", [core.Sample(base, ratio)]),
        ]
