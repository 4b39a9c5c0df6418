"""``PContext``: a group of worker processes started, watched and stopped as one unit.

The base of both kinds of context; ``procs.context`` has the kinds (functions, binaries) and
``start_processes``, which picks one.
"""

from __future__ import annotations

import abc
import atexit
import logging
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

from relaunch.core.defaults import DEFAULT_SHUTDOWN_TIMEOUT
from relaunch.core.workers.rank_io import RankIO
from relaunch.procs.console import console_for
from relaunch.procs.console_writer import ProgbarEvents
from relaunch.procs.descendants import kill_marked, new_token, with_token
from relaunch.procs.errors import ERROR_FILE_ENV
from relaunch.procs.group_result import (
    RunProcsResult,
    monitor_failure_result,
    unloadable,
    worker_failure,
)
from relaunch.procs.guardian import guardian
from relaunch.procs.handles import (
    PopenHandle,
    ProcessHandle,
    StuckWorker,
    signal_tree,
    wait_groups_gone,
)
from relaunch.procs.monitor import KILL_DEADLINE, GroupMonitor
from relaunch.procs.rank_streams import RankStreams
from relaunch.procs.signals import SignalsToExceptions, notices_ignored
from relaunch.procs.worker_process import FailureGrace, WorkerProcess
from relaunch.runtime import SYSTEM_CLOCK, Clock

if TYPE_CHECKING:
    from relaunch.procs.duplicates import FilteredCopy
    from relaunch.procs.process_failure import ProcessFailure

log = logging.getLogger(__name__)


#: Seconds ``close`` waits for SIGKILLed descendants to die (one stuck in the kernel may not).
TREE_KILL_WAIT = 2.0

#: Contexts started and not yet closed. At interpreter exit their workers are killed (as the
#: guardian would do a moment later), before multiprocessing's exit hook waits for its children.
_open_contexts: weakref.WeakSet[PContext] = weakref.WeakSet()


@atexit.register
def _close_open_contexts() -> None:
    for context in list(_open_contexts):
        context.close(signal.SIGKILL, timeout=0)


