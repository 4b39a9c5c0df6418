"""``relaunch`` itself: parse the flags, check the config, run the agent, map the outcome.

The only place that installs signal handlers. Exit status: 0 on success; 1 when workers failed
(the report, root cause first, goes to stderr); 93 when they failed in a way that restarting
could not mend, on every node (do not requeue); 128 + signal when stopped by a signal, once the
workers are gone; 2 for bad input (a usage error or a ``ConfigError``), reported in one line with
no traceback. Any other exception is a bug and keeps its traceback.

The exceptions a launch may end with, where they are defined, and each one's exit status::

    ValueError
    └── ConfigError (relaunch.config) ............ 2    bad input: one line, no traceback
    Exception
    ├── RendezvousError (relaunch.rendezvous.api)  1    "relaunch: error: ..."
    │   ├── RendezvousClosedError ................ 0    the job had already finished
    │   ├── JobFailedError ....................... 1    another node ended the job (93: for
    │   │                                                   a failure restarting cannot mend)
    │   ├── StoreHostGone ........................ 1    the built-in store's host is gone
    │   └── AgentFault ........................... 1    a helper thread or a store value failed
    │       └── BadStoreValue .................... 1
    ├── ChildFailedError (relaunch.procs.errors) . 1    the workers failed: the report, root
    │                                                   cause first; 93 when restarting could
    │                                                   not help (``requeue`` False): do not
    │                                                   requeue the job
    ├── SignalException (relaunch.procs.errors) .. 128 + the signal, once the workers are gone
    │   └── StopRequested ........................ 128 + the signal
    └── anything else ............................ 1    a bug: it keeps its traceback
    KeyboardInterrupt ............................ 130  Ctrl-C before anything started

A launch goes through three phases, and an exception says a little more in each: ``PREPARE``
(the flags, the scheduler's inference, the config and its checks: nothing runs), ``CONNECT``
(the signal handlers and the rendezvous handler: the store hosted or reached) and ``RUN`` (the
agent and its workers, after which the run's summary is said). ``endings()`` is the table.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from relaunch.cli.flags import (
    EXIT_DO_NOT_REQUEUE,
    EXIT_FAILED,
    EXIT_USAGE,
    build_parser,
    explicit_flags,
    usage_error,
)

if TYPE_CHECKING:
    from relaunch.config import LaunchConfig

PREPARE, CONNECT, RUN = "prepare", "connect", "run"
#: The exit status of a launch stopped by a signal: 128 + its number.
SIGNALLED = -1


#: How an exception ends the command: the exception, its exit status (``SIGNALLED``: 128 + the
#: signal), what is said in each phase it may end (in the others it is a bug, and is raised
#: again), and whether the run's summary follows.
Ending = tuple[type[BaseException], int, Mapping[str, Callable[[Any], None]], bool]


@functools.cache
def endings() -> tuple[Ending, ...]:
    """The table of exceptions and exit statuses; the first row whose exception matches and
    which lists the phase wins, so subclasses come first. (A function, so that the exceptions'
    modules load only for a launch, not for ``relaunch --help``.)"""
    from relaunch.config import ConfigError
    from relaunch.procs.errors import ChildFailedError, SignalException
    from relaunch.rendezvous.api import RendezvousClosedError, RendezvousError

    usage = {PREPARE: _usage, CONNECT: _usage, RUN: _usage}
    summary, no_summary = True, False
    return (
        (ConfigError, EXIT_USAGE, usage, no_summary),
        (KeyboardInterrupt, 128 + signal.SIGINT, {PREPARE: _silent}, no_summary),
        (RendezvousClosedError, 0, {RUN: _nothing_to_do}, no_summary),
        (RendezvousError, EXIT_FAILED, {CONNECT: _error, RUN: _error}, summary),
        (ChildFailedError, EXIT_FAILED, {RUN: _report}, summary),
        (SignalException, SIGNALLED, {CONNECT: _silent, RUN: _stopped}, summary),
    )


def end(exc: BaseException, phase: str) -> tuple[int, bool] | None:
    """Say what ``exc`` means in ``phase`` and return the exit status and whether the run's
    summary follows (``endings()``); None when the table does not list it there (the caller
    raises it again: a bug keeps its traceback)."""
    for exception, status, said, summary in endings():
        if isinstance(exc, exception) and phase in said:
            said[phase](exc)
            if status == SIGNALLED:
                status = 128 + int(getattr(exc, "sigval", 0))
            elif status == EXIT_FAILED and getattr(exc, "requeue", True) is False:
                status = EXIT_DO_NOT_REQUEUE
            return status, summary
    return None


#: What a replica group's launcher adds after ``relaunch:`` to every line it says.
_said_as = ""


def say(line: str) -> None:
    """Print ``line`` on stderr; a stderr that takes nothing (a closed pipe, ``/dev/full``) must
    not change the job's exit status, so the line is dropped then."""
    if _said_as and line.startswith("relaunch: "):
        line = f"relaunch: {_said_as}{line[10:]}"
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _usage(exc: Any) -> None:
    usage_error(exc, "relaunch")


