"""The elastic agent: the driver (``loop``), what it runs (``spec``), its hands on the workers
(``workers``), the expiry timers and hang detection (``expiry``), the shared-memory channel to
the workers (``channel``) read once per tick (``sampler``), what it reports (``sinks`` tell each
run event to ``report``, ``metrics``, ``status`` and the log) and the dry run (``dry_run``).
``api`` and ``local_elastic_agent`` name these where torch's ``agent.server`` has them.
Its decisions are in ``relaunch.core`` (``step``, ``attempt``, ``restart``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relaunch.agent.loop import LocalElasticAgent
from relaunch.agent.spec import (
    DEFAULT_ROLE,
    RunResult,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from relaunch.core.output.console_plan import LOG_LINE_PREFIX_TEMPLATE_ENV
from relaunch.runtime import lazy_attributes

if TYPE_CHECKING:
    from relaunch.agent.api import ElasticAgent
    from relaunch.agent.local_elastic_agent import (
        TORCHELASTIC_ENABLE_FILE_TIMER,
        TORCHELASTIC_TIMER_FILE,
    )

__all__ = [
    "DEFAULT_ROLE",
    "LOG_LINE_PREFIX_TEMPLATE_ENV",
    "TORCHELASTIC_ENABLE_FILE_TIMER",
    "TORCHELASTIC_TIMER_FILE",
    "ElasticAgent",
    "LocalElasticAgent",
    "RunResult",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
]

#: torch's names at torch's paths, loaded on first use (the launcher needs none), and their modules.
_LAZY = {
    "ElasticAgent": "relaunch.agent.api",
    "TORCHELASTIC_ENABLE_FILE_TIMER": "relaunch.agent.local_elastic_agent",
    "TORCHELASTIC_TIMER_FILE": "relaunch.agent.local_elastic_agent",
}

__getattr__ = lazy_attributes(__name__, _LAZY)
