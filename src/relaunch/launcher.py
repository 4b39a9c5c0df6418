"""The launcher API: ``LaunchConfig`` and ``elastic_launch``, as in torch.distributed.launcher."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from relaunch.agent import LocalElasticAgent, WorkerSpec
from relaunch.core.streams import Std
from relaunch.core.summary import RunSummary
from relaunch.events import Metrics, event_handler_from_spec, metric_handler_from_spec
from relaunch.procs.context import DEFAULT_SHUTDOWN_TIMEOUT
from relaunch.procs.errors import ChildFailedError, SignalException
from relaunch.rendezvous.api import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousParameters,
)
from relaunch.rendezvous.backends import get_rendezvous_handler

log = logging.getLogger(__name__)


@dataclass
class LaunchConfig:
    """How to launch: nodes, workers per node, rendezvous, restarts, logs.

    ``rdzv_backend="static"`` with ``rdzv_endpoint="MASTER_ADDR:MASTER_PORT"`` and
    ``rdzv_configs={"rank": NODE_RANK}`` runs a fixed set of nodes; a port of 0 picks a free one
    (one node). ``metrics_cfg`` may name ``{"handler": "console" | "file:PATH" | "null"}``.
    """

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    run_id: str = ""
    role: str = "default"
    rdzv_endpoint: str = ""
    rdzv_backend: str = "static"
    rdzv_configs: dict[str, Any] = field(default_factory=dict)
    rdzv_timeout: int = -1
    max_restarts: int = 3
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_dir: str | None = None
    redirects: Std | dict[int, Std] = Std.NONE
    tee: Std | dict[int, Std] = Std.NONE
    metrics_cfg: dict[str, str] = field(default_factory=dict)
    local_addr: str | None = None
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    event_log_handler: str = "null"
    #: Run a file timer server for ``relaunch.timer.expires`` (None: when
    #: ``TORCHELASTIC_ENABLE_FILE_TIMER=1``); restart when a worker hangs this many seconds.
    timers: bool | None = None
    hang_timeout: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.min_nodes <= self.max_nodes:
            raise ValueError(
                f"nodes must satisfy 0 < min_nodes <= max_nodes, got {self.min_nodes}:"
                f"{self.max_nodes}"
            )
        if self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node must be >= 1, got {self.nproc_per_node}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.rdzv_timeout > 0:
            self.rdzv_configs.setdefault("timeout", self.rdzv_timeout)

    def __repr__(self) -> str:
        from dataclasses import fields

        from relaunch.rendezvous.api import redacted

        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        shown["rdzv_configs"] = redacted(self.rdzv_configs)
        return "LaunchConfig(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"


class elastic_launch:
    """``elastic_launch(config, entrypoint)(*args)`` runs ``entrypoint`` on every worker.

    Returns ``{global_rank: return_value}`` (None for binaries) or raises ``ChildFailedError``.
    """

    def __init__(self, config: LaunchConfig, entrypoint: Callable[..., Any] | str) -> None:
        self._config = config
        self._entrypoint = entrypoint

    def __call__(self, *args: Any) -> dict[int, Any]:
        return launch_agent(self._config, self._entrypoint, list(args))


def new_run_id() -> str:
    """A fresh random run id (32 hex digits, like a uuid4's)."""
    return os.urandom(16).hex()


def rendezvous_handler(config: LaunchConfig) -> RendezvousHandler:
    """The rendezvous handler ``config`` describes; ValueError when it is not runnable."""
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id or new_run_id(),
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **{"local_world_size": config.nproc_per_node, **config.rdzv_configs},
    )
    return get_rendezvous_handler(params)


def launch_agent(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str,
    args: list[Any],
    handler: RendezvousHandler | None = None,
    on_summary: Callable[[RunSummary], None] | None = None,
) -> dict[int, Any]:
    """Run the agent ``config`` describes and map its result (``handler`` if already built).

    ``on_summary`` gets the end-of-run summary, whatever the outcome.
    """
    if handler is None:
        handler = rendezvous_handler(config)
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        rdzv_handler=handler,
        entrypoint=entrypoint,
        args=tuple(args),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        local_addr=config.local_addr,
        redirects=config.redirects,
        tee=config.tee,
        shutdown_timeout=config.shutdown_timeout,
    )
    event_handler = event_handler_from_spec(config.event_log_handler)
    metrics = Metrics(
        metric_handler_from_spec(config.metrics_cfg.get("handler", "null")), group="torchelastic"
    )
    agent = LocalElasticAgent(
        spec,
        config.start_method,
        log_dir=config.log_dir,
        event_handler=event_handler,
        metrics=metrics,
        timers=config.timers,
        hang_timeout=config.hang_timeout,
    )
    outcome = "ended by an error"
    try:
        result = agent.run()
        outcome = "failed" if result.is_failed() else "succeeded"
    except SignalException as exc:
        outcome = f"stopped by {exc.sigval.name}"
        raise
    except RendezvousClosedError:
        outcome = "not started: the job had already finished"
        raise
    finally:
        handler.shutdown()
        event_handler.close()
        if on_summary is not None:
            on_summary(agent.summary(outcome))
    if result.is_failed():
        raise ChildFailedError(spec.get_entrypoint_name(), result.failures, result.stopped)
    return result.return_values
