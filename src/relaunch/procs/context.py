"""``start_processes`` and the contexts that run a group of workers as one unit."""

from __future__ import annotations

import abc
import atexit
import logging
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from relaunch.core.macros import substitute_local_rank
from relaunch.core.streams import Std, per_rank
from relaunch.procs.console import ProgbarEvents, console_for
from relaunch.procs.errors import ERROR_FILE_ENV, ProcessFailure
from relaunch.procs.guardian import guardian
from relaunch.procs.handles import PopenHandle, ProcessHandle, signal_tree
from relaunch.procs.monitor import GroupMonitor, TeeStream, WorkerProcess
from relaunch.procs.signals import SignalsToExceptions

log = logging.getLogger(__name__)

START_METHODS = ("spawn", "fork", "forkserver")

#: Contexts started and not yet closed. At interpreter exit their workers are killed (as the
#: guardian would do a moment later), before multiprocessing's exit hook waits for its children.
_open_contexts: weakref.WeakSet[PContext] = weakref.WeakSet()


@atexit.register
def _close_open_contexts() -> None:
    for context in list(_open_contexts):
        context.close(signal.SIGKILL, timeout=0)


#: Default seconds between the stop signal and SIGKILL.
DEFAULT_SHUTDOWN_TIMEOUT = 30.0


@dataclass
class RunProcsResult:
    """The outcome of a finished group.

    ``return_values`` maps local rank to what a function returned (None for binaries) when all
    succeeded; ``failures`` holds the workers that failed; ``stopped`` maps the ranks that were
    stopped only because another failed to their exit codes. ``stdouts``/``stderrs`` are the log
    file paths ("" where a stream was not redirected). ``exitcodes`` and ``durations``
    (seconds from the group's start to each exit) cover every rank.
    """

    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    stopped: dict[int, int] = field(default_factory=dict)
    exitcodes: dict[int, int] = field(default_factory=dict)
    durations: dict[int, float] = field(default_factory=dict)

    def is_failed(self) -> bool:
        return len(self.failures) > 0


class _Target:
    """Where one standard stream of one worker goes: inherited, a file, or a tee pipe."""

    def __init__(self, path: str, tee: bool) -> None:
        self.path = path
        self.tee = tee
        self.child_fd: int | None = None  # what the child writes to
        self.read_fd: int | None = None  # tee: what the monitor reads
        self.log_fd: int | None = None  # tee: where the monitor writes

    def open(self) -> None:
        if not self.path:
            return
        log_fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if self.tee:
            self.read_fd, self.child_fd = os.pipe()
            self.log_fd = log_fd
        else:
            self.child_fd = log_fd

    def close_child_end(self) -> None:
        if self.child_fd is not None:
            os.close(self.child_fd)
            self.child_fd = None

    def close_all(self) -> None:
        self.close_child_end()
        for fd in (self.read_fd, self.log_fd):
            if fd is not None:
                os.close(fd)
        self.read_fd = self.log_fd = None