class PContext(abc.ABC):
    """A group of worker processes started, watched and stopped as one unit.

    ``rank_io`` says, for each local rank, where its streams go (see ``plan_rank_io``);
    ``stdouts``/``stderrs``, ``tee_stdouts``/``tee_stderrs`` and ``error_files`` show it as the
    seed's per-rank maps. When one worker fails, the others are sent SIGTERM, then SIGKILL after
    ``shutdown_timeout`` seconds. ``clock`` timestamps the workers' exits. ``cpu_affinity``
    binds some local ranks to CPUs (``procs.affinity``).
    """

    def __init__(
        self,
        name: str,
        entrypoint: Callable[..., Any] | str,
        args: Mapping[int, tuple[Any, ...]],
        envs: Mapping[int, Mapping[str, str]],
        rank_io: Mapping[int, RankIO],
        progbar_events: ProgbarEvents | None = None,
        *,
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
        clock: Clock = SYSTEM_CLOCK,
        cpu_affinity: Mapping[int, frozenset[int]] | None = None,
    ) -> None:
        self.name = name
        self.entrypoint = entrypoint
        self.args = dict(args)
        self.envs = {rank: dict(env) for rank, env in envs.items()}
        self.rank_io = dict(rank_io)
        self.nprocs = len(self.args)
        #: The CPUs some local ranks are bound to (``--numa-binding``).
        self.cpu_affinity = dict(cpu_affinity or {})
        self._progbar_events = progbar_events
        self._shutdown_timeout = shutdown_timeout
        self._clock = clock
        self._signals = SignalsToExceptions()
        self._monitor: GroupMonitor | None = None
        self._result: RunProcsResult | None = None
        #: The ranks whose return value is still to be loaded (by ``wait``, in the caller's
        #: thread), and those loaded so far.
        self._unloaded: dict[int, WorkerProcess] = {}
        self._loaded: dict[int, Any] = {}
        self._settle_lock = threading.Lock()
        self._closed = False
        self._started_at = 0.0
        #: In the environment of every worker, hence of every descendant (procs.descendants).
        self._tree = new_token()

    #: Workers of the group before, kept to run this group in their own process (restarting
    #: in place), by local rank: ``start`` hands them their attempt rather than starting one.
    resumes: Mapping[int, Resume] = MappingProxyType({})

    #: torch's duplicate filters (``start_processes``): the files of the filtered copies of
    #: the tee'd stdouts and stderrs (None: none), and the copies by stream (True: stderr).
    filtered_stdout: str | None = None
    filtered_stderr: str | None = None
    copies: Mapping[bool, FilteredCopy] = MappingProxyType({})

    # -- the seed's per-rank maps, read from ``rank_io`` ---------------------------------------

    @property
    def stdouts(self) -> dict[int, str]:
        """Each rank's stdout log file, "" where stdout is inherited."""
        return {rank: io.stdout for rank, io in self.rank_io.items()}

    @property
    def stderrs(self) -> dict[int, str]:
        """Each rank's stderr log file, "" where stderr is inherited."""
        return {rank: io.stderr for rank, io in self.rank_io.items()}

    @property
    def tee_stdouts(self) -> dict[int, str]:
        """The ranks whose stdout log is also echoed to the console, with that log's path."""
        return {rank: io.stdout for rank, io in self.rank_io.items() if io.tee_stdout}

    @property
    def tee_stderrs(self) -> dict[int, str]:
        """The ranks whose stderr log is also echoed to the console, with that log's path."""
        return {rank: io.stderr for rank, io in self.rank_io.items() if io.tee_stderr}

    @property
    def error_files(self) -> dict[int, str]:
        """Where each rank reports its failure."""
        return {rank: io.error_file for rank, io in self.rank_io.items()}

    # -- what each kind of context supplies ----------------------------------------------------

    @abc.abstractmethod
    def _start_worker(
        self, local_rank: int, env: dict[str, str], stdout: int | None, stderr: int | None
    ) -> tuple[PopenHandle | ProcessHandle, Any]:
        """Start one worker writing to the descriptors ``stdout``/``stderr`` (None: inherit);
        return its handle and the read end of its result channel, if any."""

    def _return_value(self, worker: WorkerProcess, who: str) -> Any:
        """What ``worker`` (``who``, in a message) returned; called by ``wait`` in the caller's
        thread. An exception fails that rank with the exception's message."""
        return None

    # -- the life cycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start every worker. A worker that cannot be started stops those already running."""
        if self._monitor is not None:
            raise RuntimeError(f"{type(self).__name__} {self.name!r} was already started")
        self._signals.install()
        self._started_at = self._clock.time()
        sys.stdout.flush()
        sys.stderr.flush()
        orphans = guardian()
        orphans.register_tree(self._tree)
        console = console_for(sys.stdout, sys.stderr, self._progbar_events)
        workers: list[WorkerProcess] = []
        opened: RankStreams | None = None
        try:
            for rank in range(self.nprocs):
                opened = streams = RankStreams(self.rank_io[rank])
                try:
                    streams.open(console)
                    env = with_token(
                        {**self.envs[rank], ERROR_FILE_ENV: streams.io.error_file}, self._tree
                    )
                    resume = self.resumes.get(rank)
                    resumed = resume is not None and resume.resume(
                        {**os.environ, **env}, streams.stdout.child_fd, streams.stderr.child_fd
                    )
                    if resumed:  # registered with the guardian since its first group
                        assert resume is not None
                        handle, result = resume.handle, None
                    else:
                        with notices_ignored():  # Slurm's warning is for the agent alone
                            handle, result = self._start_worker(
                                rank, env, streams.stdout.child_fd, streams.stderr.child_fd
                            )
                        orphans.register(handle.pid)
                finally:
                    streams.close_child_ends()
                worker = WorkerProcess(rank, handle, result=result)
                workers.append(worker)
                worker.streams = streams.tees(console, handle.pid, self.copies)
                opened = None
        except BaseException:
            self._abort_start(workers, opened)
            raise
        self._monitor = GroupMonitor(
            workers, self._shutdown_timeout, self._build_result, console, clock=self._clock
        )
        self._monitor.start()
        _open_contexts.add(self)

    def _abort_start(self, workers: list[WorkerProcess], opened: RankStreams | None) -> None:
        if opened is not None:
            opened.close_all()
        for worker in workers:
            signal_tree(worker.pid, signal.SIGKILL)
        give_up_at = self._clock.monotonic() + KILL_DEADLINE
        for worker in workers:
            left = max(0.0, give_up_at - self._clock.monotonic())
            if worker.handle.wait(left) is None:
                log.warning(
                    "local rank %d (pid %d) did not die within %gs of SIGKILL; going on without it",
                    worker.local_rank,
                    worker.pid,
                    KILL_DEADLINE,
                )
                worker.handle.abandon()
            guardian().unregister(worker.pid)
            for stream in worker.streams:
                stream.finish()
            if worker.result is not None:
                worker.result.close()
            worker.handle.release()
        kill_marked(self._tree, TREE_KILL_WAIT)
        guardian().unregister_tree(self._tree)
        self._signals.restore()

    def pids(self) -> dict[int, int]:
        """The pid of each worker by local rank."""
        if self._monitor is None:
            return {}
        return {rank: worker.pid for rank, worker in self._monitor.workers.items()}

    def keep(self, local_rank: int) -> bool:
        """``local_rank`` waits to restart in place (``relaunch.restart_in_place``): it ends for
        this group, stopped, but its process is neither signalled nor released here; ``kept``
        hands it to the next group. False when it had ended."""
        return self._monitor is not None and self._monitor.keep(local_rank)

    def kept(self) -> dict[int, PopenHandle | ProcessHandle]:
        """The handles of the workers kept to restart in place, by local rank."""
        if self._monitor is None:
            return {}
        with self._monitor.lock:
            return {rank: w.handle for rank, w in self._monitor.workers.items() if w.kept}

    def stuck(self) -> dict[int, StuckWorker]:
        """The workers given up on, by local rank: alive ``KILL_DEADLINE`` s after SIGKILL."""
        if self._monitor is None:
            return {}
        with self._monitor.lock:
            return dict(self._monitor.stuck)

    def running(self) -> set[int]:
        """The local ranks whose process has not exited (or not been reaped) yet."""
        if self._monitor is None:
            return set()
        return {rank for rank, w in self._monitor.workers.items() if w.exitcode is None}

    def wait(self, timeout: float = -1, period: float = 1) -> RunProcsResult | None:
        """Wait up to ``timeout`` seconds (forever if negative, a mere check if 0) for the end.

        Returns None while workers still run, else the result; when a worker failed, the others
        have already been stopped. Returns as soon as the group ends: ``period`` is accepted for
        compatibility and unused, since exits are events here, not polled. The functions' return
        values are loaded here, in the caller's thread, as torch does: a value that cannot be
        loaded fails its rank.
        """
        monitor = self._monitor
        if monitor is None:
            raise RuntimeError(f"{type(self).__name__} {self.name!r} was not started")
        if not monitor.wait_done(None if timeout < 0 else timeout):
            return None
        return self._settled()

    def _settled(self) -> RunProcsResult:
        """The result of the ended group, its return values loaded (once; a signal that
        interrupts the loading leaves the rest for the next call)."""
        with self._settle_lock:
            result = self._result
            if result is None:  # the monitor failed and could not even build the result
                assert self._monitor is not None
                result = self._result = monitor_failure_result(
                    self._monitor, self.stdouts, self.stderrs
                )
            while self._unloaded:
                rank, worker = next(iter(self._unloaded.items()))
                try:
                    self._loaded[rank] = self._return_value(worker, self._who(rank))
                except Exception as exc:
                    result.failures[rank] = unloadable(
                        rank, worker, exc, self.rank_io[rank].error_file
                    )
                del self._unloaded[rank]
            if not result.failures:
                result.return_values = dict(sorted(self._loaded.items()))
            return result

    def _who(self, rank: int) -> str:
        global_rank = self.envs[rank].get("RANK")
        return f"local rank {rank}" if global_rank is None else f"rank {global_rank}"

    def hold_group_stop(self) -> None:
        """From now on, a worker's failure does not stop the others: the agent has asked every
        worker for its stack (SIGABRT), and none may be cut short while it writes it."""
        if self._monitor is not None:
            with self._monitor.lock:
                self._monitor.holding = True

    def exit_times(self) -> dict[int, float]:
        """When each worker ended (``time.time()``; 0.0 while it runs), by local rank."""
        if self._monitor is None:
            return {}
        with self._monitor.lock:
            return {rank: w.exit_time for rank, w in self._monitor.workers.items()}

    def set_failure_grace(self, grace: FailureGrace) -> None:
        """From now on, the first failure asks ``grace`` how long the other workers' stop may
        wait for them to save their state (``relaunch.failure_pending``)."""
        if self._monitor is not None:
            with self._monitor.lock:
                self._monitor.grace = grace

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once every worker has ended (then ``wait(0)`` has the result): from the
        monitor thread, so it must be quick and wait for nothing; at once if they already have."""
        if self._monitor is None:
            raise RuntimeError(f"{type(self).__name__} {self.name!r} was not started")
        self._monitor.add_done_callback(fn)

    def add_failure_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once, at the first failure, as the other workers' stop begins (then
        ``failures()`` has it): from the monitor thread, so it must be quick; at once if a
        worker failed already. The agent tells the other nodes then, not once its own
        workers are gone."""
        if self._monitor is None:
            raise RuntimeError(f"{type(self).__name__} {self.name!r} was not started")
        self._monitor.add_failure_callback(fn)

    def failures(self) -> dict[int, ProcessFailure]:
        """The workers that failed so far, by local rank (those stopped because of a failure
        are not among them): the group's failures before it has ended."""
        monitor = self._monitor
        if monitor is None:
            return {}
        with monitor.lock:
            return {
                rank: worker_failure(rank, worker, self.rank_io[rank])
                for rank, worker in monitor.workers.items()
                if worker.exitcode and rank not in monitor.stopped_ranks
            }

    def close(
        self, death_sig: signal.Signals | None = None, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    ) -> None:
        """Stop every worker and its descendants: ``death_sig``, then SIGKILL after ``timeout`` s.

        Returns at most about ``timeout + KILL_DEADLINE`` s later (and ``TREE_KILL_WAIT`` for
        their descendants): a worker the kernel does not let die is given up on, logged with its
        state and listed in ``stuck()``. Log and error files stay, with everything the workers
        wrote. Idempotent; safe to call whether or not the workers still run.
        """
        if self._closed:
            return
        self._closed = True
        _open_contexts.discard(self)
        self._signals.restore()
        monitor = self._monitor
        if monitor is None:
            return
        if not monitor.done:
            monitor.stop(death_sig or signal.SIGTERM, timeout)
            monitor.wait_done(None)
        # Descendants of workers that already exited may linger in their process groups: once
        # close returns, they are gone too (unless stuck in the kernel past TREE_KILL_WAIT).
        monitor.kill_all_trees()
        gone = [worker for worker in monitor.workers.values() if not worker.kept]
        groups = [worker.pid for worker in gone]
        kept_pids = {worker.pid for worker in monitor.workers.values() if worker.kept}
        stuck_pids = {stuck.pid for stuck in monitor.stuck.values()}
        wait_groups_gone(groups, TREE_KILL_WAIT, ignore=stuck_pids)
        # And those that left their groups (a setsid daemon): they carry the group's token.
        kill_marked(self._tree, TREE_KILL_WAIT, skip=stuck_pids | kept_pids)
        guardian().unregister_tree(self._tree)
        monitor.finish()
        for worker in gone:
            guardian().unregister(worker.pid)
            worker.handle.release()

    def _build_result(self) -> None:
        """Called by the monitor once every worker has exited (in its thread, holding its
        lock: no user code runs here)."""
        assert self._monitor is not None
        monitor = self._monitor
        workers = monitor.workers
        failures = self.failures()  # the monitor's lock is re-entrant
        stopped = {rank: workers[rank].exitcode or 0 for rank in monitor.stopped_ranks}
        # Loaded by ``wait`` in the caller's thread: unpickling runs the user's code.
        self._unloaded = {} if failures else dict(workers)
        self._result = RunProcsResult(
            {},
            failures,
            self.stdouts,
            self.stderrs,
            stopped,
            exitcodes={rank: worker.exitcode or 0 for rank, worker in workers.items()},
            durations={
                rank: max(0.0, worker.exit_time - self._started_at)
                for rank, worker in workers.items()
            },
            stuck=dict(monitor.stuck),
        )


class Resume(Protocol):
    """A worker kept from the group before (``PContext.kept``), to run its rank of the next."""

    handle: PopenHandle | ProcessHandle

    def resume(self, env: dict[str, str], stdout: int | None, stderr: int | None) -> bool:
        """Hand the worker its attempt: ``env`` (all of it), writing to ``stdout``/``stderr``
        (None: the launcher's); False when it cannot take it (it is started afresh)."""
