"""``start_processes`` and the contexts that run a group of workers as one unit.

``start_processes`` checks its arguments, plans each rank's I/O (``core.workers.rank_io``) and
starts the right context: functions run in a ``MultiprocessContext``, binaries in a
``SubprocessContext``. Both are a ``PContext`` (``procs.base``), which starts, watches and stops
the group.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, overload

from relaunch.core.defaults import DEFAULT_SHUTDOWN_TIMEOUT, START_METHODS
from relaunch.core.workers.call_forms import CallForm, choose
from relaunch.core.workers.logs_specs import LogsSpecs, is_logs_specs, rank_io_of
from relaunch.core.workers.macros import substitute_local_rank
from relaunch.core.workers.rank_io import (
    FILTERED_STDERR_LOG,
    FILTERED_STDOUT_LOG,
    RankIO,
    plan_rank_io,
)
from relaunch.core.workers.streams import Std
from relaunch.procs.affinity import starting_on
from relaunch.procs.base import PContext, Resume
from relaunch.procs.checks import (
    check_entrypoint,
    check_log_dir,
    check_picklable,
    check_ranks,
    check_start_method,
)
from relaunch.procs.console_writer import ProgbarEvents
from relaunch.procs.group_result import RunProcsResult
from relaunch.procs.handles import PopenHandle, ProcessHandle
from relaunch.procs.returns import ReturnReader, widen_pipe
from relaunch.procs.worker_process import WorkerProcess
from relaunch.runtime import SYSTEM_CLOCK, Clock

if TYPE_CHECKING:
    from relaunch.procs.zygote import Zygote

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
    """Workers that are binaries (any executable, a Python interpreter included).

    With a ``zygote`` (``--preload``), a Python worker is forked from it rather than started
    (``procs.zygote``); what it cannot start as ``Popen`` would starts as before.
    """

    entrypoint: str
    zygote: Zygote | None = None

    def _start_worker(
        self, local_rank: int, env: dict[str, str], stdout: int | None, stderr: int | None
    ) -> tuple[PopenHandle, None]:
        argv = [self.entrypoint, *map(str, self.args[local_rank])]
        with starting_on(self.cpu_affinity.get(local_rank)):
            if self.zygote is not None:
                forked = self.zygote.spawn(argv, {**os.environ, **env}, stdout, stderr)
                if forked is not None:
                    return forked, None
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

    The function's return value is collected per local rank, sent by value (``procs.returns``):
    anything the standard pickler can send arrives; a value that cannot be sent or loaded fails
    its rank with a message that says so. An uncaught exception is written to the rank's error
    file automatically (no ``@record`` needed).
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
        from relaunch.procs.function_worker import ChildSetup, InheritedFd, run_function

        setup = ChildSetup(
            env=env,
            stdout=None if stdout is None else InheritedFd(stdout),
            stderr=None if stderr is None else InheritedFd(stderr),
            cpus=self.cpu_affinity.get(local_rank),
        )
        result_r, result_w = os.pipe()
        widen_pipe(result_w)
        process = self._mp.Process(
            target=run_function,
            args=(setup, self.entrypoint, self.args[local_rank], InheritedFd(result_w)),
            name=f"{self.name}{local_rank}",
        )
        try:
            process.start()
        except BaseException:
            os.close(result_r)
            raise
        finally:
            os.close(result_w)
        return ProcessHandle(process, self.start_method), ReturnReader(result_r)

    def _return_value(self, worker: WorkerProcess, who: str) -> Any:
        """What the worker returned, loaded here in the caller's thread (``procs.returns``)."""
        return None if worker.result is None else worker.result.load(who)


#: ``start_processes``'s two forms, from its 5th parameter on: torch 2.13's and the seeds'.
TORCH_CALL = CallForm(
    "torch 2.13's",
    (
        "logs_specs",
        "log_line_prefixes",
        "start_method",
        "numa_options",
        "duplicate_stdout_filters",
        "duplicate_stderr_filters",
    ),
    frozenset({"progbar_events"}),
    "give log_dir, redirects and tee to DefaultLogsSpecs(log_dir, redirects, tee)",
)
SEEDS_CALL = CallForm(
    "the seeds'",
    ("log_dir", "start_method", "redirects", "tee", "progbar_events"),
    frozenset(
        {
            "log_line_prefixes",
            "local_ranks_filter",
            "duplicate_stdout_filters",
            "duplicate_stderr_filters",
        }
    ),
    "pass logs_specs=DefaultLogsSpecs(log_dir, redirects, tee) in place of log_dir",
)


@overload
def start_processes(
    name: str,
    entrypoint: Callable[..., Any] | str,
    args: Mapping[int, tuple[Any, ...]],
    envs: Mapping[int, Mapping[str, str]],
    logs_specs: LogsSpecs,
    log_line_prefixes: Mapping[int, str] | None = None,
    start_method: str = "spawn",
    numa_options: None = None,
    duplicate_stdout_filters: list[str] | None = None,
    duplicate_stderr_filters: list[str] | None = None,
    *,
    progbar_events: ProgbarEvents | None = None,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    relay: Std | Mapping[int, Std] = Std.NONE,
    cpu_affinity: Mapping[int, frozenset[int]] | None = None,
    zygote: Zygote | None = None,
    resumes: Mapping[int, Resume] | None = None,
) -> PContext: ...


