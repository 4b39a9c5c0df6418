"""torch's ``torch.distributed.elastic.agent.server.api``, at relaunch's path: the worker and
spec names (their home is ``agent.spec``) and ``ElasticAgent``, the interface every agent
offers (``LocalElasticAgent`` counts as one)."""

from __future__ import annotations

import abc

from relaunch.agent.loop import LocalElasticAgent
from relaunch.agent.spec import (
    DEFAULT_ROLE,
    RunResult,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)

__all__ = [
    "ElasticAgent",
    "RunResult",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
]


class ElasticAgent(abc.ABC):
    """An agent that runs one or more roles' worker groups: torch's interface, for code that
    types against it or writes an agent of its own. ``LocalElasticAgent`` is one
    (``isinstance`` says so) without deriving from it."""

    @abc.abstractmethod
    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """Run the workers of ``role`` to the end, restarting them as the policy allows."""

    @abc.abstractmethod
    def get_worker_group(self, role: str = DEFAULT_ROLE) -> WorkerGroup:
        """The worker group of ``role``, as it stands now."""


ElasticAgent.register(LocalElasticAgent)