def _error(exc: Any) -> None:
    say(f"relaunch: error: {exc}")


def _nothing_to_do(exc: Any) -> None:
    say(f"relaunch: {exc}: nothing to do")


def _report(exc: Any) -> None:
    # the root cause first, then the summary; headed as a restart's report is (the log's form)
    say(f"relaunch: {exc.format_msg()}")


def _stopped(exc: Any) -> None:
    say(f"relaunch: stopped by {exc.sigval.name}; the workers are gone")


def _silent(exc: Any) -> None:
    pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``relaunch`` command and return its exit status."""
    level = os.environ.get("LOGLEVEL", "WARNING").upper()  # torchrun's variable
    logging.basicConfig(
        format="relaunch: %(message)s",
        handlers=[_LogHandler()],
        level=level if isinstance(logging.getLevelName(level), int) else "WARNING",
    )
    arguments = sys.argv[1:] if argv is None else list(argv)
    if arguments[:1] == ["store"]:
        from relaunch.cli.store import store_main

        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        _collector_on()
        return store_main(arguments[1:])
    if arguments[:1] == ["status"]:
        from relaunch.cli.status import status_main

        _collector_on()
        return status_main(arguments[1:])
    prepared = prepare(arguments)
    if isinstance(prepared, int):
        return prepared
    args = prepared[0]
    group = None
    if args.replica_groups > 1 or args.replica_group is not None:
        from relaunch.cli.args import replica_group

        group = replica_group(args, os.environ)  # checked by ``prepare`` already
        if group is None:  # one node: this launcher supervises its groups
            return _replica_groups(arguments, *prepared)
        if not _follow_supervisor():
            return 1
        _say_as(f"group {group}: ")
    if args.dry_run:
        return _dry_run(*prepared[1:], group=group, count=args.replica_groups)
    return _launch(*prepared, group=group)


def prepare(
    argv: Sequence[str],
) -> tuple[argparse.Namespace, LaunchConfig, Callable[..., Any] | str, tuple[str, ...]] | int:
    """What ``relaunch ARGV`` runs, checked (flags, ``PET_*``, the scheduler's inference, the
    config, the paths, the open-file limit) without starting anything or touching signal
    handlers; or the exit status of a usage error, said in one line (2)."""
    try:
        args = build_parser().parse_args(argv)
        _apply_scheduler(args, argv, os.environ)
        from relaunch.cli.args import config_from_args

        config, entrypoint, entry_args = config_from_args(args)
        from relaunch.launcher import ensure_open_files

        ensure_open_files(config)  # before anything is said or started
    except (Exception, KeyboardInterrupt) as exc:  # not SystemExit: --help and --version
        ended = end(exc, PREPARE)
        if ended is None:
            raise
        return ended[0]
    return args, config, entrypoint, entry_args


def _apply_scheduler(
    args: argparse.Namespace, argv: Sequence[str], environ: Mapping[str, str]
) -> None:
    """Fill in what the scheduler's environment tells (``core.schedulers.detect``) for every flag
    not given on the command line or as ``PET_*``, and say so in one line."""
    from relaunch.core.schedulers.detect import infer

    inference = infer(environ)
    if inference is None:
        return
    given = explicit_flags(argv, environ)
    if getattr(args, "nproc_per_node", None) == "auto":
        given.discard("nproc_per_node")  # auto: what the scheduler gave the node, where it says
    applied = [dest for dest in inference.values if dest not in given]
    for dest in applied:
        setattr(args, dest, inference.values[dest])
    print(f"relaunch: {inference.describe(applied)}", file=sys.stderr)


def _replica_groups(
    argv: Sequence[str],
    args: argparse.Namespace,
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str,
    entry_args: tuple[str, ...],
) -> int:
    """One node's ``--replica-groups``: print their plans (``--dry-run``) or supervise them
    (``cli.replicas``)."""
    from relaunch.cli.replicas import dry_run_groups, run_groups

    if not args.dry_run:
        _collector_on()
        return run_groups(argv, args, config, say)
    return _show_plan(lambda: dry_run_groups(args, config, entrypoint, entry_args))


def _show_plan(plan: Callable[[], str]) -> int:
    """Print what ``plan`` returns (``--dry-run``: nothing starts); its exit status. A mistake
    it finds ends as any mistake before a launch does (``end``)."""
    try:
        text = plan()
    except Exception as exc:
        ended = end(exc, PREPARE)
        if ended is None:
            raise
        return ended[0]
    sys.stdout.write(text)
    sys.stdout.flush()
    return 0


def _say_as(tag: str) -> None:
    """Every line this launcher says or logs names ``tag`` after ``relaunch:`` (one of several
    replica groups: which one)."""
    global _said_as
    _said_as = tag
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter(f"relaunch: {tag}%(message)s"))


def _follow_supervisor() -> bool:
    """A group agent of one node's supervisor ends with it (SIGTERM: its workers are stopped as
    on any stop), and keeps the supervisor's variables from its workers; False (said) when the
    supervisor is gone already. True for any other launcher."""
    from relaunch.cli.args import GROUP_RUN_ID_ENV, GROUP_STORE_ENV, GROUP_SUPERVISOR_ENV
    from relaunch.runtime import end_with_parent

    supervisor = os.environ.pop(GROUP_SUPERVISOR_ENV, None)
    os.environ.pop(GROUP_STORE_ENV, None)
    os.environ.pop(GROUP_RUN_ID_ENV, None)
    if supervisor is None or not supervisor.isdigit():
        return True
    if end_with_parent(signal.SIGTERM, int(supervisor)):
        return True
    say("relaunch: error: this replica group's supervisor is gone: not starting its workers")
    return False


def _group_env(group: int | None, count: int) -> dict[str, str]:
    """What a replica group's workers get from their agent's environment (none without one)."""
    if group is None:
        return {}
    from relaunch.core.run.replica_groups import group_env

    return group_env(group, count)


def _dry_run(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str,
    entry_args: tuple[str, ...],
    group: int | None = None,
    count: int = 1,
) -> int:
    """Print the plan of this node's first attempt (``agent.dry_run``); start nothing."""
    from relaunch.agent.dry_run import dry_run
    from relaunch.launcher import placement_of

    return _show_plan(
        lambda: dry_run(
            config,
            entrypoint,
            entry_args,
            placement=placement_of(config),
            group_env=_group_env(group, count),
        )
    )


