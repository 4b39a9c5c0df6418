"""Attempt hooks: each feature of the agent that acts on its workers (kept state, the zygote,
restarting in place, expiry timers, the progress reporter) is one ``AttemptHook``, in its own
module, registered in one line (``agent.features``). ``agent.workers`` runs them:

- ``open``: a run begins (the channel is made); ``close``: it is over.
- each attempt: ``starting`` (before anything else), ``environment`` (what every worker gets),
  ``wrap_start`` (how ``start_processes`` is called), then, once started, ``grace`` (what a
  failure waits for) and ``started``; ``worker_failed`` from the monitor's thread.
- a stop runs the phases ``core.run.stop_plan`` orders, each by the hook that ``stop_phases`` names.

``Run`` is what the hooks share: the run's services, and its current attempt.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

from relaunch.agent.spec import WorkerGroup
from relaunch.core.run.stop_plan import Feature, StopPhase
from relaunch.core.workers.state_settings import StateSettings
from relaunch.procs.context import PContext

if TYPE_CHECKING:
    from relaunch.agent.channel import Channel
    from relaunch.agent.expiry import ExpiryWatch
    from relaunch.agent.report import RunReport
    from relaunch.agent.sampler import Sampler
    from relaunch.agent.status import NodeReporter
    from relaunch.procs.console import Console
    from relaunch.procs.worker_process import FailureGrace
    from relaunch.rendezvous.job import JobServices
    from relaunch.runtime import Clock


def _no_save(hung: Collection[int] = ()) -> None:
    return None


def _no_step() -> int | None:
    return None


class Run:
    """One agent's run, as its hooks see it: the settings and services (fixed), the channel
    (from ``open``), and the attempt now (``pcontext``, from its start). A plain class: the
    hooks change it as the run goes, and a dataclass would cost the launcher its ``exec``."""

    __slots__ = (
        "agent_store",
        "channel",
        "clock",
        "console",
        "draws_console",
        "expiry",
        "group",
        "job",
        "open_env",
        "own_start",
        "pcontext",
        "preload",
        "report",
        "reporter",
        "sampler",
        "save_just_in_time",
        "saved_step",
        "state_settings",
    )

    def __init__(
        self,
        group: WorkerGroup,
        job: JobServices,
        clock: Clock,
        expiry: ExpiryWatch,
        reporter: NodeReporter,
        report: RunReport,
        sampler: Sampler,
        console: Console,
        state_settings: StateSettings | None = None,
        preload: tuple[str, ...] = (),
    ) -> None:
        self.group = group
        self.job = job
        self.clock = clock
        self.expiry = expiry
        self.reporter = reporter
        self.report = report
        self.sampler = sampler
        self.console = console
        self.state_settings = state_settings
        self.preload = preload
        self.own_start = True  # the workers are started by relaunch's start_processes
        self.channel: Channel | None = None
        #: What every worker gets that the hooks set at ``open`` (the zygote's environment too).
        self.open_env: dict[str, str] = {}
        self.pcontext: PContext | None = None
        self.agent_store = False  # this attempt's torch store is served by an agent
        self.draws_console = False  # this attempt's plan draws the node bar
        #: The just-in-time save (``agent.hook_state``), before stacks are taken from ``hung``.
        self.save_just_in_time: Callable[[Collection[int]], None] = _no_save
        #: The newest step the workers kept with ``save_state`` (None: none, or no kept state).
        self.saved_step: Callable[[], int | None] = _no_step


class AttemptHook:
    """A feature of the agent, told of each moment of the run; every method does nothing
    unless the feature needs it."""

    def open(self, run: Run) -> None:
        """The run begins: its channel is ``run.channel``."""

    def starting(self, run: Run) -> None:
        """An attempt is about to be planned (the group just joined)."""

    def environment(self, run: Run) -> Mapping[str, str]:
        """What every worker of the attempt gets on top of the launcher's environment."""
        return {}

    def wrap_start(self, run: Run, start: Callable[..., PContext]) -> Callable[..., PContext]:
        """What starts the attempt's workers, once planned: ``start``, or a function around it
        (one that adds keywords, say)."""
        return start

    def grace(self, run: Run) -> FailureGrace | None:
        """What a worker's failure waits for before the others are stopped."""
        return None

    def worker_failed(self) -> None:
        """A worker failed (from the monitor's thread: quick)."""

    def started(self, run: Run) -> None:
        """The attempt's workers started (``run.pcontext``)."""

    def features(self) -> Collection[Feature]:
        """The features whose phases a stop runs (``core.run.stop_plan``)."""
        return ()

    def stop_phases(self, run: Run) -> Mapping[StopPhase, Callable[[], None]]:
        """The phases of a stop this hook performs."""
        return {}

    def note(self) -> str | None:
        """A line for a failed attempt's report."""
        return None

    def close(self) -> None:
        """The run is over."""


#: Makes a feature's hook for a run (None: the feature is off).
HookFactory = Callable[[Run], AttemptHook | None]
