"""The elastic agent: rendezvous, start the local workers, watch them, restart them as one.

``LocalElasticAgent.run`` is the driver: it observes (the workers' end, a membership change, a
presence check's answer, a hang, the time), asks ``core.run.step`` what follows, and acts through
the job's services (``rendezvous.job``), its workers (``agent.workers``: each attempt started from
its plan, ``core.workers.attempt``) and its sinks (``agent.sinks``). Between steps it sleeps on one
event queue until an event or the next deadline, on its ``runtime.Clock``; only a job that cannot
push membership changes is asked for them, every ``monitor_interval``.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from relaunch.agent.agent_args import AgentArguments, agent_arguments, events_of, placement_of
from relaunch.agent.expiry import ExpiryWatch, timers_enabled_by_env
from relaunch.agent.goodput import GoodputMarks
from relaunch.agent.health import HealthCheck
from relaunch.agent.join import join
from relaunch.agent.metrics import AgentMetrics
from relaunch.agent.report import RunReport, finished
from relaunch.agent.sinks import LogSink, MetricPuts, Sinks
from relaunch.agent.spec import DEFAULT_ROLE, RunResult, WorkerGroup, WorkerSpec
from relaunch.agent.state import StateNotAgreed
from relaunch.agent.status import NodeReporter
from relaunch.agent.workers import Workers
from relaunch.core.run import step_types as actions
from relaunch.core.run.restart import Backoff
from relaunch.core.run.run_events import Failed, Joined, RestartCosted, Started, StragglerFlagged
from relaunch.core.run.settings import (
    HangSettings,
    HealthSettings,
    MetricsEndpoint,
    RestartPolicy,
    agent_groups,
)
from relaunch.core.run.step import Rules, RunRecord, step
from relaunch.core.run.summary import RunSummary
from relaunch.core.workers.state_settings import StateSettings
from relaunch.events import EventHandler, Metrics, NullMetricHandler
from relaunch.procs.context import PContext, start_processes
from relaunch.procs.errors import SignalException, StopRequested
from relaunch.procs.guardian import guardian
from relaunch.procs.logs_specs import LogsSpecs, OwnPlan, make_log_dir, own_plan
from relaunch.procs.signals import raise_untaken_signal, take_signal
from relaunch.procs.wakeup import EventQueue
from relaunch.rendezvous.api import AgentFault, JobFailedError, RendezvousClosedError
from relaunch.rendezvous.job import JobServices, job_of
from relaunch.runtime import SYSTEM_CLOCK, THREAD_FAILURES, Clock, FailureWatch, ThreadFailed

if TYPE_CHECKING:
    from relaunch.core.workers.placement import Placement

log = logging.getLogger(__name__)

#: An agent keeps its workers' state as ``core.workers.state``'s defaults say, unless told
#: otherwise.
KEEP_STATE = StateSettings()


class LocalElasticAgent:
    """Runs ``spec.local_world_size`` workers on this host as one unit, restarting the whole group
    on failure while ``spec.max_restarts`` allow, and when nodes wait to join (for free).

    The first SIGTERM/SIGINT (``StopRequested``) asks the workers to stop
    (``relaunch.stop_requested``) and waits up to ``spec.shutdown_timeout`` for them. Status
    events go to ``event_handler``, metrics to ``metrics``; ``events`` is accepted for
    compatibility. ``timers``: a file timer server for ``relaunch.timer.expires`` (default:
    ``TORCHELASTIC_ENABLE_FILE_TIMER=1``); ``hang_timeout``: a worker silent that long is hung,
    as is one past its ``relaunch.section`` or ``relaunch.heartbeat`` deadline (every node's
    ranks then give their stacks). A crash loop waits ``restart_backoff`` between restarts and
    stops after ``max_stalled_restarts`` without progress. ``exit_barrier_timeout`` bounds the
    wait of a node whose workers finished for the others'; ``health_check`` runs before every
    join; ``start_processes`` starts each group; ``metrics_port`` (0: a free one, then
    ``metrics_port_bound``) serves Prometheus metrics on ``metrics_host`` (``ConfigError`` here
    when it cannot be bound); ``placement`` gives local ranks variables and CPUs; ``clock``
    times every deadline (a ``runtime.ManualClock`` in tests). ``state``: how the workers'
    ``relaunch.save_state`` is kept (``agent.state``; None: not at all). ``preload``: modules a
    zygote imports once, from which each Python worker is forked (``procs.zygote``).
    ``restart_policy``, ``hang``, ``health``, ``metrics_endpoint`` (``core.run.settings``): the
    settings groups, each in place of its flat keywords above.

    Two forms, told apart by the 2nd argument. torch 2.13's: ``LocalElasticAgent(spec,
    logs_specs, start_method="spawn", exit_barrier_timeout=300, log_line_prefix_template=None,
    shutdown_timeout=None)`` (torch's ``health_check_server`` and
    ``uninterruptible_state_timeout`` must be None): each attempt's logs go where
    ``logs_specs`` says (a ``DefaultLogsSpecs``: under ``{log_dir}/{run_id}_XXXX/attempt_N/``),
    and ``spec.redirects``/``spec.tee`` must be left out (``logs_specs`` holds them). The
    seeds': ``LocalElasticAgent(spec, start_method="spawn", exit_barrier_timeout=300,
    log_dir=None, events=None)``, which logs as
    ``DefaultLogsSpecs(log_dir, spec.redirects, spec.tee)``. ``log_line_prefix_template``
    (torch's; a keyword in the seeds' form) makes each rank's console prefix from
    ``${role_name}``, ``${rank}`` and ``${local_rank}``.
    """

    #: False once the run failed for a reason that running the job again cannot mend.
    requeue = True
    #: How long the last join took (placed in a round, after any wait to be admitted).
    rendezvous_seconds = 0.0
    _started_once = False  # a group of workers was started

    def __init__(
        self,
        spec: WorkerSpec,
        *positional: Any,
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
        clock: Clock = SYSTEM_CLOCK,
        state: StateSettings | None = KEEP_STATE,
        preload: tuple[str, ...] = (),
        restart_policy: RestartPolicy | None = None,
        hang: HangSettings | None = None,
        health: HealthSettings | None = None,
        metrics_endpoint: MetricsEndpoint | None = None,
        **form_keywords: Any,
    ) -> None:
        # The settings groups, or their flat keywords (the compatibility form), as groups.
        restart_policy, hang, health, metrics_endpoint = agent_groups(
            (restart_policy, hang, health, metrics_endpoint), dict(locals())
        )
        arguments = agent_arguments(spec, positional, form_keywords)
        self._clock, self._events = clock, arguments.events
        logs = self._set_up_run(arguments, restart_policy, hang, health, event_handler)
        self._workers = self._workers_of(
            arguments, logs, start_processes, placement, state, preload
        )
        self._sinks = self._make_sinks(metrics)
        self.metrics_port_bound = self._bind_metrics(metrics_endpoint.host, metrics_endpoint.port)

    def _set_up_run(
        self,
        arguments: AgentArguments,
        restart_policy: RestartPolicy,
        hang: HangSettings,
        health: HealthSettings,
        event_handler: EventHandler | None,
    ) -> OwnPlan | LogsSpecs:
        """The run's group, job, rules, report, expiry watch and status posts; where each
        attempt's logs go."""
        spec, clock = arguments.spec, self._clock
        group = self._worker_group = WorkerGroup(spec)
        job = self._job = _job_of(spec)
        self._exit_barrier_timeout = arguments.exit_barrier_timeout
        # run before every join (``agent.join``)
        self._health_check = (
            None
            if health.command is None
            else HealthCheck(health.command, health.timeout, health.cooldown)
        )
        rules = _rules(spec, job, restart_policy.rule, restart_policy.max_stalled)
        self._run_record = RunRecord(rules)
        self._log_dir, logs = _logs(arguments.logs_specs, spec.rdzv_handler.get_run_id())
        events = events_of(spec) if event_handler is None else event_handler
        self._report = RunReport(group, events, self._log_dir, clock)
        self._expiry = _expiry_watch(spec, hang.timers, hang.timeout, clock)
        self._reporter = self._node_reporter(hang.straggler_factor, hang.evict_stragglers)
        return logs

    def _workers_of(
        self,
        arguments: AgentArguments,
        logs: OwnPlan | LogsSpecs,
        start_processes: Callable[..., PContext],
        placement: Placement | None,
        state: StateSettings | None,
        preload: tuple[str, ...],
    ) -> Workers:
        """The agent's workers (``agent.workers``), attempt after attempt."""
        return Workers(
            self._worker_group,
            start_processes,
            arguments.start_method,
            placement_of(self._worker_group.spec, placement),
            logs=logs,
            log_line_prefix_template=arguments.log_line_prefix_template,
            expiry=self._expiry,
            reporter=self._reporter,
            report=self._report,
            job=self._job,
            clock=self._clock,
            state=state,
            preload=preload,
        )

    def _bind_metrics(self, host: str, port: int | None) -> int | None:
        """The port the Prometheus metrics are served on (None: not served); ``ConfigError``
        when it cannot be bound."""
        return None if port is None else self._exporter.bind(host, port)

    def _node_reporter(self, straggler_factor: float, evict_after: float | None) -> NodeReporter:
        """The status posts of this node (``agent.status``), which flag stragglers and, after
        ``evict_after`` seconds (None: never), evict one to a spare."""
        group = self._worker_group
        return NodeReporter(
            straggler_factor,
            lambda node: self._sinks.on_run_event(StragglerFlagged(node, self.restart_count)),
            node_state=lambda: group.state.value,
            restarts_used=lambda: self.restart_count,
            clock=self._clock,
            evict_after=evict_after,
        )

    def _make_sinks(self, metrics: Metrics | None) -> Sinks:
        """Where what happens is told, each run event once (``agent.sinks``); the order is that
        of their lines on a shared stderr, the goodput marks last (a restart's cost, told when
        the workers started, follows their start)."""
        group, clock = self._worker_group, self._clock
        self._exporter = AgentMetrics(
            group, self._reporter, self._workers.sampler.latest, lambda: self.restart_count, clock
        )
        metric_puts = MetricPuts(metrics or Metrics(NullMetricHandler(), group="torchelastic"))
        self._goodput = GoodputMarks(
            clock, lambda cost: self._sinks.on_run_event(RestartCosted(cost))
        )
        return Sinks(
            [self._report, self._exporter, metric_puts, self._reporter, LogSink(log), self._goodput]
        )

    @property
    def log_dir(self) -> str:
        return self._log_dir

    def get_worker_group(self, role: str = DEFAULT_ROLE) -> WorkerGroup:
        return self._worker_group

    @property
    def restart_count(self) -> int:
        """Group restarts the job has used (every node's, with a shared rendezvous store)."""
        return self._run_record.used

    def summary(self, outcome: str) -> RunSummary:
        """The end-of-run summary of the last attempt, for a run that ended with ``outcome``."""
        return self._report.summary(outcome)

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """Run the workers to the end; a ``SignalException`` stops them with that signal first."""
        self._report.started_at = self._clock.monotonic()
        take_signal(None)
        wakeups = EventQueue[str]()
        # A helper thread's failure (``runtime.start_thread``) wakes the loop, which ends the run.
        failures = THREAD_FAILURES.watch(lambda: wakeups.put("a thread failed"))
        self._workers.open(wakeups)
        self._job.set_change_listener(lambda *_: wakeups.put("membership changed"))
        self._expiry.start(lambda: wakeups.put("a timer expired"))
        self._exporter.start()
        workers = self._workers
        try:
            try:
                result = self._drive(failures, wakeups)
            except StopRequested as exc:
                raise workers.stop_gracefully(exc) from None
            except ThreadFailed as exc:
                raise AgentFault(str(exc)) from None
            workers.stop(signal.SIGTERM)
        except BaseException as exc:
            take_signal(exc)
            workers.stop(exc.sigval if isinstance(exc, SignalException) else signal.SIGTERM)
            if isinstance(exc, AgentFault):
                # This agent cannot go on (a helper thread failed, the store holds a bad value):
                # the job ends on every node, each saying why, rather than re-forming around it.
                self._job.fail_job(str(exc))
            said = str(exc) if isinstance(exc, (AgentFault, SignalException)) else None
            self._sinks.on_run_event(Failed(self.restart_count, said))
            raise
        finally:
            self._goodput.end()
            failures.close()
            self._exporter.close()
            self._job.set_change_listener(None)
            workers.close()
            self._expiry.close()
            wakeups.close()
        self._sinks.on_run_event(finished(self._worker_group, result, self.restart_count))
        return result

    def _drive(self, failures: FailureWatch, wakeups: EventQueue[str]) -> RunResult:
        """Observe, step, act, until an action ends the run; a helper thread's failure
        (``ThreadFailed``) ends it whenever the agent looks."""
        observation: actions.Observation = actions.Began()
        while True:
            self._run_record, planned = step(self._run_record, observation, self._clock.monotonic())
            answer: actions.Observation | None = None
            for action in planned:
                done = self._act(action, wakeups)
                if isinstance(done, RunResult):
                    return done
                answer = answer if done is None else done
            observation = self._look(failures) if answer is None else answer

    def _look(self, failures: FailureWatch) -> actions.Observation:
        """How the workers and the job stand now."""
        failures.check()
        dumping = self._expiry.dumping()
        if dumping and self._workers.still_running():
            return actions.StacksPending(dumping)
        outcome = self._workers.poll()
        # A helper thread reports its failure before its effect shows: a worker monitor that
        # failed killed the workers and ended the group, and that end is not theirs to judge.
        failures.check()
        ended = self._workers.ended()
        failing = self._workers.failing() if outcome is None else None
        job = self._job
        failed = (outcome is not None and outcome.is_failed()) or failing is not None
        used = job.restarts_used(self._run_record.spent) if failed else None
        change = job.membership_change() if job.watches_membership else None
        if failed or change is not None:
            self._goodput.seen()
        self._workers.look_back(self._goodput)
        return actions.Observed(ended, change, used, failing)

    def _act(
        self, action: actions.Action, wakeups: EventQueue[str]
    ) -> actions.Observation | RunResult | None:
        """Perform ``action``: an observation when it answers one, the result when it ends."""
        job, workers = self._job, self._workers
        match action:
            case actions.Rendezvous(backoff=backoff):
                return self._rendezvous(backoff)
            case actions.StartWorkers():
                try:
                    workers.start(self.restart_count)
                except StateNotAgreed as exc:
                    return actions.NotAgreed(str(exc))
                self._sinks.on_run_event(Started(self.restart_count, self.rendezvous_seconds))
                self._started_once = True
                return actions.WorkersStarted()
            case actions.StopWorkers(park=park):
                workers.stop(signal.SIGTERM, park=park)
            case actions.CheckStore():
                job.check_store()
            case actions.CheckPresence(timeout=timeout):
                alive = job.peers_alive(timeout)
                return actions.PeersAnswered(alive, job.membership_change())  # one may have come
            case actions.TakeStacks(reason=reason):
                self._expiry.dump_stacks(reason)
            case actions.CheckHangs(until=until):  # acts on hung workers; when to look again
                check_in = self._expiry.check(self._run_record.restarts_left)
                return actions.HangsChecked(self._expiry.hang, check_in, until)
            case actions.Wait(until=until):
                raise_untaken_signal()  # one that a ``__del__`` or an ``except`` swallowed
                wakeups.get(None if until is None else max(0.0, until - self._clock.monotonic()))
            case actions.StopForStacks(reason=reason):
                job.stop_for_stacks(reason)
            case actions.FailJob(reason=reason, stacks=stacks, requeue=requeue):
                job.fail_job(reason, stacks=stacks, requeue=requeue)
            case actions.NoteRestart(reason=reason):
                job.note_restart(reason)
            case actions.LeaveRound():
                job.leave_early()
            case actions.ReportFailure():
                log.warning("%s", workers.failure_report())
            case actions.LogLine(text=text, error=error):
                log.log(logging.ERROR if error else logging.WARNING, "%s", text)
            case actions.StopNote(text=text):
                self._report.stop_note = text
            case actions.Announce(run_event=run_event):
                self._sinks.on_run_event(run_event)
            case actions.Succeed():
                result = workers.succeeded()
                # Keep heartbeating until every live node is done, so an early finisher is not
                # mistaken for a lost node; then close the job to latecomers.
                job.exit_barrier(self._exit_barrier_timeout)
                self._worker_group.spec.rdzv_handler.set_closed()
                return result
            case actions.Fail(requeue=requeue):
                self.requeue = requeue
                return workers.failed()
            case actions.EndedElsewhere(message=message, requeue=requeue):
                raise JobFailedError(message, requeue)
        return None

    def _rendezvous(self, backoff: float) -> actions.Observation:
        """Leave the running round, wait out a crash loop's backoff, an exclusion and a failing
        health check, and join the next round."""
        group, job, spent = self._worker_group, self._job, self._run_record.spent
        if self._started_once:
            self._workers.leaving(self._goodput)
        try:
            self.rendezvous_seconds = join(
                job, group, self._health_check, backoff, self.restart_count, self._clock
            )
            self._sinks.on_run_event(Joined(self.rendezvous_seconds))
            used = job.restarts_used(spent)
        except RendezvousClosedError:
            if self._run_record.reforming is None:
                raise  # the job had finished before this node joined
            failure = job.closing_failure()
            if failure is None and job.evicted is not None:  # a spare in its cooldown: dismissed
                raise RendezvousClosedError(
                    f"the job {group.spec.rdzv_handler.get_run_id()!r} finished while this node "
                    "was out of it, evicted as a straggler"
                ) from None
            if failure is None:
                return actions.JobClosed()
            return actions.JobClosed(failure.reason, failure.requeue)
        return actions.Placed(group.group_world_size or 1, used)