def _launch(
    args: argparse.Namespace,
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str,
    entry_args: tuple[str, ...],
    group: int | None = None,
) -> int:
    from relaunch.core.workers.ranks import omp_num_threads_default
    from relaunch.procs.signals import raise_signal_exception

    try:
        from relaunch.cli.args import make_log_dir

        make_log_dir(config)
        for sig in args.signals_to_handle:
            # Whatever was inherited: a shell starts a background job with SIGINT and SIGQUIT
            # ignored, and ``kill -INT`` must stop it as it stops torchrun. The workers start
            # with each of them at its default (exec resets a handled signal).
            signal.signal(sig, raise_signal_exception)
        from relaunch.launcher import rendezvous_handler

        handler = rendezvous_handler(config)
    except Exception as exc:
        failed = end(exc, CONNECT)
        if failed is None:
            raise
        return failed[0]
    if omp_num_threads_default(config.nproc_per_node, os.environ) is not None:
        say(
            f"relaunch: setting OMP_NUM_THREADS=1 for each of the {config.nproc_per_node} "
            "workers to avoid overloading the machine; set it yourself to tune"
        )
    # a replica group's variables, in the launcher's environment for its workers to inherit
    os.environ.update(_group_env(group, args.replica_groups))
    node = _GroupNode(handler, args, config) if group is not None else None
    _collector_on()
    try:
        status, signalled = _run_agent(config, entrypoint, entry_args, handler)
        if node is not None:
            status = node.end_store(status, wait=not signalled)
    finally:
        if node is not None:
            node.close()
    return status