class PContext(abc.ABC):
    """A group of worker processes started, watched and stopped as one unit.

    ``stdouts``/``stderrs`` map each local rank to a log file path, or "" to inherit the
    launcher's stream; ``tee_stdouts``/``tee_stderrs`` name the ranks whose log file is also
    echoed to the console, each line prefixed ``[{name}{local_rank}]:``. When one worker fails,
    the others are sent SIGTERM, then SIGKILL after ``shutdown_timeout`` seconds.
    """

    def __init__(
        self,
        name: str,
        entrypoint: Callable[..., Any] | str,
        args: Mapping[int, tuple[Any, ...]],
        envs: Mapping[int, Mapping[str, str]],
        stdouts: Mapping[int, str],
        stderrs: Mapping[int, str],
        tee_stdouts: Mapping[int, str],
        tee_stderrs: Mapping[int, str],
        error_files: Mapping[int, str],
        progbar_events: ProgbarEvents | None = None,
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    ) -> None:
        self.name = name
        self.entrypoint = entrypoint
        self.args = dict(args)
        self.envs = {rank: dict(env) for rank, env in envs.items()}
        self.stdouts = dict(stdouts)
        self.stderrs = dict(stderrs)
        self.tee_stdouts = dict(tee_stdouts)
        self.tee_stderrs = dict(tee_stderrs)
        self.error_files = dict(error_files)
        self.nprocs = len(self.args)
        self._progbar_events = progbar_events
        self._shutdown_timeout = shutdown_timeout
        self._signals = SignalsToExceptions()
        self._monitor: GroupMonitor | None = None
        self._result: RunProcsResult | None = None
        self._closed = False
        self._started_at = 0.0
        #: Console prefixes by local rank, replacing ``[{name}{local_rank}]:``.
        self.log_line_prefixes: dict[int, str] = {}

    # -- what each kind of context supplies ----------------------------------------------------

    @abc.abstractmethod
    def _start_worker(
        self, local_rank: int, env: dict[str, str], stdout: _Target, stderr: _Target
    ) -> tuple[PopenHandle | ProcessHandle, Any]:
        """Start one worker; return its handle and the read end of its result channel, if any."""

    def _return_value(self, worker: WorkerProcess) -> Any:
        return None

    # -- the life cycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start every worker. A worker that cannot be started stops those already running."""
        if self._monitor is not None:
            raise RuntimeError(f"{type(self).__name__} {self.name!r} was already started")
        self._signals.install()
        self._started_at = time.time()
        sys.stdout.flush()
        sys.stderr.flush()
        watchdog = guardian()
        console = console_for(sys.stdout, sys.stderr, self._progbar_events)
        workers: list[WorkerProcess] = []
        targets: list[_Target] = []
        try:
            for rank in range(self.nprocs):
                stdout = _Target(self.stdouts.get(rank, ""), rank in self.tee_stdouts)
                stderr = _Target(self.stderrs.get(rank, ""), rank in self.tee_stderrs)
                targets = [stdout, stderr]
                try:
                    stdout.open()
                    stderr.open()
                    env = {**self.envs[rank], ERROR_FILE_ENV: self.error_files[rank]}
                    handle, result_conn = self._start_worker(rank, env, stdout, stderr)
                    watchdog.register(handle.pid)
                finally:
                    stdout.close_child_end()
                    stderr.close_child_end()
                worker = WorkerProcess(rank, handle, result_conn=result_conn)
                workers.append(worker)
                prefix = self.log_line_prefixes.get(rank, f"[{self.name}{rank}]:").encode()
                for target, err in ((stdout, False), (stderr, True)):
                    if target.read_fd is not None and target.log_fd is not None:
                        worker.streams.append(
                            TeeStream(
                                target.read_fd,
                                target.log_fd,
                                console,
                                console.prefix(prefix, rank, err),
                                err,
                            )
                        )
                targets = []
        except BaseException:
            self._abort_start(workers, targets)
            raise
        self._monitor = GroupMonitor(workers, self._shutdown_timeout, self._build_result, console)
        self._monitor.start()
        _open_contexts.add(self)

    def _abort_start(self, workers: list[WorkerProcess], targets: list[_Target]) -> None:
        for target in targets:
            target.close_all()
        for worker in workers:
            signal_tree(worker.pid, signal.SIGKILL)
        for worker in workers:
            _wait_exit(worker.handle)
            guardian().unregister(worker.pid)
            for stream in worker.streams:
                stream.finish()
            worker.handle.release()
        self._signals.restore()

    def pids(self) -> dict[int, int]:
        """The pid of each worker by local rank."""
        if self._monitor is None:
            return {}
        return {rank: worker.pid for rank, worker in self._monitor.workers.items()}

    def running(self) -> set[int]:
        """The local ranks whose process has not exited (or not been reaped) yet."""
        if self._monitor is None:
            return set()
        return {rank for rank, w in self._monitor.workers.items() if w.exitcode is None}

    def wait(self, timeout: float = -1, period: float = 1) -> RunProcsResult | None:
        """Wait up to ``timeout`` seconds (forever if negative, a mere check if 0) for the end.

        Returns None while workers still run, else the result; when a worker failed, the others
        have already been stopped. Returns as soon as the group ends: ``period`` is accepted for
        compatibility and unused, since exits are events here, not polled.
        """
        monitor = self._monitor
        if monitor is None:
            raise RuntimeError(f"{type(self).__name__} {self.name!r} was not started")
        if not monitor.wait_done(None if timeout < 0 else timeout):
            return None
        return self._result

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once every worker has ended (then ``wait(0)`` has the result): from the
        monitor thread, so it must be quick and wait for nothing; at once if they already have."""
        if self._monitor is None:
            raise RuntimeError(f"{type(self).__name__} {self.name!r} was not started")
        self._monitor.add_done_callback(fn)

    def close(
        self, death_sig: signal.Signals | None = None, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    ) -> None:
        """Stop every worker and its descendants: ``death_sig``, then SIGKILL after ``timeout`` s.

        Log and error files stay. Idempotent; safe to call whether or not the workers still run.
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
        # Descendants of workers that already exited may linger in their process groups.
        monitor.kill_all_trees()
        monitor.finish()
        for worker in monitor.workers.values():
            guardian().unregister(worker.pid)
            worker.handle.release()

    def _build_result(self) -> None:
        """Called by the monitor once every worker has exited."""
        assert self._monitor is not None
        monitor = self._monitor
        workers = monitor.workers
        failures = {
            rank: ProcessFailure.from_exit(
                rank,
                worker.pid,
                worker.exitcode or 0,
                self.error_files[rank],
                stderr_file=self.stderrs.get(rank, ""),
                timestamp=worker.exit_time,
            )
            for rank, worker in workers.items()
            if worker.exitcode and rank not in monitor.stopped_ranks
        }
        stopped = {rank: workers[rank].exitcode or 0 for rank in monitor.stopped_ranks}
        if failures:
            values: dict[int, Any] = {}
        else:
            values = {rank: self._return_value(worker) for rank, worker in workers.items()}
        self._result = RunProcsResult(
            values,
            failures,
            self.stdouts,
            self.stderrs,
            stopped,
            exitcodes={rank: worker.exitcode or 0 for rank, worker in workers.items()},
            durations={
                rank: max(0.0, worker.exit_time - self._started_at)
                for rank, worker in workers.items()
            },
        )


