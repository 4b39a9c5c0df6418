"""The agent's hands on its workers: start an attempt from its plan (``core.workers.attempt``), read
how it ended, and stop it, at once (in the order ``core.run.stop_plan`` says) or, on a stop request,
after the workers had their chance to stop themselves (``agent.graceful``).

``core.workers.attempt`` decides what each rank gets; this module does it (``core/X.py`` decides,
``agent/X.py`` does). The agent's driver (``agent.loop``) says when. What each feature adds
(kept state, the zygote, restarting in place, expiry timers, the progress posts) is an attempt
hook (``agent.hooks``), registered in ``agent.features``.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from relaunch.agent.channel import Channel
from relaunch.agent.command import command_of, group_context
from relaunch.agent.expiry import ExpiryWatch
from relaunch.agent.features import FEATURES
from relaunch.agent.goodput import GoodputMarks
from relaunch.agent.graceful import stop_gracefully
from relaunch.agent.hooks import AttemptHook, Run
from relaunch.agent.report import RunReport
from relaunch.agent.sampler import Sampler
from relaunch.agent.spec import RunResult, WorkerGroup, WorkerState
from relaunch.agent.status import NodeReporter
from relaunch.agent.user_start import adapt_start
from relaunch.core.run.failures import format_report
from relaunch.core.run.run_events import NodeSnapshot
from relaunch.core.run.step_types import Ended
from relaunch.core.run.stop_plan import Feature, StopPhase, stop_plan
from relaunch.core.sections import BOUNDS_ENV, Learned, encode_learned, merge
from relaunch.core.workers.attempt import plan_attempt
from relaunch.core.workers.state_settings import StateSettings
from relaunch.procs.console import console_for
from relaunch.procs.context import PContext, RunProcsResult
from relaunch.procs.errors import SignalException, StopRequested
from relaunch.procs.logs_specs import LogsSpecs, OwnPlan, new_attempt_dir
from relaunch.procs.wakeup import EventQueue
from relaunch.procs.worker_process import FailureGrace
from relaunch.rendezvous.job import JobServices
from relaunch.runtime import Clock

if TYPE_CHECKING:
    from relaunch.core.run.culprit import Verdict
    from relaunch.core.workers.placement import Placement
    from relaunch.procs.process_failure import ProcessFailure


class Workers:
    """The workers of one agent, attempt after attempt (``open`` once per run, then ``start``,
    ``poll`` and ``stop`` for each attempt). ``sampler`` reads their channel and processes once
    per tick for every reader (``agent.sampler``). ``logs``: where their logs go, planned here
    (``OwnPlan``: each attempt in a new directory of the report's ``log_dir``) or by a user's
    ``LogsSpecs``. ``start_processes``, when not relaunch's, is adapted once
    (``agent.user_start``)."""

    def __init__(
        self,
        group: WorkerGroup,
        start_processes: Callable[..., PContext],
        start_method: str,
        placement: Placement | None,
        *,
        logs: OwnPlan | LogsSpecs,
        log_line_prefix_template: str | None = None,
        expiry: ExpiryWatch,
        reporter: NodeReporter,
        report: RunReport,
        job: JobServices,
        clock: Clock,
        state: StateSettings | None = None,
        preload: tuple[str, ...] = (),
    ) -> None:
        self._group = group
        self._command = command_of(group.spec, logs, start_method, log_line_prefix_template)
        self._start, own_start = adapt_start(start_processes)
        self._placement = placement
        self.sampler = Sampler(clock)
        console = console_for(sys.stdout, sys.stderr)
        self._run = Run(
            group, job, clock, expiry, reporter, report, self.sampler, console, state, preload
        )
        self._run.own_start = own_start
        made = (feature(self._run) for feature in FEATURES)
        self._hooks: list[AttemptHook] = [hook for hook in made if hook is not None]
        self._wakeups: EventQueue[str] | None = None
        self._learned = Learned()  # the bounds the workers learned, kept for the next ones
        self._explained: RunProcsResult | None = None
        #: A hang's verdict on the attempt that failed (``agent.culprit``); "" when none.
        self.verdict: Verdict | None = None
        self._restart_count = 0
        self._outcome: RunProcsResult | None = None  # how the attempt ended, as last looked

    def open(self, wakeups: EventQueue[str]) -> None:
        """A run begins: its workers' channel, and the queue their end (and a first use of the
        channel, when deadlines may need watching) wakes."""

        def workers_speak() -> None:  # from the channel's thread
            wakeups.put("a worker used the channel")
            self._run.reporter.notice_reports()

        self._wakeups = wakeups
        local_world_size = self._group.spec.local_world_size
        self._run.channel = Channel(local_world_size, on_first_use=workers_speak)
        for hook in self._hooks:
            hook.open(self._run)

    def close(self) -> None:
        """The run is over: the node bar's final state, the channel gone, the kept state on
        disk (``--state-dir``) and out of memory."""
        for hook in self._hooks:
            hook.close()
        if self._run.channel is not None:
            self._run.channel.close()

    def start(self, restart_count: int) -> None:
        """Start the attempt of the group just joined (``restart_count`` restarts used)."""
        run, group, wakeups, hooks = self._run, self._group, self._wakeups, self._hooks
        channel = run.channel
        assert channel is not None and wakeups is not None, "start before open"
        channel.reset()
        self.verdict, self._restart_count = None, restart_count
        for hook in hooks:
            hook.starting(run)
        extra_env = {**channel.env(), **run.open_env}
        for hook in hooks:
            extra_env.update(hook.environment(run))
        # What the job's workers learned of their bounds: these are watched from the start.
        self._learned = run.job.share_learned(self._learned)
        if self._learned:
            extra_env[BOUNDS_ENV] = encode_learned(self._learned)
        plan = plan_attempt(
            self._command,
            group_context(group, restart_count, run.agent_store),
            group.ranks,
            os.environ,
            ""
            if self._command.logs_specs is not None
            else new_attempt_dir(run.report.log_dir, restart_count),
            extra_env=extra_env,
            placement=self._placement,
            terminals=run.console.terminals(),
            hang_detection=run.expiry.hang_timeout is not None,
        )
        start = self._start
        for hook in hooks:
            start = hook.wrap_start(run, start)
        run.pcontext = pcontext = start(**plan.start_arguments())
        pcontext.add_done_callback(lambda: wakeups.put("workers ended"))
        pcontext.add_failure_callback(self._worker_failed)
        self._set_failure_grace(pcontext)
        self.sampler.watch(channel, pcontext)
        run.draws_console = plan.draws_console
        for worker, pid in zip(group.workers, pcontext.pids().values(), strict=True):
            worker.id = pid
        group.state = WorkerState.HEALTHY  # before the hooks hear it: the first status post says so
        for hook in hooks:
            hook.started(run)

    def _worker_failed(self) -> None:  # from the monitor's thread: quick
        for hook in self._hooks:
            hook.worker_failed()
        assert self._wakeups is not None
        self._wakeups.put("a worker failed")

    def _set_failure_grace(self, pcontext: PContext) -> None:
        """What a worker's failure waits for before the others are stopped: the hooks' graces
        (the workers' saves, their parks), all of them."""
        made = (hook.grace(self._run) for hook in self._hooks)
        graces: list[FailureGrace] = [grace for grace in made if grace is not None]
        if len(graces) > 1:
            from relaunch.agent.parking import Graces  # sockets: not at import

            pcontext.set_failure_grace(Graces(*graces))
        elif graces:
            pcontext.set_failure_grace(graces[0])

    def poll(self) -> RunProcsResult | None:
        """How the attempt stands: None while its workers run."""
        assert self._run.pcontext is not None
        self._outcome = self._run.pcontext.wait(0)
        return self._outcome

    def still_running(self) -> bool:
        return self._run.pcontext is not None and self._run.pcontext.wait(0) is None

    def ended(self) -> Ended | None:
        """How the attempt polled last ended (None: it runs), for the step: a failure is
        explained once (why relaunch killed a worker), with what each rank said."""
        outcome = self._outcome
        self.sampler.observed(outcome)
        if outcome is None:
            return None
        snapshot = NodeSnapshot(0.0)
        if outcome.is_failed():
            if outcome is not self._explained:
                self._explained = outcome
                assert self._run.pcontext is not None
                self._run.expiry.explain(outcome.failures, self._run.pcontext.stderrs)
                if self._run.expiry.stacks_taken:
                    from relaunch.agent.culprit import judge_hang  # a hang: loaded then

                    self.verdict = judge_hang(self._run, outcome.failures, self._restart_count)
            snapshot = self.sampler.take()
        return self._by_global_rank(outcome.failures, snapshot)

    def failing(self) -> Ended | None:
        """The failures of an attempt whose workers are still being stopped because of them
        (None: none failed, or the attempt has ended: ``ended``)."""
        pcontext = self._run.pcontext
        if self._outcome is not None or pcontext is None:
            return None
        failures = pcontext.failures()
        return self._by_global_rank(failures, NodeSnapshot(0.0)) if failures else None

    def _by_global_rank(
        self, failures: Mapping[int, ProcessFailure], snapshot: NodeSnapshot
    ) -> Ended:
        """``failures`` (by local rank) as the step reads them: by global rank."""
        group = self._group
        return Ended(
            group.by_global_rank(failures),
            {worker.global_rank: worker.local_rank for worker in group.workers},
            snapshot,
        )

    def failure_report(self) -> str:
        """The failure report of the attempt that failed, for this agent's log, with what the
        hooks add (why the ranks lost torch's store, when the agent's server of it ended)."""
        group, outcome, pcontext = self._group, self._outcome, self._run.pcontext
        assert outcome is not None
        report = format_report(
            group.spec.get_entrypoint_name(),  # as the run's last report names it
            group.by_global_rank(outcome.failures),
            os.uname().nodename,
            group.by_global_rank(outcome.stopped),
            group.by_global_rank({} if pcontext is None else pcontext.kept()),
            self.verdict,
        )
        notes = [note for note in (hook.note() for hook in self._hooks) if note is not None]
        return "\n  ".join([report, *notes])

    def succeeded(self) -> RunResult:
        group, outcome = self._group, self._outcome
        assert outcome is not None
        group.state = WorkerState.SUCCEEDED
        return RunResult(
            WorkerState.SUCCEEDED, return_values=group.by_global_rank(outcome.return_values)
        )

    def failed(self) -> RunResult:
        group, outcome = self._group, self._outcome
        assert outcome is not None
        group.state = WorkerState.FAILED
        return RunResult(
            WorkerState.FAILED,
            failures=group.by_global_rank(outcome.failures),
            stopped=sorted(group.by_global_rank(outcome.stopped)),
            verdict=self.verdict,
        )

    def stop(self, death_sig: signal.Signals, *, park: bool = False) -> None:
        """Stop the workers with ``death_sig`` (then SIGKILL after the shutdown timeout), in
        the order ``core.run.stop_plan`` says: letting ranks asked for their stacks write them
        first, and, with ``park`` (the stop is for a failure that broke the group's
        collectives), giving ranks that restart in place time to park, kept for the next
        attempt."""
        run = self._run
        pcontext, timeout = run.pcontext, self._group.spec.shutdown_timeout

        def close() -> None:
            assert pcontext is not None
            pcontext.close(death_sig, timeout)

        phases: dict[StopPhase, Callable[[], None]] = {StopPhase.CLOSE: close}
        features: set[Feature] = set()
        for hook in self._hooks:
            phases.update(hook.stop_phases(run))
            features.update(hook.features())
        for phase in stop_plan(running=pcontext is not None, park=park, features=features):
            phases[phase]()

    def leaving(self, goodput: GoodputMarks) -> None:
        """The attempt is over, the next join comes: its moments to ``goodput``."""
        run = self._run
        if run.pcontext is None or run.channel is None:
            return
        self._learned = merge(self._learned, run.channel.learned())
        ranks = self._group.spec.local_world_size
        goodput.attempt_over(
            run.pcontext,
            run.channel,
            ranks,
            run.report.last_progress,
            run.saved_step(),
            run.expiry.hung_since(),
        )

    def look_back(self, goodput: GoodputMarks) -> None:
        """Whether the workers of a restart are back (``goodput.look``)."""
        if self._run.channel is not None:
            goodput.look(self._run.channel, self._group.spec.local_world_size)

    def stop_gracefully(self, request: StopRequested) -> SignalException:
        """Ask the workers to stop, give them ``shutdown_timeout`` seconds, then stop the rest
        (``agent.graceful``)."""
        run = self._run
        if run.pcontext is None or run.channel is None:
            return request
        spec = self._group.spec
        return stop_gracefully(
            request, run.channel, run.pcontext, spec.shutdown_timeout, run.report
        )
