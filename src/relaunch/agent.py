"""The elastic agent: rendezvous, start the local workers, watch them, restart them as one.

``LocalElasticAgent.run`` is the one driver: it asks the rendezvous handler for this node's
place, plans every worker's ranks and environment (``core.ranks``), starts them through the
process layer, waits for their group to end (an event, not a sleep), and lets the restart policy
(``core.restart``) decide what comes next.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from relaunch.channel import Channel
from relaunch.core.channel import Progress
from relaunch.core.failures import describe_exit, format_report, root_cause_rank
from relaunch.core.group import GroupState
from relaunch.core.progress import NodeProgress
from relaunch.core.ranks import GroupContext, WorkerRanks, ranks_at_offset, worker_env
from relaunch.core.restart import Action, decide
from relaunch.core.streams import Std, per_rank
from relaunch.core.summary import RankEnd, RunSummary
from relaunch.events import (
    EventHandler,
    EventSource,
    Metrics,
    NullEventHandler,
    NullMetricHandler,
    status_event,
)
from relaunch.procs.console import console_for
from relaunch.procs.context import (
    DEFAULT_SHUTDOWN_TIMEOUT,
    PContext,
    RunProcsResult,
    start_processes,
)
from relaunch.procs.errors import ProcessFailure, SignalException, StopRequested
from relaunch.rendezvous.api import RendezvousClosedError, RendezvousHandler, RendezvousInfo
from relaunch.watchdog import Watchdog, timers_enabled_by_env

log = logging.getLogger(__name__)

DEFAULT_ROLE = "default"
#: torchrun's variable for the console prefix of worker lines.
LOG_LINE_PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"


class WorkerState(str, enum.Enum):
    """The state of a worker group (all workers of one node move together)."""

    UNKNOWN = "UNKNOWN"
    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    @staticmethod
    def is_running(state: WorkerState) -> bool:
        return state in (WorkerState.HEALTHY, WorkerState.UNHEALTHY)


@dataclass
class WorkerSpec:
    """What to run on this node: the entrypoint, how many copies, and the restart budget.

    ``entrypoint`` is a function (run with multiprocessing) or a binary path; ``args`` are passed
    to every worker, with ``${local_rank}`` replaced by its local rank.
    """

    role: str
    local_world_size: int
    rdzv_handler: RendezvousHandler
    entrypoint: Callable[..., Any] | str | None = None
    args: tuple[Any, ...] = ()
    max_restarts: int = 3
    monitor_interval: float = 0.1
    master_port: int | None = None
    master_addr: str | None = None
    local_addr: str | None = None
    redirects: Std | dict[int, Std] = Std.NONE
    tee: Std | dict[int, Std] = Std.NONE
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT

    def __post_init__(self) -> None:
        if self.local_world_size < 1:
            raise ValueError(f"local_world_size must be >= 1, got {self.local_world_size}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.entrypoint is None:
            raise ValueError("WorkerSpec needs an entrypoint: a function or a binary")

    def get_entrypoint_name(self) -> str:
        """The function's name, the script a Python interpreter runs, or the binary's name."""
        entrypoint = self.entrypoint
        if callable(entrypoint):
            return getattr(entrypoint, "__name__", repr(entrypoint))
        assert isinstance(entrypoint, str)
        if entrypoint == sys.executable:
            script = next((str(a) for a in self.args if not str(a).startswith("-")), "")
            if script:
                return os.path.basename(script)
        return os.path.basename(entrypoint)


@dataclass
class Worker:
    """One worker of the group; ranks are -1 until a rendezvous assigned them."""

    local_rank: int
    global_rank: int = -1
    role_rank: int = -1
    world_size: int = -1
    role_world_size: int = -1
    id: int | None = None


class WorkerGroup:
    """The workers of one ``WorkerSpec`` on this node, and their shared place in the job."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.workers = [Worker(local_rank=i) for i in range(spec.local_world_size)]
        self.store: Any = None
        self.group_rank: int | None = None
        self.group_world_size: int | None = None
        self.master_addr: str | None = None
        self.master_port: int | None = None
        self.state = WorkerState.INIT


@dataclass
class RunResult:
    """How a run ended. ``return_values`` and ``failures`` are keyed by global rank;
    ``stopped`` lists the global ranks stopped only because another failed."""

    state: WorkerState
    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    stopped: list[int] = field(default_factory=list)

    def is_failed(self) -> bool:
        return self.state is WorkerState.FAILED