@overload
def start_processes(
    name: str,
    entrypoint: Callable[..., Any] | str,
    args: Mapping[int, tuple[Any, ...]],
    envs: Mapping[int, Mapping[str, str]],
    log_dir: str | os.PathLike[str],
    start_method: str = "spawn",
    redirects: Std | Mapping[int, Std] = Std.NONE,
    tee: Std | Mapping[int, Std] = Std.NONE,
    progbar_events: ProgbarEvents | None = None,
    *,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    log_line_prefixes: Mapping[int, str] | None = None,
    relay: Std | Mapping[int, Std] = Std.NONE,
    cpu_affinity: Mapping[int, frozenset[int]] | None = None,
    zygote: Zygote | None = None,
    resumes: Mapping[int, Resume] | None = None,
    local_ranks_filter: Collection[int] | None = None,
    duplicate_stdout_filters: list[str] | None = None,
    duplicate_stderr_filters: list[str] | None = None,
) -> PContext: ...


def start_processes(
    name: str,
    entrypoint: Callable[..., Any] | str,
    args: Mapping[int, tuple[Any, ...]],
    envs: Mapping[int, Mapping[str, str]],
    *positional: Any,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    relay: Std | Mapping[int, Std] = Std.NONE,
    cpu_affinity: Mapping[int, frozenset[int]] | None = None,
    zygote: Zygote | None = None,
    resumes: Mapping[int, Resume] | None = None,
    **keywords: Any,
) -> PContext:
    """Start one copy of ``entrypoint`` per local rank and return the running context.

    A callable runs in a :class:`MultiprocessContext`; a string runs as a binary in a
    :class:`SubprocessContext` (its args are cast to ``str``). ``args`` and ``envs`` must both
    have the keys ``0..n-1``; ``${local_rank}`` in a string argument becomes the rank.

    Two forms, told apart by the 5th argument. torch 2.13's: a ``LogsSpecs``
    (``logs_specs``), whose ``reify(envs)`` says where each rank's logs go (``DefaultLogsSpecs``:
    ``{log_dir}/{run_id}_XXXX/attempt_N/{rank}/``), then ``log_line_prefixes``,
    ``start_method``, ``numa_options`` (None only: relaunch binds CPUs with ``cpu_affinity``)
    and the duplicate filters. The seeds': a ``log_dir`` that must be an existing empty
    directory, each rank's files in ``{log_dir}/{rank}/`` (``stdout.log``/``stderr.log`` for
    redirected or tee'd streams, ``error.json`` on failure), then ``start_method``,
    ``redirects``, ``tee`` and ``progbar_events``; ``local_ranks_filter`` (a keyword) names the
    ranks shown on the console, as ``DefaultLogsSpecs``'s does. A keyword of one form in a call
    of the other is a TypeError.

    ``duplicate_stdout_filters`` and ``duplicate_stderr_filters`` (torch's; keywords in the
    seeds' form) copy the tee'd lines of every rank that contain any of the strings, prefixed,
    to one file: the ``LogsDest``'s ``filtered_stdout``/``filtered_stderr``, or
    ``{log_dir}/filtered_stdout.log`` and ``filtered_stderr.log``; the context's
    ``filtered_stdout``/``filtered_stderr`` name them.

    ``log_line_prefixes`` replaces the console prefix ``[{name}{local_rank}]:`` of some ranks.
    ``relay`` (relaunch's own) names streams, neither logged nor dropped, that relaunch copies
    to its console as whole lines rather than letting the workers inherit the console.
    ``cpu_affinity`` (relaunch's own) binds some ranks to CPUs (``procs.affinity``).
    ``zygote`` (relaunch's own, ``--preload``) forks the Python workers it can
    (``procs.zygote``). ``resumes`` (relaunch's own) hands some ranks to workers kept from the
    group before, which restart in place (``relaunch.restart_in_place``).
    """
    form, given = _call_form(positional, keywords)
    nprocs = check_ranks(args, envs)
    check_entrypoint(entrypoint, given.get("start_method", "spawn"))
    envs, rank_io, filtered = _rank_logs(form, given, envs, name, nprocs, relay)
    rank_args = {rank: substitute_local_rank(args[rank], rank) for rank in range(nprocs)}
    context = _new_context(
        name, entrypoint, rank_args, envs, rank_io, given, shutdown_timeout, cpu_affinity, zygote
    )
    if form is SEEDS_CALL:  # each rank's directory, once the context is made
        for io in rank_io.values():
            os.mkdir(io.log_dir)
    _start_with_copies(context, given, filtered, resumes)
    return context