def _run_agent(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str,
    entry_args: tuple[str, ...],
    handler: Any,
) -> tuple[int, bool]:
    """Run the agent to its end and say its summary: the exit status, and whether a signal
    stopped it."""
    from relaunch.core.run.summary import RunSummary, format_summary
    from relaunch.launcher import launch_agent
    from relaunch.procs.errors import SignalException

    summaries: list[RunSummary] = []
    signalled = False
    try:
        launch_agent(
            config, entrypoint, list(entry_args), handler=handler, on_summary=summaries.append
        )
        status, said_summary = 0, True
    except Exception as exc:
        ended = end(exc, RUN)
        if ended is None:
            raise
        status, said_summary = ended
        signalled = isinstance(exc, SignalException)
    if said_summary:
        for summary in summaries:
            say("relaunch: " + format_summary(summary))
    return status, signalled


class _GroupNode:
    """A replica group's node of a job on several nodes: its part of torchft's lighthouse, and
    the job's store, which serves on past this node's run where this node hosts it
    (``StoreSeat.outlive``): the other groups' agents may still use it."""

    def __init__(self, handler: Any, args: argparse.Namespace, config: LaunchConfig) -> None:
        self._stop_lighthouse = _lighthouse_on_nodes(handler, args, config)
        self._seat = getattr(handler, "seat", None)
        if self._seat is not None:
            self._seat.outlive()

    def end_store(self, status: int, wait: bool) -> int:
        """End the store kept past this node's run: with ``wait``, once the other groups'
        agents left it. A node stopped by a signal does not wait, and a signal during the wait
        ends it; the exit status then says the signal."""
        from relaunch.procs.errors import SignalException

        try:
            if self._seat is not None:
                self._seat.end_store(wait, say)
        except SignalException as exc:
            say(f"relaunch: stopped by {exc.sigval.name}: the job's store ends now")
            return 128 + int(exc.sigval)
        return status

    def close(self) -> None:
        """The store (without waiting, if it still serves), then the lighthouse."""
        if self._seat is not None:
            self._seat.end_store(False, say)
        self._stop_lighthouse()


def _lighthouse_on_nodes(
    handler: Any, args: argparse.Namespace, config: LaunchConfig
) -> Callable[[], None]:
    """A replica group's node of a job on several nodes: its part of torchft's lighthouse
    (``agent.lighthouse_nodes``), its variables in the launcher's environment for the workers
    to inherit; how to stop it."""
    from relaunch.agent.lighthouse_nodes import start_on_nodes

    log_dir = config.log_dir if config.log_dir != os.devnull else None
    extra, stop = start_on_nodes(
        handler,
        args.rdzv_id,
        args.replica_groups,
        os.environ,
        log_dir,
        lambda line: say(f"relaunch: {line}"),
    )
    os.environ.update(extra)
    return stop


class _LogHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr, except that a stop signal raised while a line is written is not swallowed (as
    ``logging`` does with errors in handlers): it reaches the agent, which stops the run."""

    def handleError(self, record: logging.LogRecord) -> None:
        from relaunch.procs.errors import SignalException

        error = sys.exc_info()[1]
        if isinstance(error, SignalException):
            raise error
        super().handleError(record)


#: ``console_main`` turned the cyclic collector off for the start-up (``_collector_on``).
_collector_off_for_start_up = False


def _collector_on() -> None:
    """The collector back on once the start-up is done, if ``console_main`` turned it off; the
    start-up's objects (modules, classes, the config: they live as long as the launcher) frozen
    out of its passes."""
    global _collector_off_for_start_up
    if _collector_off_for_start_up:
        _collector_off_for_start_up = False
        gc.freeze()
        gc.enable()


def console_main() -> None:
    """The ``relaunch`` executable: ``main`` then an immediate exit.

    The start-up loads some 150 modules without the cyclic collector (its passes over them were
    6-8 ms of the launcher's CPU before the first worker starts); ``main`` turns it on before
    the agent or a subcommand runs. Once ``main`` returns, the workers are gone and every file is
    closed, so the interpreter's teardown (about 20 ms of freeing modules) is skipped; output is
    flushed first.
    """
    global _collector_off_for_start_up
    _collector_off_for_start_up = True  # a fresh interpreter's (``__main__`` turned it off first)
    gc.disable()
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
