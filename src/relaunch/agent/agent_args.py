"""``LocalElasticAgent``'s arguments: its two forms of call (torch 2.13's and the seeds'), and
what a spec asks of the agent when the caller gives nothing (its events' destination, its
workers' placement)."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from relaunch.agent.spec import WorkerSpec
from relaunch.core.defaults import DEFAULT_EXIT_BARRIER_TIMEOUT, numa_binding_of
from relaunch.core.value import Value
from relaunch.core.workers.call_forms import CallForm, choose
from relaunch.core.workers.logs_specs import LogsSpecs, is_logs_specs
from relaunch.core.workers.streams import per_rank
from relaunch.events import EventHandler, NullEventHandler, record
from relaunch.procs.logs_specs import DefaultLogsSpecs

if TYPE_CHECKING:
    from relaunch.core.output.status_events import Event
    from relaunch.core.workers.placement import Placement


#: ``LocalElasticAgent``'s two forms, from its 2nd parameter on: torch 2.13's and the seeds'.
TORCH_CALL = CallForm(
    "torch 2.13's",
    (
        "logs_specs",
        "start_method",
        "exit_barrier_timeout",
        "log_line_prefix_template",
        "shutdown_timeout",
        "health_check_server",
        "uninterruptible_state_timeout",
    ),
    frozenset(),
    "give log_dir to DefaultLogsSpecs(log_dir, redirects, tee), and events as event_handler=",
)
SEEDS_CALL = CallForm(
    "the seeds'",
    ("start_method", "exit_barrier_timeout", "log_dir", "events"),
    frozenset({"log_line_prefix_template"}),
    "pass logs_specs=DefaultLogsSpecs(log_dir, spec.redirects, spec.tee) in place of log_dir",
)


class RecordTo:
    """Events to ``relaunch.events.record(event, destination)``: where the agent's events go
    when it is given no event handler, as torch's agent sends them to its spec's
    ``event_log_handler``."""

    def __init__(self, destination: str) -> None:
        from relaunch.events.handlers import get_logging_handler

        get_logging_handler(destination)  # an unknown destination: say so before the run
        self.destination = destination

    def record(self, event: Event) -> None:
        record(event, self.destination)

    def close(self) -> None:
        pass


def events_of(spec: WorkerSpec) -> EventHandler:
    """Where the events of an agent given no event handler go: ``spec.event_log_handler``."""
    if spec.event_log_handler == "null":
        return NullEventHandler()
    return RecordTo(spec.event_log_handler)


class AgentArguments(Value):
    """``LocalElasticAgent``'s arguments past its spec, read in either form."""

    __slots__ = (
        "events",
        "exit_barrier_timeout",
        "log_line_prefix_template",
        "logs_specs",
        "spec",
        "start_method",
    )

    spec: WorkerSpec
    logs_specs: LogsSpecs
    start_method: str
    exit_barrier_timeout: float
    log_line_prefix_template: str | None
    events: object

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs,
        start_method: str,
        exit_barrier_timeout: float,
        log_line_prefix_template: str | None,
        events: object,
    ) -> None:
        self._set(spec=spec, logs_specs=logs_specs, start_method=start_method)
        self._set(exit_barrier_timeout=exit_barrier_timeout)
        self._set(log_line_prefix_template=log_line_prefix_template, events=events)


def agent_arguments(
    spec: WorkerSpec, positional: tuple[Any, ...], keywords: dict[str, Any]
) -> AgentArguments:
    """Read ``LocalElasticAgent(spec, *positional, **keywords)`` in torch 2.13's form or the
    seeds' (``core.workers.call_forms``); TypeError or ValueError, in one line, for a call of
    neither or an argument relaunch does not take. torch's ``shutdown_timeout`` is the agent's: it
    replaces the spec's."""
    form, given = choose(
        "LocalElasticAgent",
        TORCH_CALL,
        SEEDS_CALL,
        positional,
        keywords,
        is_logs_specs,
        lambda value: isinstance(value, str),
        "its 2nd argument",
    )
    logs_specs = _logs_specs(spec, form is TORCH_CALL, given)
    for name in ("health_check_server", "uninterruptible_state_timeout"):
        if given.get(name) is not None:
            raise ValueError(
                f"{name} is torch's own and not taken: relaunch checks a node's health "
                "with health_check= and a hung worker with hang_timeout="
            )
    if given.get("shutdown_timeout") is not None:
        spec = dataclasses.replace(spec, shutdown_timeout=given["shutdown_timeout"])
    return AgentArguments(
        spec,
        logs_specs,
        given.get("start_method", "spawn"),
        given.get("exit_barrier_timeout", DEFAULT_EXIT_BARRIER_TIMEOUT),
        given.get("log_line_prefix_template"),
        given.get("events"),
    )


def placement_of(spec: WorkerSpec, placement: Placement | None) -> Placement | None:
    """The workers' placement: ``placement`` (the launcher's), else what ``spec`` asks for
    (torch's ``numa_options`` and ``virtual_local_rank``) on this machine. ValueError when
    ``placement`` leaves out the spec's virtual local ranks."""
    if placement is not None:
        if spec.virtual_local_rank and not placement.virtual_local_rank:
            raise ValueError(
                "the WorkerSpec asks for virtual_local_rank but the placement given does not: "
                "plan it with virtual_local_rank=True"
            )
        return placement
    if not spec.virtual_local_rank and spec.numa_options is None:
        return None
    from relaunch.placement import place_workers

    return place_workers(
        spec.local_world_size,
        os.environ,
        numa_binding=None if spec.numa_options is None else numa_binding_of(spec.numa_options),
        virtual_local_rank=spec.virtual_local_rank,
    )


def _logs_specs(spec: WorkerSpec, torch_form: bool, given: dict[str, Any]) -> LogsSpecs:
    """Where the agent's logs go: the ``logs_specs`` of torch's form (``spec.redirects`` and
    ``spec.tee`` left out: ValueError), or the seeds' ``log_dir`` with the spec's streams."""
    if not torch_form:
        return DefaultLogsSpecs(given.get("log_dir"), spec.redirects, spec.tee)
    nprocs = spec.local_world_size
    if any(per_rank(spec.redirects, nprocs).values()) or any(per_rank(spec.tee, nprocs).values()):
        raise ValueError(
            "WorkerSpec(redirects=, tee=) is the seeds' form: with logs_specs, give them to "
            "DefaultLogsSpecs(log_dir, redirects, tee)"
        )
    logs_specs: LogsSpecs = given["logs_specs"]
    return logs_specs