class LocalElasticAgent:
    """Runs ``spec.local_world_size`` workers on this host as one unit, restarting the whole group
    on failure while ``spec.max_restarts`` allow, and when nodes wait to join (for free).

    Agent and workers talk through a shared-memory channel (``relaunch.report_progress``,
    ``relaunch.stop_requested``): the first SIGTERM/SIGINT (``StopRequested``) asks the workers
    to stop and waits up to ``spec.shutdown_timeout`` for them before stopping them as for any
    other signal. ``events`` (ice-learn's control channel) is accepted for compatibility; the
    channel takes its place. Status events go to ``event_handler`` and metrics to ``metrics``
    (both discard by default).

    ``timers`` runs a file timer server for ``relaunch.timer.expires`` in the workers (by
    default when ``TORCHELASTIC_ENABLE_FILE_TIMER=1``); ``hang_timeout`` restarts the group when
    a worker shows no sign of life for that many seconds, with its stack in the report.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        start_method: str = "spawn",
        exit_barrier_timeout: float = 300,
        log_dir: str | None = None,
        events: object = None,
        *,
        event_handler: EventHandler | None = None,
        metrics: Metrics | None = None,
        timers: bool | None = None,
        hang_timeout: float | None = None,
    ) -> None:
        self._worker_group = WorkerGroup(spec)
        self._start_method = start_method
        self._exit_barrier_timeout = exit_barrier_timeout
        self._events = events
        self._event_handler: EventHandler = event_handler or NullEventHandler()
        self._metrics = metrics or Metrics(NullMetricHandler(), group="torchelastic")
        self._restarts_left = spec.max_restarts
        self._pcontext: PContext | None = None
        self._ranks: list[WorkerRanks] = []
        self._log_dir = self._make_log_dir(log_dir, spec.rdzv_handler.get_run_id())
        self._started_at = time.monotonic()
        self._watchdog = Watchdog(
            spec.rdzv_handler.get_run_id(),
            timers_enabled_by_env() if timers is None else timers,
            hang_timeout,
        )
        self._channel: Channel | None = None
        self._last_outcome: RunProcsResult | None = None
        self._restart_reasons: list[str] = []
        self._stop_note = ""
        self._node_progress: NodeProgress | None = None
        self._last_progress: dict[int, Progress | None] = {}
        self._console = console_for(sys.stdout, sys.stderr)

    @staticmethod
    def _make_log_dir(log_dir: str | None, run_id: str) -> str:
        base = log_dir or tempfile.mkdtemp(prefix="relaunch_")
        os.makedirs(base, exist_ok=True)
        path = tempfile.mkdtemp(prefix=f"{run_id}_", dir=base)
        log.info("log directory: %s", path)
        return path

    @property
    def log_dir(self) -> str:
        return self._log_dir

    def get_worker_group(self, role: str = DEFAULT_ROLE) -> WorkerGroup:
        return self._worker_group

    # -- the run loop -------------------------------------------------------------------------

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """Run the workers to the end; a ``SignalException`` stops them with that signal first."""
        self._started_at = time.monotonic()
        self._channel = Channel(self._worker_group.spec.local_world_size)
        self._watchdog.start()
        try:
            try:
                result = self._invoke_run()
            except StopRequested as exc:
                raise self._stop_gracefully(exc) from None
            self._stop_workers(signal.SIGTERM)
        except SignalException as exc:
            self._stop_workers(exc.sigval)
            self._record_agent_event(WorkerState.FAILED, raw_error=str(exc))
            raise
        except BaseException:
            self._stop_workers(signal.SIGTERM)
            self._record_agent_event(WorkerState.FAILED)
            raise
        finally:
            self._console.remove_source(self._node_bar)
            self._watchdog.close()
            self._channel.close()
        self._record_run_events(result)
        return result

    def _stop_gracefully(self, request: StopRequested) -> SignalException:
        """Ask the workers to stop, give them ``shutdown_timeout`` seconds, then stop the rest.

        Only when a running worker listens (has called ``stop_requested()``); otherwise the
        workers are stopped at once, as by torchrun. Returns the exception to end the run with:
        the request, or a second signal.
        """
        spec = self._worker_group.spec
        channel, pcontext = self._channel, self._pcontext
        if pcontext is None or channel is None:
            return request
        if not any(channel.listening(rank) for rank in pcontext.running()):
            return request  # nobody would hear it: stop them with the signal at once
        channel.request_stop()
        try:
            log.warning(
                "%s: asking the workers to stop (relaunch.stop_requested()); waiting up "
                "to %gs for them (send %s again to stop them now)",
                request.sigval.name,
                spec.shutdown_timeout,
                request.sigval.name,
            )
            outcome = pcontext.wait(spec.shutdown_timeout)
        except SignalException as again:
            self._stop_note = f"{again.sigval.name} again: the workers were stopped at once"
            return again
        if outcome is not None and not outcome.is_failed():
            self._stop_note = "the workers stopped cleanly after the stop request (all exited 0)"
        elif outcome is not None:
            self._stop_note = "the workers stopped after the stop request, some of them failing"
        else:
            running = len(pcontext.running())
            self._stop_note = (
                f"{running} worker(s) did not stop within "
                f"{spec.shutdown_timeout:g}s of the request and were sent "
                f"{request.sigval.name}"
            )
        return request

    def _invoke_run(self) -> RunResult:
        group = self._worker_group
        spec = group.spec
        role = spec.role
        self._rendezvous()
        self._start_workers()
        while True:
            assert self._pcontext is not None
            watching = spec.rdzv_handler.watches_membership
            wait_for = spec.monitor_interval if watching else -1.0
            check_in = self._watchdog.check()  # hung workers; when to look again
            if check_in is not None:
                wait_for = check_in if wait_for < 0 else min(wait_for, check_in)
            outcome = self._pcontext.wait(wait_for)
            if outcome is None:
                state = GroupState.RUNNING
            else:
                state = GroupState.FAILED if outcome.is_failed() else GroupState.SUCCEEDED
            if outcome is not None and outcome.is_failed():
                self._watchdog.explain(outcome.failures, self._pcontext.stderrs)
            change = spec.rdzv_handler.membership_change() if watching else None
            if (
                state is GroupState.FAILED
                and watching
                and change is None
                and not (self._restarts_left)
            ):
                # Collectives break at once when a peer node dies; heartbeats tell it a moment
                # later. Before calling the job failed, give the lost node time to be noticed:
                # then it is a membership change, which restarts without using a restart.
                log.info(
                    "workers failed: waiting up to %gs for a lost node to be noticed",
                    spec.rdzv_handler.lost_node_grace,
                )
                change = spec.rdzv_handler.wait_membership_change(spec.rdzv_handler.lost_node_grace)
            decision = decide(state, self._restarts_left, change)
            if decision.action is Action.CONTINUE:
                continue
            self._metrics.put_metric(f"workers.{role}.remaining_restarts", self._restarts_left)
            self._metrics.put_metric(f"workers.{role}.{state.value.lower()}", 1)
            if decision.action is Action.SUCCEED:
                assert outcome is not None
                group.state = WorkerState.SUCCEEDED
                # Keep heartbeating until every live node is done, so an early finisher is not
                # mistaken for a lost node; then close the job to latecomers.
                spec.rdzv_handler.exit_barrier(self._exit_barrier_timeout)
                spec.rdzv_handler.set_closed()
                return RunResult(
                    WorkerState.SUCCEEDED,
                    return_values=self._by_global_rank(outcome.return_values),
                )
            if decision.action is Action.FAIL:
                assert outcome is not None
                return self._failed(outcome)
            if decision.uses_restart:
                self._restarts_left -= 1
            reason = decision.reason
            if outcome is not None and outcome.is_failed():
                failures = self._by_global_rank(outcome.failures)
                log.warning(
                    "%s",
                    format_report(
                        spec.role,
                        failures,
                        os.uname().nodename,
                        self._by_global_rank(outcome.stopped),
                    ),
                )
                reason = _one_line(failures)
            self._restart_reasons.append(reason)
            log.warning(
                "[%s] restarting the worker group (%s); %d restart(s) left",
                role,
                decision.reason,
                self._restarts_left,
            )
            self._stop_workers(signal.SIGTERM)
            if decision.uses_restart:  # the other nodes restart because of this: say why
                spec.rdzv_handler.note_restart(f"{os.uname().nodename}: {reason}")
            try:
                self._rendezvous()
            except RendezvousClosedError:
                if outcome is None or not outcome.is_failed():
                    raise
                # The other nodes finished the job meanwhile: this node's failure stands.
                return self._failed(outcome)
            self._start_workers()

    def _failed(self, outcome: RunProcsResult) -> RunResult:
        self._worker_group.state = WorkerState.FAILED
        return RunResult(
            WorkerState.FAILED,
            failures=self._by_global_rank(outcome.failures),
            stopped=sorted(self._by_global_rank(outcome.stopped)),
        )

    def _by_global_rank(self, by_local_rank: Mapping[int, Any]) -> dict[int, Any]:
        workers = self._worker_group.workers
        return {workers[local].global_rank: value for local, value in by_local_rank.items()}

    # -- the steps ----------------------------------------------------------------------------

    def _rendezvous(self) -> None:
        group = self._worker_group
        spec = group.spec
        info: RendezvousInfo = spec.rdzv_handler.next_rendezvous()
        group.store = info.store
        group.group_rank = info.group_rank
        group.group_world_size = info.group_world_size
        group.master_addr = spec.master_addr or info.master_addr
        group.master_port = spec.master_port or info.master_port
        self._ranks = ranks_at_offset(info.rank_offset, spec.local_world_size, info.world_size)
        for worker, ranks in zip(group.workers, self._ranks, strict=True):
            worker.global_rank = ranks.global_rank
            worker.role_rank = ranks.role_rank
            worker.world_size = ranks.world_size
            worker.role_world_size = ranks.role_world_size

    @property
    def restart_count(self) -> int:
        return self._worker_group.spec.max_restarts - self._restarts_left

    def _start_workers(self) -> None:
        group = self._worker_group
        spec = group.spec
        assert group.group_rank is not None and group.group_world_size is not None
        assert group.master_addr is not None and group.master_port is not None
        assert spec.entrypoint is not None
        context = GroupContext(
            role=spec.role,
            run_id=spec.rdzv_handler.get_run_id(),
            group_rank=group.group_rank,
            group_world_size=group.group_world_size,
            local_world_size=spec.local_world_size,
            master_addr=group.master_addr,
            master_port=group.master_port,
            restart_count=self.restart_count,
            max_restarts=spec.max_restarts,
        )
        assert self._channel is not None
        self._channel.reset()
        extra_env = {**self._watchdog.worker_env(), **self._channel.env()}
        envs = {
            ranks.local_rank: {**worker_env(ranks, context, os.environ), **extra_env}
            for ranks in self._ranks
        }
        attempt_dir = self._new_attempt_dir()
        self._pcontext = start_processes(
            name=spec.role,
            entrypoint=spec.entrypoint,
            args=dict.fromkeys(envs, spec.args),
            envs=envs,
            log_dir=attempt_dir,
            start_method=self._start_method,
            redirects=spec.redirects,
            tee=self._tee(),
            shutdown_timeout=spec.shutdown_timeout,
            log_line_prefixes=self._log_line_prefixes(),
        )
        self._node_progress = NodeProgress(time.time())
        if self._console_is_relaunchs():
            self._console.add_source(self._node_bar)
        pids = self._pcontext.pids()
        for worker, pid in zip(group.workers, pids.values(), strict=True):
            worker.id = pid
        stdouts, stderrs = self._pcontext.stdouts, self._pcontext.stderrs
        log_files = {
            rank: [path for path in (stdouts.get(rank), stderrs.get(rank)) if path] for rank in pids
        }
        self._watchdog.watch(pids, log_files, self._pcontext.running, self._channel.progress)
        group.state = WorkerState.HEALTHY

    def _new_attempt_dir(self) -> str:
        """``attempt_{n}`` for restart ``n``; a group re-formed after a membership change (which
        uses no restart) gets ``attempt_{n}.1``, ``.2``, ...: no log is ever replaced."""
        base = os.path.join(self._log_dir, f"attempt_{self.restart_count}")
        path, reformed = base, 0
        while True:
            try:
                os.makedirs(path)
                return path
            except FileExistsError:
                reformed += 1
                path = f"{base}.{reformed}"

    def _console_is_relaunchs(self) -> bool:
        """Whether no worker writes to the console itself: only then can relaunch draw on it
        (a bar drawn where workers write straight to the terminal would collide with them)."""
        spec = self._worker_group.spec
        redirects = per_rank(spec.redirects, spec.local_world_size)
        tee = per_rank(self._tee(), spec.local_world_size)
        return all(redirects[rank] | tee[rank] == Std.ALL for rank in redirects)

    def _log_line_prefixes(self) -> dict[int, str]:
        """Prefixes from torchrun's ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` (``${role_name}``,
        ``${rank}``, ``${local_rank}``), or none (the default ``[{role}{local_rank}]:``)."""
        template = os.environ.get(LOG_LINE_PREFIX_TEMPLATE_ENV)
        if not template:
            return {}
        role = self._worker_group.spec.role
        return {
            worker.local_rank: template.replace("${role_name}", role)
            .replace("${rank}", str(worker.global_rank))
            .replace("${local_rank}", str(worker.local_rank))
            for worker in self._worker_group.workers
        }

    def _tee(self) -> Std | dict[int, Std]:
        """The spec's tee; with a hang timeout, streams left on the console are tee'd too, so
        that their output counts as a sign of life and a hung worker's stack is on file."""
        spec = self._worker_group.spec
        if self._watchdog.hang_timeout is None:
            return spec.tee
        redirects = per_rank(spec.redirects, spec.local_world_size)
        return {
            rank: Std(std | (Std.ALL & ~redirects[rank]))
            for rank, std in per_rank(spec.tee, spec.local_world_size).items()
        }

    def _stop_workers(self, death_sig: signal.Signals) -> None:
        if self._pcontext is not None:
            self._pcontext.close(death_sig, self._worker_group.spec.shutdown_timeout)
            self._last_outcome = self._pcontext.wait(0)
            if self._channel is not None:
                self._last_progress = {
                    rank: self._channel.progress(rank) for rank in range(self._channel.slots)
                }
            self._console.remove_source(self._node_bar)  # prints the bar's final state

    def _node_bar(self) -> dict[str, bytes]:
        """The per-node bar (a ``Console`` bar source): the slowest local rank's progress."""
        channel, tracker = self._channel, self._node_progress
        if channel is None or tracker is None:
            return {}
        now = time.time()
        try:
            tracker.update({rank: channel.progress(rank) for rank in range(channel.slots)}, now)
        except ValueError:  # the channel was closed under us: the run is over
            return {}
        line = tracker.line(now)
        if line is None:
            return {}
        group = self._worker_group
        return {"node": f"[{group.spec.role} node {group.group_rank}]:{line}".encode()}

    def summary(self, outcome: str) -> RunSummary:
        """The end-of-run summary of the last attempt, for a run that ended with ``outcome``."""
        result = self._last_outcome
        ranks = []
        for worker in self._worker_group.workers:
            local = worker.local_rank
            exitcode = None if result is None else result.exitcodes.get(local)
            duration = 0.0 if result is None else result.durations.get(local, 0.0)
            stopped = result is not None and local in result.stopped
            ranks.append(
                RankEnd(
                    worker.global_rank,
                    local,
                    exitcode,
                    duration,
                    "stopped by relaunch" if stopped else "",
                )
            )
        return RunSummary(
            outcome,
            time.monotonic() - self._started_at,
            ranks,
            list(self._restart_reasons),
            self._log_dir,
            self._stop_note,
        )

    # -- events -------------------------------------------------------------------------------

    def _event(self, source: EventSource, state: WorkerState, **fields: Any) -> None:
        group = self._worker_group
        spec = group.spec
        self._event_handler.record(
            status_event(
                source=source,
                state=state.value,
                run_id=spec.rdzv_handler.get_run_id(),
                role=spec.role,
                hostname=os.uname().nodename,
                rdzv_backend=spec.rdzv_handler.get_backend(),
                group_rank=group.group_rank,
                agent_restarts=self.restart_count,
                total_run_time=int(time.monotonic() - self._started_at),
                group_world_size=group.group_world_size,
                entry_point=spec.get_entrypoint_name(),
                **fields,
            )
        )

    def _record_agent_event(self, state: WorkerState, raw_error: str | None = None) -> None:
        self._event(EventSource.AGENT, state, raw_error=raw_error)

    def _record_run_events(self, result: RunResult) -> None:
        for worker in self._worker_group.workers:
            failure = result.failures.get(worker.global_rank)
            if failure is not None:
                state, raw = (
                    WorkerState.FAILED,
                    json.dumps(failure.error_file_data or {"message": failure.message}),
                )
            elif worker.global_rank in result.stopped:
                state, raw = WorkerState.STOPPED, None
            else:
                state, raw = result.state, None
            progress = self._last_progress.get(worker.local_rank)
            self._event(
                EventSource.WORKER,
                state,
                global_rank=worker.global_rank,
                worker_id=None if worker.id is None else str(worker.id),
                raw_error=raw,
                local_rank=worker.local_rank,
                role_rank=worker.role_rank,
                role_world_size=worker.role_world_size,
                progress=None
                if progress is None
                else {"step": progress.step, "total": progress.total, "desc": progress.desc},
            )
        self._record_agent_event(result.state)


def _one_line(failures: Mapping[int, ProcessFailure]) -> str:
    """The root cause of a failed attempt in one line: rank, how it ended, the first line why."""
    rank = root_cause_rank(failures)
    failure = failures[rank]
    why = failure.message.splitlines()[0] if failure.message else ""
    if len(why) > 160:
        why = why[:157] + "..."
    return f"rank {rank} {describe_exit(failure.exitcode)}" + (f": {why}" if why else "")
