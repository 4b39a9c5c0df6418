"""The elastic agent: the run loop (``loop``), what it runs (``spec``), the expiry timers and
hang detection (``expiry``), the shared-memory channel to the workers (``channel``) and what it
reports (``report``). Its decisions are in ``relaunch.core`` (``restart``, ``console_plan``)."""

from __future__ import annotations

from relaunch.agent.loop import LocalElasticAgent
from relaunch.agent.spec import (
    DEFAULT_ROLE,
    RunResult,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from relaunch.core.console_plan import LOG_LINE_PREFIX_TEMPLATE_ENV

__all__ = [
    "DEFAULT_ROLE",
    "LOG_LINE_PREFIX_TEMPLATE_ENV",
    "LocalElasticAgent",
    "RunResult",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
]