def _new_context(
    name: str,
    entrypoint: Callable[..., Any] | str,
    rank_args: Mapping[int, tuple[Any, ...]],
    envs: Mapping[int, Mapping[str, str]],
    rank_io: dict[int, RankIO],
    given: Mapping[str, Any],
    shutdown_timeout: float,
    cpu_affinity: Mapping[int, frozenset[int]] | None,
    zygote: Zygote | None,
) -> PContext:
    """A binary's context (``SubprocessContext``) or a function's (``MultiprocessContext``)."""
    progbar_events: ProgbarEvents | None = given.get("progbar_events")
    if isinstance(entrypoint, str):
        binaries = SubprocessContext(
            name,
            entrypoint,
            rank_args,
            envs,
            rank_io,
            progbar_events,
            shutdown_timeout=shutdown_timeout,
            cpu_affinity=cpu_affinity,
        )
        binaries.zygote = zygote
        return binaries
    return MultiprocessContext(
        name,
        entrypoint,
        rank_args,
        envs,
        rank_io,
        given.get("start_method", "spawn"),
        progbar_events,
        shutdown_timeout=shutdown_timeout,
        cpu_affinity=cpu_affinity,
    )


def _call_form(
    positional: tuple[Any, ...], keywords: Mapping[str, Any]
) -> tuple[CallForm, dict[str, Any]]:
    """The form of a call (torch's or the seeds'), told by its 5th argument, and its arguments
    by name."""
    return choose(
        "start_processes",
        TORCH_CALL,
        SEEDS_CALL,
        positional,
        keywords,
        is_logs_specs,
        lambda value: isinstance(value, (str, os.PathLike)),
        "its 5th argument",
    )


def _rank_logs(
    form: CallForm,
    given: Mapping[str, Any],
    envs: Mapping[int, Mapping[str, str]],
    name: str,
    nprocs: int,
    relay: Std | Mapping[int, Std],
) -> tuple[Mapping[int, Mapping[str, str]], dict[int, RankIO], tuple[str, str]]:
    """The environments (torch's ``reify`` may add to a copy), where each rank's streams go,
    and the duplicate filters' files."""
    if form is SEEDS_CALL:
        return (envs, *_seeds_logs(given, name, nprocs, relay))
    copied = {rank: dict(envs[rank]) for rank in range(nprocs)}
    return (copied, *_torch_logs(given, copied, name, nprocs, relay))


def _torch_logs(
    given: Mapping[str, Any],
    envs: dict[int, dict[str, str]],
    name: str,
    nprocs: int,
    relay: Std | Mapping[int, Std],
) -> tuple[dict[int, RankIO], tuple[str, str]]:
    """torch's form: each rank's streams where ``logs_specs.reify(envs)`` says, and the files
    of the duplicate filters."""
    if given.get("numa_options") is not None:
        raise ValueError(
            "numa_options is not taken: bind workers to CPUs with cpu_affinity= or the "
            "--numa-binding flag"
        )
    dest = given["logs_specs"].reify(envs)
    rank_io = rank_io_of(dest, name, nprocs, given.get("log_line_prefixes"), relay)
    return rank_io, (dest.filtered_stdout, dest.filtered_stderr)


def _seeds_logs(
    given: Mapping[str, Any], name: str, nprocs: int, relay: Std | Mapping[int, Std]
) -> tuple[dict[int, RankIO], tuple[str, str]]:
    """The seeds' form: each rank's streams under ``{log_dir}/{rank}/`` (made once the context
    is), and the files of the duplicate filters."""
    if "log_dir" not in given:
        raise TypeError(
            "start_processes() needs where logs go: logs_specs=DefaultLogsSpecs(...) (torch "
            "2.13) or log_dir=... (the seeds')"
        )
    log_dir = os.fspath(given["log_dir"])
    check_log_dir(log_dir)
    rank_io = plan_rank_io(
        name,
        log_dir,
        nprocs,
        given.get("redirects", Std.NONE),
        given.get("tee", Std.NONE),
        given.get("log_line_prefixes"),
        relay,
        given.get("local_ranks_filter"),
    )
    filtered = (
        os.path.join(log_dir, FILTERED_STDOUT_LOG),
        os.path.join(log_dir, FILTERED_STDERR_LOG),
    )
    return rank_io, filtered


def _start_with_copies(
    context: PContext,
    given: Mapping[str, Any],
    filtered: tuple[str, str],
    resumes: Mapping[int, Resume] | None,
) -> None:
    """Open the duplicate filters' files, hand the kept workers over, and start ``context``."""
    copies = {}
    for err, stream in ((False, "stdout"), (True, "stderr")):
        needles = given.get(f"duplicate_{stream}_filters")
        if needles:
            from relaunch.procs.duplicates import FilteredCopy  # torch's filters: rarely given

            path = filtered[err]
            copies[err] = FilteredCopy(path, needles)
            setattr(context, f"filtered_{stream}", path)
    context.copies = copies
    if resumes:
        context.resumes = dict(resumes)
    try:
        context.start()
    finally:
        for copy in copies.values():
            copy.release()  # the streams that feed it hold it now
