"""``start_processes`` and the contexts that run a group of workers as one unit.

``start_processes`` checks its arguments, plans each rank's I/O (``core.rank_io``) and starts
the right context: functions run in a ``MultiprocessContext``, binaries in a
``SubprocessContext``. Both are a ``PContext`` (``procs.base``), which starts, watches and stops
the group.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping
from typing import Any

from relaunch.core.defaults import DEFAULT_SHUTDOWN_TIMEOUT, START_METHODS
from relaunch.core.macros import substitute_local_rank
from relaunch.core.rank_io import RankIO, plan_rank_io
from relaunch.core.streams import Std
from relaunch.procs.affinity import starting_on
from relaunch.procs.base import PContext, RunProcsResult
from relaunch.procs.checks import (
    check_entrypoint,
    check_log_dir,
    check_picklable,
    check_ranks,
    check_start_method,
)
from relaunch.procs.console_writer import ProgbarEvents
from relaunch.procs.handles import PopenHandle, ProcessHandle
from relaunch.procs.monitor import WorkerProcess
from relaunch.runtime import SYSTEM_CLOCK, Clock

__all__ = [
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "START_METHODS",
    "MultiprocessContext",
    "PContext",
    "RunProcsResult",
    "SubprocessContext",
    "start_processes",
]


class SubprocessContext(PContext):
    """Workers that are binaries (any executable, a Python interpreter included)."""

    entrypoint: str

    def _start_worker(
        self, local_rank: int, env: dict[str, str], stdout: int | None, stderr: int | None
    ) -> tuple[PopenHandle, None]:
        argv = [self.entrypoint, *map(str, self.args[local_rank])]
        with starting_on(self.cpu_affinity.get(local_rank)):
            popen = subprocess.Popen(
                argv,
                env={**os.environ, **env},
                stdout=stdout,
                stderr=stderr,
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
        rank_io: Mapping[int, RankIO],
        start_method: str,
        progbar_events: ProgbarEvents | None = None,
        *,
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
        clock: Clock = SYSTEM_CLOCK,
        cpu_affinity: Mapping[int, frozenset[int]] | None = None,
    ) -> None:
        check_start_method(start_method)
        if start_method != "fork":
            check_picklable(entrypoint, args, start_method)
        super().__init__(
            name,
            entrypoint,
            args,
            envs,
            rank_io,
            progbar_events,
            shutdown_timeout=shutdown_timeout,
            clock=clock,
            cpu_affinity=cpu_affinity,
        )
        self.entrypoint: Callable[..., Any] = entrypoint
        self.start_method = start_method
        import multiprocessing  # only function workers need it: keep it off the CLI's path

        self._mp: Any = multiprocessing.get_context(start_method)

    def _start_worker(
        self, local_rank: int, env: dict[str, str], stdout: int | None, stderr: int | None
    ) -> tuple[ProcessHandle, Any]:
        from relaunch.procs._child import ChildSetup, InheritedFd, run_function

        setup = ChildSetup(
            env=env,
            stdout=None if stdout is None else InheritedFd(stdout),
            stderr=None if stderr is None else InheritedFd(stderr),
            cpus=self.cpu_affinity.get(local_rank),
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
    relay: Std | Mapping[int, Std] = Std.NONE,
    cpu_affinity: Mapping[int, frozenset[int]] | None = None,
) -> PContext:
    """Start one copy of ``entrypoint`` per local rank and return the running context.

    A callable runs in a :class:`MultiprocessContext`; a string runs as a binary in a
    :class:`SubprocessContext` (its args are cast to ``str``). ``args`` and ``envs`` must both
    have the keys ``0..n-1``; ``${local_rank}`` in a string argument becomes the rank. ``log_dir``
    must be an existing empty directory; each rank gets ``{log_dir}/{rank}/`` with
    ``stdout.log``/``stderr.log`` for redirected or tee'd streams and ``error.json`` on failure.
    ``log_line_prefixes`` replaces the console prefix ``[{name}{local_rank}]:`` of some ranks.
    ``relay`` (relaunch's own) names streams, neither redirected nor tee'd, that relaunch copies
    to its console as whole lines with bar refreshes collapsed, rather than letting the workers
    inherit the console. ``cpu_affinity`` (relaunch's own) binds some ranks to CPUs
    (``procs.affinity``).
    """
    nprocs = check_ranks(args, envs)
    check_entrypoint(entrypoint, start_method)
    check_log_dir(log_dir)
    rank_io = plan_rank_io(name, log_dir, nprocs, redirects, tee, log_line_prefixes, relay)
    rank_args = {rank: substitute_local_rank(args[rank], rank) for rank in range(nprocs)}
    context: PContext
    if isinstance(entrypoint, str):
        context = SubprocessContext(
            name,
            entrypoint,
            rank_args,
            envs,
            rank_io,
            progbar_events,
            shutdown_timeout=shutdown_timeout,
            cpu_affinity=cpu_affinity,
        )
    else:
        context = MultiprocessContext(
            name,
            entrypoint,
            rank_args,
            envs,
            rank_io,
            start_method,
            progbar_events,
            shutdown_timeout=shutdown_timeout,
            cpu_affinity=cpu_affinity,
        )
    for io in rank_io.values():
        os.mkdir(io.log_dir)
    context.start()
    return context
