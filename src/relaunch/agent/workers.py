"""The agent's hands on its workers: start an attempt from its plan (``core.attempt``), watch it
(hang detection, status posts, the node bar), read how it ended, and stop it, at once or, on a
stop request, after the workers had their chance to stop themselves.

``core.attempt`` decides what each rank gets; this module does it (``core/X.py`` decides,
``agent/X.py`` does). The agent's driver (``agent.loop``) says when.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import TYPE_CHECKING

from relaunch.agent.channel import Channel
from relaunch.agent.expiry import ExpiryWatch
from relaunch.agent.goodput import GoodputMarks
from relaunch.agent.report import NodeBar, RunReport
from relaunch.agent.sampler import Sampler
from relaunch.agent.spec import RunResult, WorkerGroup, WorkerState
from relaunch.agent.state import JustInTime, StateKeeper
from relaunch.agent.status import Group, NodeReporter
from relaunch.config import ConfigError
from relaunch.core.attempt import Command, plan_attempt
from relaunch.core.durations import seconds
from relaunch.core.failures import format_report
from relaunch.core.happenings import NodeSnapshot
from relaunch.core.ranks import GroupContext, omp_num_threads_default
from relaunch.core.sections import BOUNDS_ENV, Learned, encode_learned, merge
from relaunch.core.state_settings import StateSettings
from relaunch.core.step_types import Ended
from relaunch.procs.console import console_for
from relaunch.procs.context import PContext, RunProcsResult, start_processes
from relaunch.procs.errors import ProcessFailure, SignalException, StopRequested
from relaunch.procs.handles import PopenHandle, ProcessHandle
from relaunch.procs.logs_specs import LogsSpecs, OwnPlan, new_attempt_dir
from relaunch.procs.monitor import FailureGrace
from relaunch.procs.wakeup import EventQueue
from relaunch.rendezvous.job import JobServices
from relaunch.runtime import Clock

if TYPE_CHECKING:
    from relaunch.agent.parking import ParkingLot
    from relaunch.agent.torch_store import TorchStoreServer
    from relaunch.core.placement import Placement
    from relaunch.procs.zygote import Zygote

log = logging.getLogger(__name__)


class Workers:
    """The workers of one agent, attempt after attempt (``open`` once per run, then ``start``,
    ``poll`` and ``stop`` for each attempt). ``sampler`` reads their channel and processes once
    per tick for every reader (``agent.sampler``); the node bar shows them on the console.
    ``logs``: where their logs go, planned here (``OwnPlan``: each attempt in a new directory
    of the report's ``log_dir``) or by a user's ``LogsSpecs``."""

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
        spec = group.spec
        assert spec.entrypoint is not None
        self._group = group
        own = logs if isinstance(logs, OwnPlan) else None
        self._command = Command(
            spec.role,
            spec.entrypoint,
            spec.args,
            spec.local_world_size,
            own.redirects if own else spec.redirects,
            own.tee if own else spec.tee,
            start_method,
            spec.shutdown_timeout,
            own.local_ranks_filter if own else None,
            log_line_prefix_template,
            None if own else logs,
            tuple(spec.duplicate_stdout_filters or ()),
            tuple(spec.duplicate_stderr_filters or ()),
        )
        self._start_processes = start_processes
        self._placement = placement
        self._expiry, self._reporter, self._report, self._job = expiry, reporter, report, job
        self._clock = clock
        self.sampler = self._sampler = Sampler(clock)
        self._node_bar = NodeBar(group, self._sampler.latest, lambda: reporter.job_line, clock)
        self._console = console_for(sys.stdout, sys.stderr)
        self._channel: Channel | None = None
        self._learned = Learned()  # the bounds the workers learned, kept for the next ones
        self._state_settings = state
        self.state: StateKeeper | None = None
        #: ``--preload``: the modules, and the zygote that forks the workers (``open`` starts it).
        self._preload = preload
        self.zygote: Zygote | None = None
        #: torch's store, served while this node is group rank 0 (``--preload torch``).
        self._torch_store: TorchStoreServer | None = None
        self._wakeups: EventQueue[str] | None = None
        #: Where ranks that restart in place wait (``agent.parking``), and those kept, by
        #: local rank, for the next attempt.
        self._lot: ParkingLot | None = None
        self._kept: dict[int, PopenHandle | ProcessHandle] = {}
        self._pcontext: PContext | None = None
        self._explained: RunProcsResult | None = None
        self._outcome: RunProcsResult | None = None  # how the attempt ended, as last looked
        self._failure_told = False  # this attempt's workers were told of a failure

    def open(self, wakeups: EventQueue[str]) -> None:
        """A run begins: its workers' channel, and the queue their end (and a first use of the
        channel, when deadlines may need watching) wakes."""

        def workers_speak() -> None:  # from the channel's thread
            wakeups.put("a worker used the channel")
            self._reporter.notice_reports()

        self._wakeups = wakeups
        self._channel = Channel(self._group.spec.local_world_size, on_first_use=workers_speak)
        if isinstance(self._group.spec.entrypoint, str):  # a function's return would be lost
            from relaunch.agent.parking import ParkingLot, parking_path  # sockets: not at import

            lot = ParkingLot(
                parking_path(self._channel.path), self._keep, self._worker_pids, self._park_wait
            )
            self._lot = lot
        if self._state_settings is not None:
            job = self._job
            self.state = StateKeeper(
                self._state_settings, job.local_addr, job.peer_key, self._channel
            )
        if self._preload:
            self.zygote = self._start_zygote({**self._channel.env(), **self._lot_env()})
        if self.zygote is not None:
            from relaunch.agent.torch_store import TorchStoreServer, serves_torch_store

            if serves_torch_store(self._preload):
                self._torch_store = TorchStoreServer(self.zygote)

    def close(self) -> None:
        """The run is over: the node bar's final state, the channel gone, the kept state on
        disk (``--state-dir``) and out of memory."""
        self._console.remove_source(self._node_bar)
        if self._kept:
            from relaunch.agent.parking import let_go

            for handle in self._kept.values():
                let_go(handle)
            self._kept.clear()
        if self._lot is not None:
            self._lot.close()
        if self._channel is not None:
            self._channel.close()
        if self.state is not None:
            self.state.close()
        if self._torch_store is not None:
            self._torch_store.stop()
        if self.zygote is not None:
            self.zygote.close()

    def start(self, restart_count: int) -> None:
        """Start the attempt of the group just joined (``restart_count`` restarts used)."""
        group, command = self._group, self._command
        channel, wakeups, lot = self._channel, self._wakeups, self._lot
        assert channel is not None and wakeups is not None, "start before open"
        channel.reset()
        self._failure_told = False
        store_server = self._torch_store if group.group_rank == 0 else None
        if store_server is not None:  # before the state record lets other nodes start theirs
            assert group.master_port is not None
            store_server.bind(group.master_port)
        extra_env = {} if self.state is None else self.state.env(self._resume_step())
        agent_store = self._torch_store is not None
        if store_server is not None:
            # Where it cannot be served, worker rank 0 serves it (as without --preload torch).
            assert group.master_addr is not None and group.master_port is not None
            with _bad_preload_is_bad_input():
                agent_store = store_server.serve(group.master_addr, group.master_port)
        # What the job's workers learned of their bounds: these are watched from the start.
        self._learned = self._job.share_learned(self._learned)
        if self._learned:
            extra_env[BOUNDS_ENV] = encode_learned(self._learned)
        plan = plan_attempt(
            command,
            self._context(restart_count, agent_store),
            group.ranks,
            os.environ,
            new_attempt_dir(self._report.log_dir, restart_count)
            if command.logs_specs is None
            else "",
            extra_env={
                **self._expiry.worker_env(),
                **channel.env(),
                **self._lot_env(),
                **extra_env,
            },
            placement=self._placement,
            terminals=self._console.terminals(),
            hang_detection=self._expiry.hang_timeout is not None,
        )
        arguments = plan.start_arguments()
        if lot is not None:  # the pids of the workers are not known until they are started
            lot.starting()
        if self._kept and lot is not None:
            from relaunch.agent.parking import Parked

            kept, self._kept = self._kept, {}
            arguments["resumes"] = {rank: Parked(handle, lot) for rank, handle in kept.items()}
        if self.zygote is None:
            self._pcontext = pcontext = self._start_processes(**arguments)
        else:
            with _bad_preload_is_bad_input():
                self._pcontext = pcontext = self._start_processes(**arguments, zygote=self.zygote)
        if lot is not None:  # the kept ranks have their attempt: a park must be explained again
            lot.new_attempt()
        pcontext.add_done_callback(lambda: wakeups.put("workers ended"))
        if hasattr(pcontext, "add_failure_callback"):  # not a start_processes of the user's
            state = self.state

            def a_worker_failed() -> None:  # from the monitor's thread: quick
                if state is not None:  # the CPU is the restart's now, not a copy's
                    state.hold_copies()
                wakeups.put("a worker failed")

            pcontext.add_failure_callback(a_worker_failed)
        if self.state is not None:
            self.state.prune()
        if hasattr(pcontext, "set_failure_grace"):
            self._set_failure_grace(pcontext, channel, lot)
        self._sampler.watch(channel, pcontext)
        self._node_bar.restart()
        if plan.draws_console:
            self._console.add_source(self._node_bar)
        pids = pcontext.pids()
        for worker, pid in zip(group.workers, pids.values(), strict=True):
            worker.id = pid
        stdouts, stderrs = pcontext.stdouts, pcontext.stderrs
        log_files = {
            rank: [path for path in (stdouts.get(rank), stderrs.get(rank)) if path] for rank in pids
        }
        self._expiry.watch(
            pids,
            log_files,
            self._sampler.take,
            # A start_processes given by the user (torch's, say) has no such method.
            getattr(pcontext, "hold_group_stop", lambda: None),
            self._save_just_in_time,
        )
        spec = group.spec
        assert group.group_rank is not None and group.group_world_size is not None
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

    def _lot_env(self) -> dict[str, str]:
        return {} if self._lot is None else self._lot.env()

    def _set_failure_grace(
        self, pcontext: PContext, channel: Channel, lot: ParkingLot | None
    ) -> None:
        """What a worker's failure waits for before the others are stopped: their saves
        (``JustInTime``), their parks (``ParkGrace``), or both."""
        from relaunch.agent.parking import Graces, ParkGrace

        graces: list[FailureGrace] = []
        if self.state is not None:
            graces.append(JustInTime(self.state, channel, self.state.jit_save_timeout))
        if lot is not None:
            graces.append(ParkGrace(lot, pcontext.pids))
        if graces:
            pcontext.set_failure_grace(graces[0] if len(graces) == 1 else Graces(*graces))

    def _start_zygote(self, channel_env: dict[str, str]) -> Zygote | None:
        """The zygote of ``--preload``, started (it imports while the agent joins), with the
        launcher's environment and what every worker gets on top of it; None (said) when the
        workers are no Python script or module, or are started by a user's start_processes."""
        from relaunch.procs.zygote import Zygote, python_command  # sockets: only with --preload

        spec = self._group.spec
        modules = ",".join(self._preload)
        command = None
        if isinstance(spec.entrypoint, str):
            command = python_command([spec.entrypoint, *map(str, spec.args)])
        if command is None:
            log.warning("--preload %s: the workers are no Python script or module: cold", modules)
            return None
        if self._start_processes is not start_processes:
            log.warning("--preload %s: a start_processes of your own starts them cold", modules)
            return None
        omp = omp_num_threads_default(spec.local_world_size, os.environ)
        env = {
            **os.environ,
            **self._expiry.worker_env(),
            **channel_env,
            **({} if omp is None else {"OMP_NUM_THREADS": omp}),
        }
        zygote = Zygote(self._preload, command, env)
        zygote.start()
        return zygote

    def _resume_step(self) -> int | None:
        """The step the attempt's workers resume from (``load_state``), agreed by every node."""
        group, state = self._group, self.state
        assert state is not None and group.group_rank is not None
        assert group.group_world_size is not None
        return state.agree(
            self._job,
            group.group_rank,
            group.group_world_size,
            {worker.local_rank: worker.global_rank for worker in group.workers},
            group.workers[0].world_size if group.workers else 0,
        )

    def _context(self, restart_count: int, agent_store: bool) -> GroupContext:
        """What every worker of the group just joined shares (``agent_store``: torch's store
        is served by an agent, not by worker rank 0)."""
        group, spec = self._group, self._group.spec
        assert group.group_rank is not None and group.group_world_size is not None
        assert group.master_addr is not None and group.master_port is not None
        return GroupContext(
            role=spec.role,
            run_id=spec.rdzv_handler.get_run_id(),
            group_rank=group.group_rank,
            group_world_size=group.group_world_size,
            local_world_size=spec.local_world_size,
            master_addr=group.master_addr,
            master_port=group.master_port,
            restart_count=restart_count,
            max_restarts=spec.max_restarts,
            use_agent_store=agent_store,
        )

    def poll(self) -> RunProcsResult | None:
        """How the attempt stands: None while its workers run."""
        assert self._pcontext is not None
        self._outcome = self._pcontext.wait(0)
        return self._outcome

    def still_running(self) -> bool:
        return self._pcontext is not None and self._pcontext.wait(0) is None

    def ended(self) -> Ended | None:
        """How the attempt polled last ended (None: it runs), for the step: a failure is
        explained once (why relaunch killed a worker), with what each rank said."""
        outcome = self._outcome
        self._sampler.observed(outcome)
        if outcome is None:
            return None
        snapshot = NodeSnapshot(0.0)
        if outcome.is_failed():
            if outcome is not self._explained:
                self._explained = outcome
                assert self._pcontext is not None
                self._expiry.explain(outcome.failures, self._pcontext.stderrs)
            snapshot = self._sampler.take()
        return self._by_global_rank(outcome.failures, snapshot)

    def failing(self) -> Ended | None:
        """The failures of an attempt whose workers are still being stopped because of them
        (None: none failed, or the attempt has ended: ``ended``)."""
        pcontext = self._pcontext
        if self._outcome is not None or pcontext is None or not hasattr(pcontext, "failures"):
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
        """The failure report of the attempt that failed, for this agent's log (and why the
        ranks lost torch's store, when the agent's server of it ended first)."""
        group, outcome = self._group, self._outcome
        assert outcome is not None
        pcontext = self._pcontext
        kept = pcontext.kept() if pcontext is not None and hasattr(pcontext, "kept") else {}
        report = format_report(
            group.spec.role,
            group.by_global_rank(outcome.failures),
            os.uname().nodename,
            group.by_global_rank(outcome.stopped),
            group.by_global_rank(kept),
        )
        store_lost = None if self._torch_store is None else self._torch_store.ended()
        return report if store_lost is None else f"{report}\n  {store_lost}"

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
        )

    def stop(self, death_sig: signal.Signals, *, park: bool = False) -> None:
        """Stop the workers with ``death_sig`` (then SIGKILL after the shutdown timeout),
        letting ranks asked for their stacks write them first. ``park``: the stop is for a
        failure that broke the group's collectives, and ranks that restart in place are
        given time to park (``_park_wait``), and kept for the next attempt."""
        self._reporter.stop()
        if self._pcontext is not None:
            self._save_just_in_time()
            dumping = self._expiry.dumping()
            if dumping:  # ranks asked for their stacks: let them write them before the signal
                self._pcontext.wait(dumping)
            if park:
                self._wait_for_parks()
            self._pcontext.close(death_sig, self._group.spec.shutdown_timeout)
            if hasattr(self._pcontext, "kept"):
                self._kept = self._pcontext.kept()
            if self._torch_store is not None:
                self._torch_store.stop()
            if self.state is not None:
                self.state.hold_copies()
            if self.zygote is not None:
                self.zygote.revive()  # one that died imports again while the agent rejoins
            self._report.last_outcome = self._pcontext.wait(0)
            self._sampler.observed(self._report.last_outcome)
            if self._channel is not None:
                self._report.last_progress = self._sampler.take().progresses()
            self._console.remove_source(self._node_bar)  # prints the bar's final state

    def _worker_pids(self) -> set[int]:
        """The pids of this agent's workers now (from the lot's thread): the attempt's running
        ones, and those kept for the next."""
        pcontext, kept = self._pcontext, self._kept
        pids = {handle.pid for handle in list(kept.values())}
        if pcontext is not None:
            running = pcontext.running()
            pids.update(pid for rank, pid in pcontext.pids().items() if rank in running)
        return pids

    def _keep(self, pid: int) -> None:
        """The rank of ``pid`` parked, and a stop for a failure is under way: keep it."""
        pcontext = self._pcontext
        if pcontext is None or not hasattr(pcontext, "keep"):
            return
        for rank, rank_pid in pcontext.pids().items():
            if rank_pid == pid:
                pcontext.keep(rank)

    def _park_wait(self) -> float:
        """How long parks are waited for (``agent.parking.park_wait``): by this attempt's
        slowest rank's step."""
        from relaunch.agent.parking import park_wait

        channel = self._channel
        ranks = range(self._group.spec.local_world_size)
        slowest = 0.0 if channel is None else max(channel.step_seconds(r) for r in ranks)
        return park_wait(slowest)

    def _wait_for_parks(self) -> None:
        """The job restarts for a failure: keep the ranks that park within ``_park_wait``."""
        pcontext, lot = self._pcontext, self._lot
        if pcontext is None or lot is None or not hasattr(pcontext, "keep"):
            return
        parkable = lot.parkable(pcontext.pids(), pcontext.running())
        if parkable:
            lot.explain()
            lot.wait_parked(parkable.values(), lot.wait())

    def _save_just_in_time(self, hung: Collection[int] = ()) -> None:
        """Before running workers are stopped because another node's failed, or asked for
        their stacks because a rank (``hung``, here) is hung: tell them (``failure_pending``)
        and give those that listen, ``hung`` aside, up to ``--jit-save-timeout`` seconds to
        ``save_state``; once an attempt. (A failure of this node's own workers is told from
        the monitor: ``agent.state.JustInTime``.)"""
        channel, pcontext, state = self._channel, self._pcontext, self.state
        if channel is None or pcontext is None or state is None or not state.jit_save_timeout:
            return
        if self._failure_told:
            return
        self._failure_told = True
        listening = channel.failure_listeners(set(pcontext.running()) - set(hung))
        if not listening:
            return
        missing = state.wait_for_saves(
            listening, pcontext.running, state.jit_save_timeout, channel.announce_failure
        )
        if missing:
            log.warning(
                "local rank(s) %s did not save within --jit-save-timeout %s of the failure notice",
                ",".join(map(str, sorted(missing))),
                seconds(state.jit_save_timeout),
            )

    def leaving(self, goodput: GoodputMarks) -> None:
        """The attempt is over, the next join comes: its moments to ``goodput``."""
        pcontext, channel = self._pcontext, self._channel
        if pcontext is None or channel is None:
            return
        self._learned = merge(self._learned, channel.learned())
        outcome = pcontext.wait(0)
        failed = {} if outcome is None else outcome.failures
        ranks = range(self._group.spec.local_world_size)
        seconds_a_step = max((channel.step_seconds(rank) for rank in ranks), default=0.0)
        # A start_processes given by the user (torch's, say) has no exit_times.
        exit_times: dict[int, float] = getattr(pcontext, "exit_times", dict)()
        saved = None if self.state is None else self.state.newest_saved_step()
        goodput.leaving(exit_times, failed, self._report.last_progress, seconds_a_step, saved)

    def look_back(self, goodput: GoodputMarks) -> None:
        """Whether the workers of a restart are back (``goodput.look``)."""
        if self._channel is not None:
            goodput.look(self._channel, self._group.spec.local_world_size)

    def stop_gracefully(self, request: StopRequested) -> SignalException:
        """Ask the workers to stop, give them ``shutdown_timeout`` seconds, then stop the rest.

        Only when a running worker listens (has called ``stop_requested()``); otherwise the
        workers are stopped at once, as by torchrun. Returns the exception to end the run with:
        the request, or a second signal.
        """
        spec = self._group.spec
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


@contextlib.contextmanager
def _bad_preload_is_bad_input() -> Iterator[None]:
    """What the zygote cannot import (``PreloadError``) is the user's mistake: ``ConfigError``."""
    from relaunch.procs.zygote import PreloadError  # sockets: only with --preload

    try:
        yield
    except PreloadError as exc:
        raise ConfigError(str(exc)) from None
