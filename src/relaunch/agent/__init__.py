"""The elastic agent: the driver (``loop``), what it runs (``spec``), its hands on the workers
(``workers``), the expiry timers and hang detection (``expiry``), the shared-memory channel to
the workers (``channel``) read once per tick (``sampler``), what it reports (``sinks`` tell each
run event to ``report``, ``metrics``, ``status`` and the log) and the dry run (``dry_run``).
``api`` and ``local_elastic_agent`` name these where torch's ``agent.server`` has them.
Its decisions are in ``relaunch.core`` (``step``, ``attempt``, ``restart``)."""

from __future__ import annotations

from relaunch.agent.api import ElasticAgent
from relaunch.agent.local_elastic_agent import (
    TORCHELASTIC_ENABLE_FILE_TIMER,
    TORCHELASTIC_TIMER_FILE,
    LocalElasticAgent,
)
from relaunch.agent.spec import (
    DEFAULT_ROLE,
    RunResult,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from relaunch.core.output.console_plan import LOG_LINE_PREFIX_TEMPLATE_ENV

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
