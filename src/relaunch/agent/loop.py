"""The elastic agent: rendezvous, start the local workers, watch them, restart them as one.

``LocalElasticAgent.run`` is the one driver: it asks the rendezvous handler for this node's
place, plans every worker's ranks and environment (``core.ranks``), starts them through the
process layer, and lets the restart policy (``core.restart``) decide what comes next. Between
decisions it sleeps on one event queue, woken by the end of the workers, a membership change,
a signal, or the next deadline (hang detection, the grace given a lost node). Only a rendezvous
handler that cannot report membership changes is asked for them, every ``monitor_interval``.

The restart budget is the job's, not this agent's: the handler counts the group restarts every
node spent (``restarts_used``). With none left, a failure in a group of several nodes is final
at once when every other node answers a roll call (``peers_alive``), and then ends the job for
every node (``fail_job``); while one does not answer, it may be dead, and the agent waits the
grace for its loss to be noticed, which re-forms the group for free.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from relaunch.agent.attempts import Attempts
from relaunch.agent.channel import Channel
from relaunch.agent.expiry import ExpiryWatch, timers_enabled_by_env
from relaunch.agent.health import HealthCheck, await_admission, check_env
from relaunch.agent.metrics import AgentMetrics
from relaunch.agent.report import NodeBar, RunReport, finished, make_log_dir, new_attempt_dir
from relaunch.agent.sampler import Sampler
from relaunch.agent.sinks import LogSink, MetricPuts, Sinks
from relaunch.agent.spec import DEFAULT_ROLE, RunResult, WorkerGroup, WorkerSpec, WorkerState
from relaunch.agent.status import Group, NodeReporter
from relaunch.core.console_plan import (
    LOG_LINE_PREFIX_TEMPLATE_ENV,
    agent_tee,
    console_is_relaunchs,
    log_line_prefixes,
    relayed,
)
from relaunch.core.defaults import DEFAULT_EXIT_BARRIER_TIMEOUT
from relaunch.core.durations import seconds
from relaunch.core.failures import format_report
from relaunch.core.group import GroupState
from relaunch.core.happenings import (
    AttemptEnded,
    Failed,
    Hung,
    Joined,
    Restarted,
    Started,
    StragglerFlagged,
)
from relaunch.core.ranks import GroupContext, worker_env
from relaunch.core.restart import Action, Backoff, RestartDecision, decide
from relaunch.core.summary import RunSummary
from relaunch.events import EventHandler, Metrics, NullEventHandler, NullMetricHandler
from relaunch.procs.console import console_for
from relaunch.procs.context import PContext, RunProcsResult, start_processes
from relaunch.procs.errors import SignalException, StopRequested
from relaunch.procs.wakeup import EventQueue
from relaunch.rendezvous.api import (
    AgentFault,
    JobFailedError,
    RendezvousClosedError,
)
from relaunch.rendezvous.job import job_of
from relaunch.runtime import THREAD_FAILURES, FailureWatch, ThreadFailed

if TYPE_CHECKING:
    from relaunch.core.placement import Placement

log = logging.getLogger(__name__)

#: Seconds the other nodes have to answer a roll call before one of them may be dead.
ROLL_CALL_TIMEOUT = 1.0
_CUT_SHORT = "this node's workers were stopped before they finished"


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
    ``start_processes`` starts each group (a seam for tests). ``exit_barrier_timeout`` bounds
    how long a node whose workers finished waits for the others' before it closes the job.
    ``health_check`` runs before every join; a node whose check fails waits and tries again.

    A worker past the deadline of its ``relaunch.section`` or ``relaunch.heartbeat`` is hung:
    every local rank is asked for its stack, the other nodes are asked for theirs through the
    rendezvous, and the group restarts. Restarts of a crash loop wait ``restart_backoff``; after
    ``max_stalled_restarts`` restarts in a row that made no progress the job stops.

    With ``metrics_port`` (0: a free one, then ``metrics_port_bound``) the agent serves
    Prometheus metrics on ``metrics_host`` ("": every interface) while it runs
    (``agent.metrics``); a port it cannot bind raises ``ConfigError`` here.

    ``placement`` (``relaunch.placement``) gives local ranks variables (``CUDA_VISIBLE_DEVICES``)
    and CPUs to run on.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        start_method: str = "spawn",
        exit_barrier_timeout: float = DEFAULT_EXIT_BARRIER_TIMEOUT,
        log_dir: str | None = None,
        events: object = None,
        *,
        event_handler: EventHandler | None = None,
        metrics: Metrics | None = None,
        timers: bool | None = None,
        hang_timeout: float | None = None,
        restart_backoff: Backoff | None = None,
        max_stalled_restarts: int = 3,
        straggler_factor: float = 1.5,
        health_check: HealthCheck | None = None,
        start_processes: Callable[..., PContext] = start_processes,
        metrics_port: int | None = None,
        metrics_host: str = "",
        placement: Placement | None = None,
    ) -> None:
        self._worker_group = WorkerGroup(spec)
        self._job = job_of(spec.rdzv_handler)
        self._placement = placement
        self._start_method = start_method
        self._exit_barrier_timeout = exit_barrier_timeout
        self._events = events
        self._metrics = metrics or Metrics(NullMetricHandler(), group="torchelastic")
        self._start_processes = start_processes
        self._health_check = health_check  # run before every join (``agent.health``)
        self._spent = 0  # group restarts this node's failures asked for
        self._used = 0  # group restarts the job has used, as the handler last told
        self._peers_alive: bool | None = None  # the roll call's outcome, this round
        self._pcontext: PContext | None = None
        self._log_dir = make_log_dir(log_dir, spec.rdzv_handler.get_run_id())
        self._report = RunReport(
            self._worker_group, event_handler or NullEventHandler(), self._log_dir
        )
        self._expiry = ExpiryWatch(
            spec.rdzv_handler.get_run_id(),
            timers_enabled_by_env() if timers is None else timers,
            hang_timeout,
        )
        self._channel: Channel | None = None
        self._wakeups: EventQueue[str] | None = None
        self._thread_failures: FailureWatch | None = None
        self._explained: RunProcsResult | None = None
        self._grace_ends: float | None = None
        self._console = console_for(sys.stdout, sys.stderr)
        self._attempts = Attempts(restart_backoff or Backoff(), max_stalled_restarts)
        # The workers' channel and processes, read once per tick for every reader.
        self._sampler = Sampler()
        self._reporter = NodeReporter(
            straggler_factor,
            lambda straggler: self._sinks.happened(
                StragglerFlagged(straggler, straggler_factor, self.restart_count)
            ),
            node_state=lambda: self._worker_group.state.value,
            restarts_used=lambda: self.restart_count,
        )
        self._node_bar = NodeBar(
            self._worker_group, self._sampler.latest, lambda: self._reporter.job_line
        )
        self._hang_told = False
        self._exporter = AgentMetrics(
            self._worker_group, self._reporter, self._sampler.latest, lambda: self.restart_count
        )
        # Where what happens is told, each happening once (``agent.sinks``).
        self._sinks = Sinks(
            [self._report, self._exporter, MetricPuts(self._metrics), self._reporter, LogSink(log)]
        )
        self.metrics_port_bound: int | None = None
        if metrics_port is not None:
            self.metrics_port_bound = self._exporter.bind(metrics_host, metrics_port)
        #: How long the last join took (placed in a round, after any wait to be admitted).
        self.rendezvous_seconds = 0.0

    @property
    def log_dir(self) -> str:
        return self._log_dir

    def get_worker_group(self, role: str = DEFAULT_ROLE) -> WorkerGroup:
        return self._worker_group

    @property
    def restart_count(self) -> int:
        """Group restarts the job has used (every node's, with a shared rendezvous store)."""
        return self._used

    @property
    def _restarts_left(self) -> int:
        return max(0, self._worker_group.spec.max_restarts - self._used)

    def summary(self, outcome: str) -> RunSummary:
        """The end-of-run summary of the last attempt, for a run that ended with ``outcome``."""
        return self._report.summary(outcome)

    # -- the run loop -------------------------------------------------------------------------

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """Run the workers to the end; a ``SignalException`` stops them with that signal first."""
        self._report.started_at = time.monotonic()
        self._wakeups = wakeups = EventQueue[str]()
        # A helper thread's failure (``runtime.start_thread``) wakes the loop, which ends the run.
        self._thread_failures = THREAD_FAILURES.watch(lambda: wakeups.put("a thread failed"))
        self._channel = Channel(
            self._worker_group.spec.local_world_size,
            on_first_use=self._workers_speak,
        )
        self._job.set_change_listener(lambda *_: wakeups.put("membership changed"))
        self._expiry.start()
        self._exporter.start()
        try:
            try:
                result = self._invoke_run()
            except StopRequested as exc:
                raise self._stop_gracefully(exc) from None
            except ThreadFailed as exc:
                raise AgentFault(str(exc)) from None
            self._stop_workers(signal.SIGTERM)
        except AgentFault as exc:
            # This agent cannot go on (a helper thread failed, the store holds a bad value):
            # the job ends on every node, each saying why, rather than re-forming around it.
            self._stop_workers(signal.SIGTERM)
            self._job.fail_job(str(exc))
            self._sinks.happened(Failed(self.restart_count, str(exc)))
            raise
        except SignalException as exc:
            self._stop_workers(exc.sigval)
            self._sinks.happened(Failed(self.restart_count, str(exc)))
            raise
        except BaseException:
            self._stop_workers(signal.SIGTERM)
            self._sinks.happened(Failed(self.restart_count))
            raise
        finally:
            self._thread_failures.close()
            self._exporter.close()
            self._job.set_change_listener(None)
            self._console.remove_source(self._node_bar)
            self._expiry.close()
            self._channel.close()
            wakeups.close()
        self._sinks.happened(finished(self._worker_group, result, self.restart_count))
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
            self._report.stop_note = f"{again.sigval.name} again: the workers were stopped at once"
            return again
        if outcome is not None and not outcome.is_failed():
            note = "the workers stopped cleanly after the stop request (all exited 0)"
        elif outcome is not None:
            note = "the workers stopped after the stop request, some of them failing"
        else:
            running = len(pcontext.running())
            note = (
                f"{running} worker(s) did not stop within "
                f"{seconds(spec.shutdown_timeout)} of the request and were sent "
                f"{request.sigval.name}"
            )
        self._report.stop_note = note
        return request

    def _invoke_run(self) -> RunResult:
        group = self._worker_group
        spec = group.spec
        role = spec.role
        self._rendezvous()
        self._start_workers()
        while True:
            self._check_threads()
            dumping = self._expiry.dumping()
            if dumping and self._pcontext is not None and self._pcontext.wait(0) is None:
                self._sleep(time.monotonic() + dumping)  # let every stack be written first
                continue
            outcome, decision = self._next_decision()
            self._sampler.observed(outcome)
            if decision.stacks and self._expiry.dump_stacks(decision.reason):
                continue
            if decision.action in (Action.CONTINUE, Action.AWAIT_CHANGE):
                self._sleep(decision.deadline)
                continue
            state = GroupState.RUNNING if outcome is None else _state_of(outcome)
            self._sinks.happened(AttemptEnded(role, state.value, self._restarts_left))
            if decision.action is Action.SUCCEED:
                assert outcome is not None
                group.state = WorkerState.SUCCEEDED
                # Keep heartbeating until every live node is done, so an early finisher is not
                # mistaken for a lost node; then close the job to latecomers.
                self._job.exit_barrier(self._exit_barrier_timeout)
                spec.rdzv_handler.set_closed()
                return RunResult(
                    WorkerState.SUCCEEDED,
                    return_values=group.by_global_rank(outcome.return_values),
                )
            if decision.action is Action.FAIL:
                # A worker of another node hung, and this node's ranks gave their stacks.
                elsewhere = decision.stacks and self._expiry.hang is None
                if elsewhere and outcome is not None and outcome.is_failed():
                    self._log_report(outcome)  # where this node's ranks were
                if outcome is None or not outcome.is_failed() or elsewhere:
                    raise JobFailedError(f"{decision.reason}; {_CUT_SHORT}")
                return self._fail_job(outcome)
            reason = decision.reason
            delay = 0.0
            if outcome is not None and outcome.is_failed():
                self._log_report(outcome)
                assert self._channel is not None
                reason = self._attempts.cause(group, outcome, self._channel)
                stalled, delay = self._attempts.failed(self._channel)
                if stalled is not None:
                    log.error("[%s] %s", role, stalled)
                    self._report.stop_note = stalled
                    return self._fail_job(outcome, stalled)
            # The workers stop before anything is said: if the store's host is gone with the
            # store, the job ends here, and no restart was said or counted.
            self._stop_workers(signal.SIGTERM)
            self._job.check_store()
            restarts_left = self._restarts_left
            if decision.uses_restart:
                self._spent += 1
                restarts_left -= 1
            cause = "hang" if self._expiry.hang is not None else decision.cause
            self._sinks.happened(
                Restarted(role, cause, reason, decision.reason, self.restart_count, restarts_left)
            )
            if decision.uses_restart:  # the other nodes restart because of this: say why
                self._job.note_restart(f"{os.uname().nodename}: {reason}")
            if delay:
                log.warning(
                    "[%s] a crash loop: waiting %s before restart %d in a row "
                    "(--restart-backoff %g:%g)",
                    role,
                    seconds(delay),
                    self._attempts.loop.in_a_row,
                    self._attempts.backoff.base,
                    self._attempts.backoff.cap,
                )
            try:
                self._rendezvous(backoff=delay)
            except RendezvousClosedError:
                if outcome is None or not outcome.is_failed():
                    # Its workers were stopped mid-run to re-form, and the job ended without
                    # them (another node failed, or its exit barrier timed out).
                    raise JobFailedError(
                        f"the job ended while this node re-formed ({decision.reason}); {_CUT_SHORT}"
                    ) from None
                # The other nodes finished the job meanwhile: this node's failure stands.
                return self._failed(outcome)
            self._start_workers()

    def _next_decision(self) -> tuple[RunProcsResult | None, RestartDecision]:
        """How the workers stand (None: running) and what the restart policy makes of it."""
        assert self._pcontext is not None
        outcome = self._pcontext.wait(0)
        # A helper thread reports its failure before its effect shows: a worker monitor that
        # failed killed the workers and ended the group, and that end is not theirs to judge.
        self._check_threads()
        if outcome is not None and outcome.is_failed() and outcome is not self._explained:
            self._explained = outcome
            self._expiry.explain(outcome.failures, self._pcontext.stderrs)
        watching = self._job.watches_membership
        # A group of one node has no other node to lose: its failure is final at once.
        alone = (self._worker_group.group_world_size or 1) <= 1
        failed = outcome is not None and outcome.is_failed()
        if failed:
            self._used = self._job.restarts_used(self._spent)
        change = self._job.membership_change() if watching else None
        if (
            failed
            and change is None
            and self._restarts_left == 0
            and watching
            and not alone
            and self._grace_ends is None
        ):
            self._peers_alive = self._job.peers_alive(ROLL_CALL_TIMEOUT)
            change = self._job.membership_change()  # one may have come during the roll call
        decision = decide(
            GroupState.RUNNING if outcome is None else _state_of(outcome),
            self._restarts_left,
            change,
            lost_node_grace=self._job.lost_node_grace if watching and not alone else 0.0,
            now=time.monotonic(),
            grace_ends=self._grace_ends,
            peers_alive=self._peers_alive,
        )
        if decision.action is Action.AWAIT_CHANGE and self._grace_ends is None:
            log.warning(
                "workers failed with no restart left, and not every other node answered: "
                "waiting up to %s for a lost node to be noticed",
                seconds(self._job.lost_node_grace),
            )
        self._grace_ends = decision.deadline
        return outcome, decision

    def _sleep(self, deadline: float | None) -> None:
        """Wait for the next event: the workers ended, the membership changed, a signal came,
        hang detection is due, or ``deadline`` (``time.monotonic``) passed."""
        assert self._wakeups is not None
        waits = []
        check_in = self._expiry.check()  # acts on hung workers; when to look again
        self._tell_hang()
        if check_in is not None:
            waits.append(check_in)
        if deadline is not None:
            waits.append(deadline - time.monotonic())
        if self._polls_membership():
            waits.append(self._worker_group.spec.monitor_interval)
        self._wakeups.get(max(0.0, min(waits)) if waits else None)

    def _check_threads(self) -> None:
        """Raise the failure of a helper thread (``ThreadFailed``), if one failed."""
        if self._thread_failures is not None:
            self._thread_failures.check()

    def _workers_speak(self) -> None:
        """A worker used the channel for the first time (from the channel's thread): deadlines
        may need watching, steps sampling."""
        assert self._wakeups is not None
        self._wakeups.put("a worker used the channel")
        self._reporter.notice_reports()

    def _tell_hang(self) -> None:
        """A local rank hung: ask the other nodes for their ranks' stacks at once, restarting
        with this node (one of the job's restarts), or ending the job with none left."""
        hang = self._expiry.hang
        if hang is None or self._hang_told:
            return
        self._hang_told = True
        self._sinks.happened(Hung(self.restart_count, hang))
        if not self._job.watches_membership or (self._worker_group.group_world_size or 1) <= 1:
            return
        reason = f"{os.uname().nodename}: {hang}"
        if self._restarts_left > 0:
            self._job.stop_for_stacks(reason)
        else:
            self._job.fail_job(f"{reason} (no restart left)", stacks=True)

    def _log_report(self, outcome: RunProcsResult) -> None:
        """The failure report of a failed group, in this agent's log."""
        group = self._worker_group
        log.warning(
            "%s",
            format_report(
                group.spec.role,
                group.by_global_rank(outcome.failures),
                os.uname().nodename,
                group.by_global_rank(outcome.stopped),
            ),
        )

    def _polls_membership(self) -> bool:
        """Whether the handler watches membership but cannot report changes (it kept the default
        ``set_change_listener``): then it is asked every ``monitor_interval``."""
        return self._job.watches_membership and not self._job.pushes_changes

    def _fail_job(self, outcome: RunProcsResult, why: str = "no restart left") -> RunResult:
        """This node's failure is final: end the job for every node, and return it."""
        assert self._channel is not None
        cause = self._attempts.cause(self._worker_group, outcome, self._channel)
        reason = f"{os.uname().nodename}: {cause} ({why})"
        self._job.fail_job(reason)
        return self._failed(outcome)

    def _failed(self, outcome: RunProcsResult) -> RunResult:
        group = self._worker_group
        group.state = WorkerState.FAILED
        return RunResult(
            WorkerState.FAILED,
            failures=group.by_global_rank(outcome.failures),
            stopped=sorted(group.by_global_rank(outcome.stopped)),
        )

    # -- the steps ----------------------------------------------------------------------------

    def _rendezvous(self, backoff: float = 0.0) -> None:
        spec = self._worker_group.spec
        handler = spec.rdzv_handler
        # Leave the running round; wait out a crash loop's backoff, an exclusion and a failing
        # health check.
        env = check_env(spec.local_world_size, handler.get_run_id(), spec.role, self._used)
        await_admission(self._job, handler.get_run_id(), self._health_check, env, backoff)
        began = time.monotonic()
        self._worker_group.join(handler.next_rendezvous())
        self.rendezvous_seconds = time.monotonic() - began
        self._sinks.happened(Joined(self.rendezvous_seconds))
        self._peers_alive = None
        self._used = self._job.restarts_used(self._spent)

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
        assert self._channel is not None and self._wakeups is not None
        self._channel.reset()
        extra_env = {**self._expiry.worker_env(), **self._channel.env()}
        placement = self._placement
        envs = {
            ranks.local_rank: {
                **worker_env(ranks, context, os.environ),
                **(placement.env(ranks.local_rank) if placement else {}),
                **extra_env,
            }
            for ranks in group.ranks
        }
        nprocs = spec.local_world_size
        hang, terminals = self._expiry.hang_timeout is not None, self._console.terminals()
        tee = agent_tee(spec.tee, spec.redirects, nprocs, hang, terminals)
        relay = relayed(spec.redirects, tee, nprocs, terminals, hang)
        # Only a relay that does something is passed: a start_processes given by the user
        # (torch's, say) knows no such argument.
        extra: dict[str, object] = {"relay": relay} if any(relay.values()) else {}
        if placement is not None and placement.cpus():
            extra["cpu_affinity"] = placement.cpus()
        self._pcontext = self._start_processes(
            name=spec.role,
            entrypoint=spec.entrypoint,
            args=dict.fromkeys(envs, spec.args),
            envs=envs,
            log_dir=new_attempt_dir(self._log_dir, self.restart_count),
            start_method=self._start_method,
            redirects=spec.redirects,
            tee=tee,
            shutdown_timeout=spec.shutdown_timeout,
            log_line_prefixes=log_line_prefixes(
                os.environ.get(LOG_LINE_PREFIX_TEMPLATE_ENV),
                spec.role,
                ((worker.local_rank, worker.global_rank) for worker in group.workers),
            ),
            **extra,
        )
        wakeups = self._wakeups
        self._pcontext.add_done_callback(lambda: wakeups.put("workers ended"))
        self._sampler.watch(self._channel, self._pcontext)
        self._node_bar.restart()
        if console_is_relaunchs(spec.redirects, tee, nprocs, relay):
            self._console.add_source(self._node_bar)
        pids = self._pcontext.pids()
        for worker, pid in zip(group.workers, pids.values(), strict=True):
            worker.id = pid
        stdouts, stderrs = self._pcontext.stdouts, self._pcontext.stderrs
        log_files = {
            rank: [path for path in (stdouts.get(rank), stderrs.get(rank)) if path] for rank in pids
        }
        self._expiry.watch(
            pids,
            log_files,
            self._sampler.take,
            # A start_processes given by the user (torch's, say) has no such method.
            getattr(self._pcontext, "hold_group_stop", lambda: None),
        )
        self._attempts.started()
        self._hang_told = False
        self._reporter.start(
            Group(
                getattr(spec.rdzv_handler, "identity", "") or os.uname().nodename,
                group.group_rank,
                group.group_world_size,
                {worker.local_rank: worker.global_rank for worker in group.workers},
                self._sampler.latest,
            ),
            self._job,
        )
        group.state = WorkerState.HEALTHY
        self._sinks.happened(Started(self.restart_count, self.rendezvous_seconds))

    def _stop_workers(self, death_sig: signal.Signals) -> None:
        self._reporter.stop()
        if self._pcontext is not None:
            dumping = self._expiry.dumping()
            if dumping:  # ranks asked for their stacks: let them write them before the signal
                self._pcontext.wait(dumping)
            self._pcontext.close(death_sig, self._worker_group.spec.shutdown_timeout)
            self._report.last_outcome = self._pcontext.wait(0)
            self._sampler.observed(self._report.last_outcome)
            if self._channel is not None:
                self._report.last_progress = self._sampler.take().progresses()
            self._console.remove_source(self._node_bar)  # prints the bar's final state


def _state_of(outcome: RunProcsResult) -> GroupState:
    return GroupState.FAILED if outcome.is_failed() else GroupState.SUCCEEDED
