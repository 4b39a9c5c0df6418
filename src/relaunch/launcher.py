"""The launcher API: ``LaunchConfig`` and ``elastic_launch``, as in torch.distributed.launcher.

``LaunchConfig`` and its checks live in ``relaunch.config``; it is importable from here too.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from relaunch.agent import LocalElasticAgent, WorkerSpec
from relaunch.config import ConfigError, open_files_needed
from relaunch.config import LaunchConfig as LaunchConfig
from relaunch.config import new_run_id as new_run_id
from relaunch.core.defaults import DEFAULT_SHUTDOWN_TIMEOUT
from relaunch.core.rendezvous.rdzv_conf import BACKENDS, STATIC_BACKEND, RendezvousSpec
from relaunch.core.run.summary import RunSummary
from relaunch.events import (
    EventHandler,
    Metrics,
    event_handler_from_spec,
    metric_handler_from_spec,
)
from relaunch.procs.errors import ChildFailedError, SignalException
from relaunch.procs.logs_specs import DefaultLogsSpecs, LogsSpecs
from relaunch.procs.signals import SIGNALS_TO_HANDLE_ENV
from relaunch.rendezvous.api import (
    JobFailedError,
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from relaunch.rendezvous.backends import create_rendezvous_handler
from relaunch.runtime import raise_open_file_limit

if TYPE_CHECKING:
    from relaunch.core.workers.placement import Placement

__all__ = ["LaunchConfig", "elastic_launch", "launch_agent"]

log = logging.getLogger(__name__)


class elastic_launch:
    """``elastic_launch(config, entrypoint)(*args)`` runs ``entrypoint`` on every worker.

    Returns ``{global_rank: return_value}`` (None for binaries) or raises ``ChildFailedError``.
    ``health_check_server``: as ``launch_agent``'s.
    """

    def __init__(
        self,
        config: LaunchConfig,
        entrypoint: Callable[..., Any] | str,
        health_check_server: Any = None,
    ) -> None:
        self._config = config
        self._entrypoint = entrypoint
        self._health_check_server = health_check_server

    def __call__(self, *args: Any) -> dict[int, Any]:
        try:
            return launch_agent(
                self._config, self._entrypoint, list(args), self._health_check_server
            )
        except ChildFailedError as failed:
            # The workers failed, not relaunch: the traceback ends at the caller's frames (its
            # message holds the root cause), not in the agent's.
            raise failed.with_traceback(None) from None


def rendezvous_handler(config: LaunchConfig) -> RendezvousHandler:
    """The rendezvous handler ``config`` describes, built from its settings as they were read
    (``LaunchConfig.rendezvous_settings``); ValueError when it is not runnable (ConfigError,
    before anything starts, for the static backend without an endpoint). A backend that
    is not built in is built by the creator a user registered for it with
    ``relaunch.rendezvous.registry.rendezvous_handler_registry`` (torch's way), from a
    ``RendezvousParameters`` of the config's ``rdzv_*`` fields; ValueError naming the
    registered backends when there is none (a typo)."""
    run_id = config.run_id or new_run_id()
    if config.rdzv_backend not in BACKENDS:
        return rendezvous_handler_registry.create_handler(
            RendezvousParameters(
                config.rdzv_backend,
                config.rdzv_endpoint,
                run_id,
                config.min_nodes,
                config.max_nodes,
                config.local_addr,
                **config.rdzv_configs,
            )
        )
    if config.rdzv_backend == STATIC_BACKEND and not (config.rdzv_endpoint or "").strip():
        # torch's launch_agent refuses it too; c10d and etcd, as torch's, default to this host
        raise ConfigError(
            "LaunchConfig.rdzv_endpoint is empty: the static backend needs the master's "
            "HOST:PORT (rdzv_endpoint='127.0.0.1:0' runs one node on a free port), or use "
            "rdzv_backend='c10d'"
        )
    spec = RendezvousSpec(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        settings=config.rendezvous_settings,
        local_addr=config.local_addr,
    )
    return create_rendezvous_handler(spec)


def ensure_open_files(config: LaunchConfig) -> None:
    """Raise the soft open-file limit (to the hard one) when the workers ``config`` asks for
    need more descriptors than it allows (``relaunch.config.open_files_needed``): the workers
    inherit it. ConfigError, in one line with the number needed, when even the hard limit is
    too low."""
    from relaunch.procs.console import terminals_of

    needed = open_files_needed(config, terminals_of(sys.stdout, sys.stderr))
    soft, hard = raise_open_file_limit(needed)
    if soft != resource.RLIM_INFINITY and soft < needed:
        limit = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
        raise ConfigError(
            f"{config.nproc_per_node} workers per node need about {needed} open files, but "
            f"this process may open at most {soft} (hard limit {limit}, ulimit -Hn): raise the "
            f"limit (ulimit -n {needed}, LimitNOFILE= in systemd, nofile in "
            "/etc/security/limits.conf) or run fewer workers per node"
        )


def launch_agent(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str,
    args: list[Any],
    health_check_server: Any = None,
    *,
    handler: RendezvousHandler | None = None,
    on_summary: Callable[[RunSummary], None] | None = None,
) -> dict[int, Any]:
    """Run the agent ``config`` describes and map its result (``handler`` if already built).

    ``on_summary`` gets the end-of-run summary, whatever the outcome. ``health_check_server``
    (torch's ``HealthCheckServer``, a stub in open-source torch) is stopped when the run ends,
    as torch's agent does, and never started: relaunch's health checks are ``--health-check``.
    ``TORCHELASTIC_SIGNALS_TO_HANDLE`` is set in ``os.environ`` for the workers to inherit, and
    left set, as torch's ``launch_agent`` leaves it.
    """
    os.environ[SIGNALS_TO_HANDLE_ENV] = config.signals_to_handle
    handler = rendezvous_handler(config) if handler is None else handler
    try:
        ensure_open_files(config)
    except BaseException as exc:
        _shut_down(handler, config, exc)
        raise
    spec = worker_spec(config, handler, entrypoint, args)
    event_handler = event_handler_from_spec(config.event_log_handler)
    try:
        agent = _agent(config, spec, event_handler)
    except BaseException as exc:  # the metrics port cannot be bound: nothing ran
        _shut_down(handler, config, exc)
        event_handler.close()
        raise
    outcome = "ended by an error"
    error: BaseException | None = None
    try:
        result = agent.run()
        outcome = "failed" if result.is_failed() else "succeeded"
    except SignalException as exc:
        outcome, error = f"stopped by {exc.sigval.name}", exc
        raise
    except JobFailedError as exc:
        outcome = "failed: the job ended on another node" + (
            "" if exc.requeue else "; do not requeue the job"
        )
        raise
    except RendezvousClosedError:
        outcome = "not started: the job had already finished"
        raise
    finally:
        _shut_down(handler, config, error)
        event_handler.close()
        if health_check_server is not None:
            health_check_server.stop()
        if on_summary is not None:
            on_summary(agent.summary(outcome))
    if result.is_failed():
        raise ChildFailedError(
            spec.get_entrypoint_name(),
            result.failures,
            result.stopped,
            requeue=agent.requeue,
            verdict=result.verdict,
        )
    return result.return_values


def _shut_down(
    handler: RendezvousHandler, config: LaunchConfig, error: BaseException | None
) -> None:
    """Shut ``handler`` down as the run ends with ``error`` (None: it ended without one).

    Not when a signal stopped the agent, as torch's ``launch_agent`` does not: a handler's
    ``shutdown()`` may close the rendezvous for good, which stops any later scaling (torch's
    c10d and etcd handlers do). relaunch's own backends' ``shutdown()`` closes nothing for good:
    it leaves the round, so the other nodes re-form at once rather than after the keep-alive
    silence, and lets go of the store's connections and this node's keys; they are shut down
    whatever ended the run (docs/python-api.md).
    """
    if not isinstance(error, SignalException) or config.rdzv_backend in BACKENDS:
        handler.shutdown()


def worker_spec(
    config: LaunchConfig,
    handler: RendezvousHandler,
    entrypoint: Callable[..., Any] | str,
    args: list[Any],
) -> WorkerSpec:
    """The workers ``config`` describes, joined through ``handler``."""
    return WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        rdzv_handler=handler,
        entrypoint=entrypoint,
        args=tuple(args),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        numa_options=config.numa_options,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        virtual_local_rank=config.virtual_local_rank,
        shutdown_timeout=DEFAULT_SHUTDOWN_TIMEOUT
        if config.shutdown_timeout is None
        else config.shutdown_timeout,
    )


def placement_of(config: LaunchConfig) -> Placement | None:
    """The ranks' device placement ``config`` asks for (ConfigError if it cannot be), or None."""
    if not (
        config.devices is not None
        or config.device_per_rank
        or config.numa_binding
        or config.virtual_local_rank
    ):
        return None
    from relaunch.placement import placement_for

    return placement_for(config, os.environ)


def logs_specs_of(config: LaunchConfig) -> LogsSpecs:
    """Where the logs of ``config``'s workers go: its ``logs_specs`` (torch 2.13's form), or
    a ``DefaultLogsSpecs`` of its ``log_dir``, ``redirects``, ``tee`` and ``local_ranks_filter``
    (the seeds' form; as torch's ``LaunchConfig`` makes one when none is given). Makes the log
    directory (a new temporary one when none is named)."""
    if config.logs_specs is not None:
        logs_specs: LogsSpecs = config.logs_specs
        return logs_specs
    return DefaultLogsSpecs(
        config.log_dir,
        config.redirects,
        config.tee,
        None if config.local_ranks_filter is None else set(config.local_ranks_filter),
    )


def _agent(
    config: LaunchConfig, spec: WorkerSpec, event_handler: EventHandler
) -> LocalElasticAgent:
    """The agent ``config`` describes (its metrics port bound: ConfigError if it cannot be, or
    if its device placement cannot be)."""
    placement = placement_of(config)
    metrics = Metrics(
        metric_handler_from_spec(config.metrics_cfg.get("handler", "null")), group="torchelastic"
    )
    return LocalElasticAgent(
        spec,
        logs_specs_of(config),
        config.start_method,
        exit_barrier_timeout=config.exit_barrier_timeout,
        log_line_prefix_template=config.log_line_prefix_template,
        event_handler=event_handler,
        metrics=metrics,
        restart_policy=config.restart_policy,
        hang=config.hang,
        health=config.health,
        metrics_endpoint=config.metrics_endpoint,
        placement=placement,
        state=config.state,
        preload=config.preload,
    )
