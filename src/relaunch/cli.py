"""The ``relaunch`` command: argv in, exit status out. The only place that installs signal handlers.

Until the elastic agent lands this drives ``start_processes`` directly on one node: N local
workers, no restarts. Exit status: 0 on success; 1 when workers failed (the report, root cause
first, goes to stderr); 128 + signal when stopped by a signal, once the workers are gone; 2 for
usage errors.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from collections.abc import Sequence
from types import FrameType

from relaunch.core.streams import Std
from relaunch.procs.context import DEFAULT_SHUTDOWN_TIMEOUT, PContext, start_processes
from relaunch.procs.errors import ChildFailedError, SignalException
from relaunch.procs.signals import TERMINATION_SIGNALS

EXIT_FAILED = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """A mistake on the command line: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def _std(text: str) -> Std | dict[int, Std]:
    try:
        return Std.from_str(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="relaunch",
        description="Start N copies of a training script on this machine and watch them as one.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    workers = parser.add_argument_group("workers")
    workers.add_argument(
        "--nproc-per-node", "--nproc_per_node", type=_positive_int, default=1,
        help="number of worker processes on this node",
    )  # fmt: skip
    workers.add_argument(
        "-m", "--module", action="store_true",
        help="run the script as a Python module, like python -m",
    )  # fmt: skip
    workers.add_argument(
        "--no-python", "--no_python", action="store_true",
        help="run the script as a binary, without the Python interpreter",
    )  # fmt: skip
    workers.add_argument(
        "--shutdown-timeout", "--shutdown_timeout", type=_seconds,
        default=DEFAULT_SHUTDOWN_TIMEOUT, help="seconds between the stop signal and SIGKILL",
    )  # fmt: skip
    logs = parser.add_argument_group("logs")
    logs.add_argument(
        "--log-dir", "--log_dir", default=None,
        help="directory for the workers' log files (default: a new temporary directory)",
    )  # fmt: skip
    logs.add_argument(
        "-r", "--redirects", type=_std, default=Std.NONE,
        help="streams to send to log files only: 0 none, 1 stdout, 2 stderr, 3 both, "
        "or per rank as 0:1,1:2",
    )  # fmt: skip
    logs.add_argument(
        "-t", "--tee", type=_std, default=Std.NONE,
        help="streams to send to log files and to the console, prefixed by rank (as -r)",
    )  # fmt: skip
    parser.add_argument("training_script", help="the script, module or binary to run")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser


def _command(args: argparse.Namespace) -> tuple[str, tuple[str, ...]]:
    script = args.training_script
    if args.module and args.no_python:
        raise UsageError("--module and --no-python cannot be used together")
    if args.module:
        return sys.executable, ("-u", "-m", script, *args.training_script_args)
    if args.no_python:
        return script, tuple(args.training_script_args)
    if not os.path.isfile(script):
        raise UsageError(f"training script {script!r} does not exist")
    return sys.executable, ("-u", script, *args.training_script_args)


def _log_dir(requested: str | None) -> str:
    if requested is None:
        return tempfile.mkdtemp(prefix="relaunch_")
    os.makedirs(requested, exist_ok=True)
    return tempfile.mkdtemp(prefix="run_", dir=requested)


def _raise_signal(signum: int, frame: FrameType | None) -> None:
    sigval = signal.Signals(signum)
    raise SignalException(f"relaunch got {sigval.name}", sigval)


def run(args: argparse.Namespace) -> int:
    entrypoint, script_args = _command(args)
    nprocs = args.nproc_per_node
    env = {"LOCAL_WORLD_SIZE": str(nprocs), "WORLD_SIZE": str(nprocs), "GROUP_RANK": "0"}
    envs = {rank: {**env, "LOCAL_RANK": str(rank), "RANK": str(rank)} for rank in range(nprocs)}
    context: PContext | None = None
    try:
        context = start_processes(
            name="default",
            entrypoint=entrypoint,
            args=dict.fromkeys(range(nprocs), script_args),
            envs=envs,
            log_dir=_log_dir(args.log_dir),
            redirects=args.redirects,
            tee=args.tee,
            shutdown_timeout=args.shutdown_timeout,
        )
        result = context.wait()
        assert result is not None
    except SignalException as exc:
        if context is not None:
            context.close(exc.sigval, args.shutdown_timeout)
        print(f"relaunch: stopped by {exc.sigval.name}; the workers are gone", file=sys.stderr)
        return 128 + int(exc.sigval)
    context.close()
    if result.is_failed():
        error = ChildFailedError(os.path.basename(args.training_script), result.failures,
                                 result.stopped)  # fmt: skip
        print(error.format_msg(), file=sys.stderr)
        return EXIT_FAILED
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``relaunch`` command and return its exit status."""
    for sig in TERMINATION_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _raise_signal)
    try:
        args = build_parser().parse_args(argv)
        return run(args)
    except UsageError as exc:
        print(f"relaunch: error: {exc} (see relaunch --help)", file=sys.stderr)
        return EXIT_USAGE
    except (FileNotFoundError, ValueError) as exc:
        print(f"relaunch: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SignalException as exc:
        return 128 + int(exc.sigval)
