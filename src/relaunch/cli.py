"""The ``relaunch`` command: torchrun's flags in, an exit status out.

The only place that installs signal handlers. Exit status: 0 on success; 1 when workers failed
(the report, root cause first, goes to stderr); 128 + signal when stopped by a signal, once the
workers are gone; 2 for usage errors, reported in one line with no traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from relaunch.core.ranks import omp_num_threads_default
from relaunch.core.streams import Std, per_rank
from relaunch.core.summary import RunSummary, format_summary
from relaunch.endpoints import is_loopback, parse_endpoint
from relaunch.procs.context import DEFAULT_SHUTDOWN_TIMEOUT, START_METHODS
from relaunch.procs.errors import ChildFailedError, SignalException
from relaunch.rendezvous.api import (
    BACKENDS,
    TOKEN_ENV,
    RendezvousClosedError,
    RendezvousError,
)

EXIT_FAILED = 1
EXIT_USAGE = 2
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


class UsageError(Exception):
    """A mistake on the command line: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


# -- value parsers: each raises ArgumentTypeError with what is expected --------------------------


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4)."""
    parts = text.split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(
            f"expected N or MIN:MAX with whole numbers >= 1, got {text!r}"
        )
    low, high = int(parts[0]), int(parts[-1])
    if low > high:
        raise argparse.ArgumentTypeError(f"MIN must not exceed MAX, got {text!r}")
    return low, high


def _nproc(text: str) -> str:
    if text in ("cpu", "gpu", "auto") or (text.isdigit() and int(text) >= 1):
        return text
    raise argparse.ArgumentTypeError(
        f"expected a whole number >= 1, or cpu, gpu or auto, got {text!r}"
    )


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if text.strip().lstrip("-").isdigit() and int(text) >= minimum:
            return int(text)
        raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}")

    return parse


def _seconds(positive: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if value < 0 or (positive and value == 0):
            bound = "> 0" if positive else ">= 0"
            raise argparse.ArgumentTypeError(f"expected a number of seconds {bound}, got {text!r}")
        return value

    return parse


def _std(text: str) -> Std | dict[int, Std]:
    try:
        return Std.from_str(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """``"a=1,b=x"`` -> ``{"a": "1", "b": "x"}``."""
    conf: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE[,KEY=VALUE...], got {text!r}")
        conf[key.strip()] = value.strip()
    return conf


def _endpoint(text: str) -> str:
    """``HOST:PORT``, or for etcd a list of members ``HOST:PORT,HOST:PORT`` (``http(s)://``)."""
    for item in text.split(",") if text else ():
        try:
            parse_endpoint(item.partition("://")[2] or item, default_port=0)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _ranks_filter(text: str) -> set[int]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items or not all(item.isdigit() for item in items):
        raise argparse.ArgumentTypeError(f"expected local ranks such as 0,3, got {text!r}")
    return {int(item) for item in items}


def _signals(text: str) -> list[signal.Signals]:
    found = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name = item.upper() if item.upper().startswith("SIG") else f"SIG{item.upper()}"
        try:
            found.append(signal.Signals(int(item)) if item.isdigit() else signal.Signals[name])
        except (KeyError, ValueError):
            raise argparse.ArgumentTypeError(
                f"unknown signal {item!r}: expected names such as {DEFAULT_SIGNALS}"
            ) from None
    return found


# -- the parser ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Flag:
    group: str
    names: tuple[str, ...]
    help: str
    default: Any = None
    type: Callable[[str], Any] | None = None
    switch: bool = False
    choices: tuple[str, ...] | None = None
    metavar: str | None = None

    def help_text(self) -> str:
        shown = self.default
        if isinstance(shown, Std):
            shown = int(shown)
        if shown is None or shown == "" or self.switch:
            return self.help
        return f"{self.help} (default: {shown})"


def _spellings(name: str) -> tuple[str, ...]:
    """``--nproc-per-node`` and ``--nproc_per_node``."""
    underscored = "--" + name[2:].replace("-", "_")
    return (name,) if underscored == name else (name, underscored)


FLAGS = [
    _Flag(
        "nodes",
        ("--nnodes",),
        "number of nodes, or MIN:MAX for an elastic job",
        "1:1",
        parse_nnodes,
        metavar="N|MIN:MAX",
    ),
    _Flag(
        "nodes",
        ("--nproc-per-node",),
        "workers per node: a number, cpu, gpu or auto",
        "1",
        _nproc,
        metavar="N",
    ),
    _Flag(
        "nodes",
        ("--node-rank",),
        "rank of this node (static rendezvous)",
        0,
        _count(0),
        metavar="RANK",
    ),
    _Flag(
        "nodes",
        ("--master-addr",),
        "address of the node of rank 0 (static rendezvous)",
        "127.0.0.1",
        metavar="ADDR",
    ),
    _Flag(
        "nodes",
        ("--master-port",),
        "port on the node of rank 0 (static rendezvous; "
        "default: 29500, or a free port when there is one node)",
        None,
        _count(0),
        metavar="PORT",
    ),
    _Flag("nodes", ("--local-addr",), "address this node advertises to the others", metavar="ADDR"),
    _Flag(
        "rendezvous",
        ("--standalone",),
        "one node: a local rendezvous on a free port, nothing to set up",
        switch=True,
    ),
    _Flag(
        "rendezvous",
        ("--rdzv-backend",),
        "rendezvous backend: c10d (the built-in store), etcd (an etcd v3 cluster) or static",
        "static",
        metavar="NAME",
    ),
    _Flag(
        "rendezvous",
        ("--rdzv-endpoint",),
        "rendezvous endpoint (etcd: the members, comma-separated)",
        "",
        _endpoint,
        metavar="HOST:PORT",
    ),
    _Flag(
        "rendezvous", ("--rdzv-id",), "job id shared by every node of the job", "none", metavar="ID"
    ),
    _Flag(
        "rendezvous",
        ("--rdzv-conf",),
        "extra rendezvous settings",
        "",
        parse_rdzv_conf,
        metavar="KEY=VALUE,...",
    ),
    _Flag(
        "restarts",
        ("--max-restarts",),
        "restarts of the worker group after a failure",
        0,
        _count(0),
        metavar="N",
    ),
    _Flag(
        "restarts",
        ("--monitor-interval",),
        "seconds between membership checks",
        0.1,
        _seconds(positive=True),
        metavar="SECONDS",
    ),
    _Flag(
        "restarts",
        ("--shutdown-timeout",),
        "seconds between the stop signal and SIGKILL",
        DEFAULT_SHUTDOWN_TIMEOUT,
        _seconds(positive=False),
        metavar="SECONDS",
    ),
    _Flag(
        "restarts",
        ("--timers",),
        "serve expiry timers (relaunch.timer.expires) to the "
        "workers; also on with TORCHELASTIC_ENABLE_FILE_TIMER=1",
        switch=True,
    ),
    _Flag(
        "restarts",
        ("--hang-timeout",),
        "restart the group when a worker shows no sign of "
        "life (output, timer activity) for this long, with its stack in the report",
        None,
        _seconds(positive=True),
        metavar="SECONDS",
    ),
    _Flag(
        "restarts",
        ("--signals-to-handle",),
        "signals that stop the workers and relaunch",
        DEFAULT_SIGNALS,
        _signals,
        metavar="SIGNALS",
    ),
    _Flag("workers", ("--role",), "name of the workers' role", "default", metavar="NAME"),
    _Flag(
        "workers",
        ("-m", "--module"),
        "run the script as a Python module, like python -m",
        switch=True,
    ),
    _Flag("workers", ("--no-python",), "run the script as a binary, without Python", switch=True),
    _Flag(
        "workers",
        ("--run-path",),
        "run the script with runpy.run_path in a function worker",
        switch=True,
    ),
    _Flag(
        "workers", ("--start-method",), "how function workers start", "spawn", choices=START_METHODS
    ),
    _Flag(
        "logs",
        ("--log-dir",),
        "base directory for log files (default: a new temporary directory)",
        metavar="DIR",
    ),
    _Flag(
        "logs",
        ("-r", "--redirects"),
        "streams sent to log files only: 0 none, 1 stdout, "
        "2 stderr, 3 both, or per rank as 0:1,1:2",
        Std.NONE,
        _std,
        metavar="MASK",
    ),
    _Flag(
        "logs",
        ("-t", "--tee"),
        "streams sent to log files and the console, each line prefixed by its rank (values as -r)",
        Std.NONE,
        _std,
        metavar="MASK",
    ),
    _Flag(
        "logs",
        ("--local-ranks-filter",),
        "show only these local ranks on the console (the log files keep everything)",
        None,
        _ranks_filter,
        metavar="RANKS",
    ),
    _Flag(
        "logs",
        ("--event-log-handler",),
        "where status events go: null, console or file:PATH",
        "null",
        metavar="HANDLER",
    ),
]


def build_parser(environ: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """torchrun's flags, each with its dash and underscore spelling and its PET_* variable."""
    env = os.environ if environ is None else environ
    parser = _Parser(
        prog="relaunch",
        description="Launch a distributed job: N workers per node, watched and restarted as one. "
        "Each flag can also be set by the environment variable PET_<FLAG> "
        "(e.g. PET_NPROC_PER_NODE=4).",
    )
    groups = {
        name: parser.add_argument_group(name)
        for name in ("nodes", "rendezvous", "restarts", "workers", "logs")
    }
    for flag in FLAGS:
        long_name = flag.names[-1]
        names = [*flag.names[:-1], *_spellings(long_name)]
        dest = long_name.lstrip("-").replace("-", "_")
        from_env = env.get(f"PET_{dest.upper()}")
        group = groups[flag.group]
        if flag.switch:
            switched_on = from_env is not None and from_env.lower() in ("1", "true", "yes")
            group.add_argument(
                *names, dest=dest, action="store_true", default=switched_on, help=flag.help_text()
            )
            continue
        # argparse converts a string default with ``type``, so PET_* values are checked too.
        default = flag.default if from_env is None else from_env
        group.add_argument(
            *names,
            dest=dest,
            default=default,
            type=flag.type or str,
            choices=flag.choices,
            metavar=flag.metavar,
            help=flag.help_text(),
        )
    parser.add_argument("training_script", help="the script, module or binary to run")
    parser.add_argument(
        "training_script_args", nargs=argparse.REMAINDER, help="arguments passed to every worker"
    )
    return parser


# -- from flags to a launch ------------------------------------------------------------------------


def count_gpus(environ: dict[str, str] | os._Environ[str]) -> int:
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


def resolve_nproc(value: str) -> int:
    if value.isdigit():
        return int(value)
    cpus = os.cpu_count() or 1
    if value == "cpu":
        return cpus
    gpus = count_gpus(os.environ)
    if value == "gpu" and gpus == 0:
        raise UsageError(
            "--nproc-per-node gpu: no GPU found (CUDA_VISIBLE_DEVICES and nvidia-smi -L list "
            "none); give a number or use cpu"
        )
    return gpus or cpus


def _command(args: argparse.Namespace) -> tuple[Callable[..., Any] | str, tuple[str, ...]]:
    script: str = args.training_script
    rest = tuple(args.training_script_args)
    modes = [
        flag
        for flag, on in (
            ("--module", args.module),
            ("--no-python", args.no_python),
            ("--run-path", args.run_path),
        )
        if on
    ]
    if len(modes) > 1:
        raise UsageError(f"{' and '.join(modes)} cannot be used together")
    if args.no_python:
        if os.sep in script:
            usable = os.path.isfile(script) and os.access(script, os.X_OK)
        else:
            usable = shutil.which(script) is not None
        if not usable:
            raise UsageError(f"binary {script!r} was not found or is not executable")
        return script, rest
    if args.module:
        return sys.executable, ("-u", "-m", script, *rest)
    if not os.path.isfile(script):
        raise UsageError(f"training script {script!r} does not exist")
    if args.run_path:
        from relaunch._run_path import run_script

        return run_script, (script, *rest)
    return sys.executable, ("-u", script, *rest)


def _console_filter(
    args: argparse.Namespace, nproc: int
) -> tuple[Std | dict[int, Std], Std | dict[int, Std]]:
    """Apply --local-ranks-filter: the other ranks go to their log files only."""
    if args.local_ranks_filter is None:
        return args.redirects, args.tee
    redirects, tee = per_rank(args.redirects, nproc), per_rank(args.tee, nproc)
    for rank in range(nproc):
        if rank not in args.local_ranks_filter:
            redirects[rank], tee[rank] = Std.ALL, Std.NONE
    return redirects, tee


def config_from_args(
    args: argparse.Namespace,
) -> tuple[Any, Callable[..., Any] | str, tuple[str, ...]]:
    """The ``LaunchConfig``, the entrypoint and its arguments the flags describe."""
    from relaunch.launcher import LaunchConfig

    nproc = resolve_nproc(args.nproc_per_node)
    min_nodes, max_nodes = args.nnodes
    backend = args.rdzv_backend
    run_id = args.rdzv_id
    endpoint = args.rdzv_endpoint
    rdzv_configs: dict[str, Any] = dict(args.rdzv_conf)
    if args.standalone:
        if max_nodes != 1:
            raise UsageError("--standalone runs one node: drop --nnodes or use --rdzv-backend")
        from relaunch.launcher import new_run_id

        backend, endpoint, run_id = "c10d", "127.0.0.1:0", new_run_id()
        rdzv_configs["is_host"] = "true"
    if backend not in BACKENDS:
        raise UsageError(
            f"--rdzv-backend {backend!r} is unknown: valid backends are " + ", ".join(BACKENDS)
        )
    if backend == "static" and not endpoint:
        port = args.master_port
        if port is None:
            port = 0 if max_nodes == 1 else 29500
        endpoint = f"{args.master_addr}:{port}"
    if backend == "static":
        if min_nodes != max_nodes:
            raise UsageError(
                f"--nnodes {min_nodes}:{max_nodes} needs an elastic rendezvous backend; the "
                "static backend takes a fixed number of nodes"
            )
        if args.node_rank >= max_nodes:
            raise UsageError(f"--node-rank {args.node_rank} must be below --nnodes {max_nodes}")
        rdzv_configs["rank"] = args.node_rank
    elif not endpoint:
        raise UsageError(f"--rdzv-backend {backend} needs --rdzv-endpoint HOST:PORT")
    elif "," in endpoint and not backend.startswith("etcd"):
        raise UsageError(
            f"--rdzv-backend {backend} takes one --rdzv-endpoint HOST:PORT; a "
            "list of members is for --rdzv-backend etcd"
        )
    redirects, tee = _console_filter(args, nproc)
    from relaunch.events import event_handler_from_spec

    event_handler_from_spec(args.event_log_handler).close()
    entrypoint, entry_args = _command(args)
    config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        run_id=run_id,
        role=args.role,
        rdzv_endpoint=endpoint,
        rdzv_backend=backend,
        rdzv_configs=rdzv_configs,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        start_method=args.start_method,
        log_dir=args.log_dir,
        redirects=redirects,
        tee=tee,
        local_addr=args.local_addr,
        shutdown_timeout=args.shutdown_timeout,
        event_log_handler=args.event_log_handler,
        timers=True if args.timers else None,
        hang_timeout=args.hang_timeout,
    )
    return config, entrypoint, entry_args


def _loopback(host: str) -> str:
    if not is_loopback(host):
        raise argparse.ArgumentTypeError(
            f"the standalone store listens on loopback only, got {host!r}: use 127.0.0.1"
        )
    return host


def store_main(argv: Sequence[str]) -> int:
    """``relaunch store``: serve the built-in rendezvous store in the foreground until stopped."""
    parser = _Parser(
        prog="relaunch store",
        description="Serve the built-in rendezvous store until SIGTERM or SIGINT.",
    )
    parser.add_argument(
        "--host",
        type=_loopback,
        default="127.0.0.1",
        help="loopback address to listen on (default: 127.0.0.1)",
    )
    parser.add_argument(
        "--port",
        type=_count(0),
        default=29400,
        help="port to listen on, 0 for any free one (default: 29400)",
    )
    parser.add_argument(
        "--token", default=None, help=f"shared secret clients must prove (default: ${TOKEN_ENV})"
    )
    try:
        args = parser.parse_args(argv)
        from relaunch.store.server import TcpStoreServer

        server = TcpStoreServer(args.host, args.port, args.token or os.environ.get(TOKEN_ENV))
    except UsageError as exc:
        print(f"relaunch store: error: {exc} (see relaunch store --help)", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(
            f"relaunch store: error: cannot listen on {args.host}:{args.port}: {exc.strerror}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    print(f"relaunch store: serving on {server.endpoint}", flush=True)
    try:
        server.start()
        signal.sigwait({signal.SIGTERM, signal.SIGINT})
    finally:
        server.stop()
    return 0


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
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        return store_main(arguments[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        from relaunch.procs.signals import raise_signal_exception

        for sig in args.signals_to_handle:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, raise_signal_exception)
        config, entrypoint, entry_args = config_from_args(args)
        from relaunch.launcher import launch_agent, rendezvous_handler

        handler = rendezvous_handler(config)
    except (UsageError, ValueError) as exc:
        print(f"relaunch: error: {exc} (see relaunch --help)", file=sys.stderr)
        return EXIT_USAGE
    except RendezvousError as exc:
        print(f"relaunch: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except SignalException as exc:
        return 128 + int(exc.sigval)
    if omp_num_threads_default(config.nproc_per_node, os.environ) is not None:
        print(
            f"relaunch: setting OMP_NUM_THREADS=1 for each of the {config.nproc_per_node} "
            "workers to avoid overloading the machine; set it yourself to tune",
            file=sys.stderr,
        )
    summaries: list[RunSummary] = []
    try:
        launch_agent(
            config, entrypoint, list(entry_args), handler=handler, on_summary=summaries.append
        )
        code = 0
    except RendezvousClosedError as exc:
        print(f"relaunch: {exc}: nothing to do", file=sys.stderr)
        return 0
    except RendezvousError as exc:
        print(f"relaunch: error: {exc}", file=sys.stderr)
        code = EXIT_FAILED
    except ChildFailedError as exc:
        print(exc.format_msg(), file=sys.stderr)  # the root cause first, then the summary
        code = EXIT_FAILED
    except SignalException as exc:
        print(f"relaunch: stopped by {exc.sigval.name}; the workers are gone", file=sys.stderr)
        code = 128 + int(exc.sigval)
    for summary in summaries:
        print("relaunch: " + format_summary(summary), file=sys.stderr)
    return code


class _LogHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr, except that a stop signal raised while a line is written is not swallowed (as
    ``logging`` does with errors in handlers): it reaches the agent, which stops the run."""

    def handleError(self, record: logging.LogRecord) -> None:
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