def _rules(spec: WorkerSpec, job: JobServices, backoff: Backoff | None, max_stalled: int) -> Rules:
    """The restart policy's rules for ``spec``'s group in ``job``."""
    return Rules(
        role=spec.role,
        node=os.uname().nodename,
        max_restarts=spec.max_restarts,
        watches_membership=job.watches_membership,
        polls_membership=job.watches_membership and not job.pushes_changes,
        monitor_interval=spec.monitor_interval,
        lost_node_grace=job.lost_node_grace,
        backoff=backoff or Backoff(),
        max_stalled=max_stalled,
    )


def _logs(logs_specs: LogsSpecs, run_id: str) -> tuple[str, OwnPlan | LogsSpecs]:
    """The run's log directory, and who plans each attempt's: relaunch (``OwnPlan``) or a
    user's ``LogsSpecs`` (its reify decides each attempt's paths; its root is all we know)."""
    own = own_plan(logs_specs)
    if own is None:
        return logs_specs.root_log_dir, logs_specs
    return make_log_dir(own.root, run_id), own


def _job_of(spec: WorkerSpec) -> JobServices:
    """The job's services for ``spec``'s rendezvous; should this agent die on a live machine,
    its orphan guardian tells the others."""
    job = job_of(spec.rdzv_handler)
    job.leave_death_notice_with(lambda line: guardian().set_death_notice(line))
    return job


def _expiry_watch(
    spec: WorkerSpec, timers: bool | None, hang_timeout: float | None, clock: Clock
) -> ExpiryWatch:
    """Expiry timers (default: ``TORCHELASTIC_ENABLE_FILE_TIMER=1``) and hang detection."""
    timers = timers_enabled_by_env() if timers is None else timers
    return ExpiryWatch(spec.rdzv_handler.get_run_id(), timers, hang_timeout, clock)
