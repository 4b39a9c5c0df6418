"""``relaunch`` itself: parse the flags, check the config, run the agent, map the outcome.

The only place that installs signal handlers. Exit status: 0 on success; 1 when workers failed
(the report, root cause first, goes to stderr); 128 + signal when stopped by a signal, once the
workers are gone; 2 for bad input (a usage error or a ``ConfigError``), reported in one line with
no traceback. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from relaunch.cli.flags import EXIT_FAILED, build_parser, explicit_flags, usage_error

if TYPE_CHECKING:
    from relaunch.config import LaunchConfig


def count_gpus(environ: Mapping[str, str]) -> int:
    """GPUs visible to workers, without importing a framework."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return 0 if visible.strip() in ("", "-1") else len(visible.split(","))
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        listing = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in listing.splitlines() if line.startswith("GPU "))


def _gpus_for(nproc_per_node: str) -> int:
    """This machine's GPUs, counted only when ``--nproc-per-node`` asks for them (``gpu:LIST``:
    to check the list)."""
    asks = nproc_per_node in ("gpu", "auto") or nproc_per_node.startswith("gpu:")
    return count_gpus(os.environ) if asks else 0


def resolve_nproc(value: str) -> int:
    """``relaunch.config.resolve_nproc`` with this machine's CPUs and GPUs."""
    from relaunch import config

    return config.resolve_nproc(value, os.cpu_count() or 1, _gpus_for(value))


def config_from_args(
    args: argparse.Namespace,
) -> tuple[LaunchConfig, Callable[..., Any] | str, tuple[str, ...]]:
    """``relaunch.config.config_from_args`` with this process's environment and GPUs."""
    from relaunch import config

    return config.config_from_args(
        args, os.environ, _gpus_for(args.nproc_per_node), fresh_run_id=config.new_run_id()
    )


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
        return store_main(arguments[1:])
    if arguments[:1] == ["status"]:
        from relaunch.cli.status import status_main

        return status_main(arguments[1:])
    prepared = prepare(arguments)
    if isinstance(prepared, int):
        return prepared
    return _launch(*prepared)


def prepare(
    argv: Sequence[str],
) -> tuple[argparse.Namespace, LaunchConfig, Callable[..., Any] | str, tuple[str, ...]] | int:
    """What ``relaunch ARGV`` runs, checked (flags, ``PET_*``, the scheduler's inference, the
    config, the paths, the open-file limit) without starting anything or touching signal
    handlers; or the exit status of a usage error, said in one line (2)."""
    try:
        args = build_parser().parse_args(argv)
        _apply_scheduler(args, argv, os.environ)
        config, entrypoint, entry_args = config_from_args(args)
        from relaunch.launcher import ensure_open_files

        ensure_open_files(config)  # before anything is said or started
    except KeyboardInterrupt:  # Ctrl-C while GPUs are counted: nothing started
        return 128 + signal.SIGINT
    except Exception as exc:  # a ConfigError (its module is not loaded for --help); else a bug
        return usage_error(exc, "relaunch")
    return args, config, entrypoint, entry_args


def _apply_scheduler(
    args: argparse.Namespace, argv: Sequence[str], environ: Mapping[str, str]
) -> None:
    """Fill in what the scheduler's environment tells (``core.schedulers``) for every flag not
    given on the command line or as ``PET_*``, and say so in one line."""
    from relaunch.core.schedulers import infer

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


def _launch(
    args: argparse.Namespace,
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str,
    entry_args: tuple[str, ...],
) -> int:
    from relaunch.config import ConfigError
    from relaunch.core.ranks import omp_num_threads_default
    from relaunch.core.summary import RunSummary, format_summary
    from relaunch.procs.errors import ChildFailedError, SignalException
    from relaunch.procs.signals import raise_signal_exception
    from relaunch.rendezvous.api import RendezvousClosedError, RendezvousError

    try:
        for sig in args.signals_to_handle:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, raise_signal_exception)
        from relaunch.launcher import launch_agent, rendezvous_handler

        handler = rendezvous_handler(config)
    except ConfigError as exc:
        return usage_error(exc, "relaunch")
    except RendezvousError as exc:
        _say(f"relaunch: error: {exc}")
        return EXIT_FAILED
    except SignalException as exc:
        return 128 + int(exc.sigval)
    if omp_num_threads_default(config.nproc_per_node, os.environ) is not None:
        _say(
            f"relaunch: setting OMP_NUM_THREADS=1 for each of the {config.nproc_per_node} "
            "workers to avoid overloading the machine; set it yourself to tune"
        )
    summaries: list[RunSummary] = []
    try:
        launch_agent(
            config, entrypoint, list(entry_args), handler=handler, on_summary=summaries.append
        )
        code = 0
    except RendezvousClosedError as exc:
        _say(f"relaunch: {exc}: nothing to do")
        return 0
    except ConfigError as exc:  # what only starting can tell: the metrics port is taken
        return usage_error(exc, "relaunch")
    except RendezvousError as exc:
        _say(f"relaunch: error: {exc}")
        code = EXIT_FAILED
    except ChildFailedError as exc:
        _say(exc.format_msg())  # the root cause first, then the summary
        code = EXIT_FAILED
    except SignalException as exc:
        _say(f"relaunch: stopped by {exc.sigval.name}; the workers are gone")
        code = 128 + int(exc.sigval)
    for summary in summaries:
        _say("relaunch: " + format_summary(summary))
    return code


def _say(line: str) -> None:
    """Print ``line`` on stderr; a stderr that takes nothing (a closed pipe, ``/dev/full``) must
    not change the job's exit status, so the line is dropped then."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


class _LogHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr, except that a stop signal raised while a line is written is not swallowed (as
    ``logging`` does with errors in handlers): it reaches the agent, which stops the run."""

    def handleError(self, record: logging.LogRecord) -> None:
        from relaunch.procs.errors import SignalException

        error = sys.exc_info()[1]
        if isinstance(error, SignalException):
            raise error
        super().handleError(record)


def console_main() -> None:
    """The ``relaunch`` executable: ``main`` then an immediate exit.

    Once ``main`` returns, the workers are gone and every file is closed, so the interpreter's
    teardown (about 20 ms of freeing modules) is skipped; output is flushed first.
    """
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
