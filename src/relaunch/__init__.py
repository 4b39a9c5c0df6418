"""relaunch: a fast, lean, orphan-proof, torchrun-compatible launcher for distributed jobs.

The public names follow ``torch.distributed.elastic``, so code moves over by changing an import.
Importing relaunch never imports torch or any other framework.
"""

from relaunch import procs
from relaunch.agent import (
    LocalElasticAgent,
    RunResult,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from relaunch.launcher import LaunchConfig, elastic_launch
from relaunch.procs import *  # noqa: F403
from relaunch.worker import report_progress, stop_requested

__version__ = "0.1.0"

__all__ = [
    *procs.__all__,
    "LaunchConfig",
    "LocalElasticAgent",
    "RunResult",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
    "elastic_launch",
    "report_progress",
    "stop_requested",
]