def _wait_exit(handle: PopenHandle | ProcessHandle) -> None:
    if isinstance(handle, PopenHandle):
        handle.popen.wait()
    else:
        handle.process.join()


class SubprocessContext(PContext):
    """Workers that are binaries (any executable, a Python interpreter included)."""

    def __init__(self, name: str, entrypoint: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(name, entrypoint, *args, **kwargs)
        self.entrypoint: str = entrypoint

    def _start_worker(
        self, local_rank: int, env: dict[str, str], stdout: _Target, stderr: _Target
    ) -> tuple[PopenHandle, None]:
        argv = [self.entrypoint, *map(str, self.args[local_rank])]
        popen = subprocess.Popen(
            argv,
            env={**os.environ, **env},
            stdout=stdout.child_fd,
            stderr=stderr.child_fd,
            start_new_session=True,
            close_fds=True,
        )
        return PopenHandle(popen), None


class MultiprocessContext(PContext):
    """Workers that are Python functions, started with a multiprocessing start method.

    The function's return value is collected per local rank; an uncaught exception is written to
    the rank's error file automatically (no ``@record`` needed).
    """

    def __init__(
        self,
        name: str,
        entrypoint: Callable[..., Any],
        args: Mapping[int, tuple[Any, ...]],
        envs: Mapping[int, Mapping[str, str]],
        stdouts: Mapping[int, str],
        stderrs: Mapping[int, str],
        tee_stdouts: Mapping[int, str],
        tee_stderrs: Mapping[int, str],
        error_files: Mapping[int, str],
        start_method: str,
        progbar_events: ProgbarEvents | None = None,
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    ) -> None:
        _check_start_method(start_method)
        if start_method != "fork":
            _check_picklable(entrypoint, args, start_method)
        super().__init__(
            name,
            entrypoint,
            args,
            envs,
            stdouts,
            stderrs,
            tee_stdouts,
            tee_stderrs,
            error_files,
            progbar_events,
            shutdown_timeout,
        )
        self.entrypoint: Callable[..., Any] = entrypoint
        self.start_method = start_method
        import multiprocessing  # only function workers need it: keep it off the CLI's path

        self._mp: Any = multiprocessing.get_context(start_method)

    def _start_worker(
        self, local_rank: int, env: dict[str, str], stdout: _Target, stderr: _Target
    ) -> tuple[ProcessHandle, Any]:
        from relaunch.procs._child import ChildSetup, InheritedFd, run_function

        setup = ChildSetup(
            env=env,
            stdout=None if stdout.child_fd is None else InheritedFd(stdout.child_fd),
            stderr=None if stderr.child_fd is None else InheritedFd(stderr.child_fd),
        )
        result_r, result_w = self._mp.Pipe(duplex=False)
        process = self._mp.Process(
            target=run_function,
            args=(setup, self.entrypoint, self.args[local_rank], result_w),
            name=f"{self.name}{local_rank}",
        )
        try:
            process.start()
        finally:
            result_w.close()
        return ProcessHandle(process, self.start_method), result_r

    def _return_value(self, worker: WorkerProcess) -> Any:
        if worker.result_bytes is None:
            return None
        import pickle

        return pickle.loads(worker.result_bytes)


def _check_start_method(start_method: str) -> None:
    if start_method not in START_METHODS:
        raise ValueError(
            f"unknown start method {start_method!r}: use one of {', '.join(START_METHODS)}"
        )


def _check_picklable(
    entrypoint: Callable[..., Any], args: Mapping[int, tuple[Any, ...]], start_method: str
) -> None:
    import pickle

    what: object = entrypoint
    try:
        pickle.dumps(entrypoint)
        for rank, rank_args in args.items():
            what = f"the arguments of local rank {rank}"
            pickle.dumps(rank_args)
    except Exception as exc:
        raise ValueError(
            f"{what!r} cannot be pickled for start method {start_method!r} ({exc}); define "
            "the function at the top level of an importable module, or use start_method='fork'"
        ) from None


def _check_binary(entrypoint: str) -> None:
    if os.sep in entrypoint:
        if os.path.isfile(entrypoint) and os.access(entrypoint, os.X_OK):
            return
        problem = "does not exist" if not os.path.exists(entrypoint) else "is not executable"
        raise FileNotFoundError(f"entrypoint {entrypoint!r} {problem}")
    import shutil

    found = shutil.which(entrypoint)
    if found is None:
        raise FileNotFoundError(
            f"entrypoint {entrypoint!r} was not found on PATH: give its full path or install it"
        )


def _check_log_dir(log_dir: str) -> None:
    if not os.path.isdir(log_dir):
        raise ValueError(f"log_dir {log_dir!r} is not an existing directory: create it first")
    if os.listdir(log_dir):
        raise ValueError(f"log_dir {log_dir!r} is not empty: give each run an empty directory")


def _check_ranks(args: Mapping[int, Any], envs: Mapping[int, Any]) -> int:
    nprocs = max(len(args), len(envs))
    expected = set(range(nprocs))
    problems = []
    for label, given in (("args", args), ("envs", envs)):
        missing = sorted(expected - set(given))
        extra = sorted(set(given) - expected)
        if missing:
            problems.append(f"{label} is missing local ranks {missing}")
        if extra:
            problems.append(f"{label} has unexpected keys {extra}")
    if problems or nprocs == 0:
        detail = "; ".join(problems) or "no ranks given"
        raise ValueError(
            f"args and envs must both have the keys 0..nprocs-1 (one per local rank): {detail}"
        )
    return nprocs


def start_processes(
    name: str,
    entrypoint: Callable[..., Any] | str,
    args: Mapping[int, tuple[Any, ...]],
    envs: Mapping[int, Mapping[str, str]],
    log_dir: str,
    start_method: str = "spawn",
    redirects: Std | Mapping[int, Std] = Std.NONE,
    tee: Std | Mapping[int, Std] = Std.NONE,
    progbar_events: ProgbarEvents | None = None,
    *,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    log_line_prefixes: Mapping[int, str] | None = None,
) -> PContext:
    """Start one copy of ``entrypoint`` per local rank and return the running context.

    A callable runs in a :class:`MultiprocessContext`; a string runs as a binary in a
    :class:`SubprocessContext` (its args are cast to ``str``). ``args`` and ``envs`` must both
    have the keys ``0..n-1``; ``${local_rank}`` in a string argument becomes the rank. ``log_dir``
    must be an existing empty directory; each rank gets ``{log_dir}/{rank}/`` with
    ``stdout.log``/``stderr.log`` for redirected or tee'd streams and ``error.json`` on failure.
    ``log_line_prefixes`` replaces the console prefix ``[{name}{local_rank}]:`` of some ranks.
    """
    nprocs = _check_ranks(args, envs)
    if callable(entrypoint):
        _check_start_method(start_method)
    elif isinstance(entrypoint, str):
        _check_binary(entrypoint)
    else:
        raise TypeError(
            f"entrypoint must be a function or the name of a binary, not {type(entrypoint)}"
        )
    _check_log_dir(log_dir)
    redirect_by_rank = per_rank(redirects, nprocs)
    tee_by_rank = per_rank(tee, nprocs)
    stdouts: dict[int, str] = {}
    stderrs: dict[int, str] = {}
    tee_stdouts: dict[int, str] = {}
    tee_stderrs: dict[int, str] = {}
    error_files: dict[int, str] = {}
    for rank in range(nprocs):
        rank_dir = os.path.join(log_dir, str(rank))
        error_files[rank] = os.path.join(rank_dir, "error.json")
        logged = redirect_by_rank[rank] | tee_by_rank[rank]
        for std, files, tees, filename in (
            (Std.OUT, stdouts, tee_stdouts, "stdout.log"),
            (Std.ERR, stderrs, tee_stderrs, "stderr.log"),
        ):
            path = os.path.join(rank_dir, filename) if logged & std else ""
            files[rank] = path
            if tee_by_rank[rank] & std:
                tees[rank] = path
    rank_args = {rank: substitute_local_rank(args[rank], rank) for rank in range(nprocs)}
    context: PContext
    if isinstance(entrypoint, str):
        context = SubprocessContext(
            name,
            entrypoint,
            rank_args,
            envs,
            stdouts,
            stderrs,
            tee_stdouts,
            tee_stderrs,
            error_files,
            progbar_events,
            shutdown_timeout,
        )
    else:
        context = MultiprocessContext(
            name,
            entrypoint,
            rank_args,
            envs,
            stdouts,
            stderrs,
            tee_stdouts,
            tee_stderrs,
            error_files,
            start_method,
            progbar_events,
            shutdown_timeout,
        )
    context.log_line_prefixes = dict(log_line_prefixes or {})
    for rank in range(nprocs):
        os.mkdir(os.path.join(log_dir, str(rank)))
    context.start()
    return context
