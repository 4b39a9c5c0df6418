"""torchrun's flags: the table, and the parser built from it with ``PET_*`` variables as defaults.

Nothing here loads the config code: each flag's value parser (``relaunch.cli.values``) is imported
when a value is first parsed, so ``relaunch --help`` stays cheap.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from relaunch.core.defaults import (
    DEFAULT_EXIT_BARRIER_TIMEOUT,
    DEFAULT_HEALTH_CHECK_COOLDOWN,
    DEFAULT_HEALTH_CHECK_TIMEOUT,
    DEFAULT_SHUTDOWN_TIMEOUT,
    NUMA_MODES,
    START_METHODS,
)
from relaunch.core.streams import Std

DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
EXIT_FAILED = 1
EXIT_USAGE = 2
#: The job failed for a reason that running it again cannot mend (restarts that made no
#: progress, the same failure again and again): a batch script should not requeue it. NVRx's
#: ft_launcher uses the same number.
EXIT_DO_NOT_REQUEUE = 93


def usage_error(exc: BaseException, prog: str) -> int:
    """Report a ``ConfigError`` in one line and return exit status 2; re-raise anything else."""
    from relaunch.config import ConfigError

    if not isinstance(exc, ConfigError):
        raise exc
    print(f"{prog}: error: {one_line(str(exc))} (see {prog} --help)", file=sys.stderr)
    return EXIT_USAGE


def one_line(text: str) -> str:
    """``text`` as one line of printable text: a value quoted in a message (a path, a flag's
    text) cannot break it in two, or reach the terminal as a control sequence."""
    return "".join(
        char if char.isprintable() else repr(char)[1:-1] for char in " ".join(text.splitlines())
    )


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        from relaunch.config import ConfigError

        raise ConfigError(message)


def _checked(name: str, *extra: Any) -> Callable[[str], Any]:
    """The value parser ``relaunch.cli.values.<name>`` for argparse, loaded on first use; its
    ConfigError becomes argparse's error, which names the flag."""

    def parse(text: str) -> Any:
        from relaunch.cli import values
        from relaunch.config import ConfigError

        try:
            return getattr(values, name)(text, *extra)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = name
    return parse


parse_nnodes = _checked("parse_nnodes")
parse_rdzv_conf = _checked("parse_rdzv_conf")


class _Flag:
    """One row of the table: the help group, the names, the default and the value parser."""

    __slots__ = (
        "choices",
        "default",
        "env",
        "group",
        "help",
        "metavar",
        "names",
        "switch",
        "type",
    )

    def __init__(
        self,
        group: str,
        names: tuple[str, ...],
        help: str,
        default: Any = None,
        type: Callable[[str], Any] | None = None,
        switch: bool = False,
        choices: tuple[str, ...] | None = None,
        metavar: str | None = None,
        env: str | None = None,
    ) -> None:
        self.group, self.names, self.help, self.default = group, names, help, default
        self.type, self.switch, self.choices, self.metavar = type, switch, choices, metavar
        #: A variable of torchrun's that sets the default when ``PET_<FLAG>`` is not set.
        self.env = env

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
        "workers per node: a number, cpu, gpu (one per GPU), gpu:LIST (one per listed GPU, "
        "each seeing just those: gpu:1,3 or gpu:0-3) or auto",
        "1",
        _checked("parse_nproc"),
        metavar="N",
    ),
    _Flag(
        "nodes",
        ("--node-rank",),
        "rank of this node: its group rank (static rendezvous), or its place in the order "
        "the group ranks follow (c10d, etcd)",
        None,
        _checked("parse_count", 0),
        metavar="RANK",
    ),
    _Flag(
        "nodes",
        ("--master-addr",),
        "address of the node of rank 0 (static rendezvous)",
        "127.0.0.1",
        _checked("parse_host"),
        metavar="ADDR",
    ),
    _Flag(
        "nodes",
        ("--master-port",),
        "port on the node of rank 0 (static rendezvous; "
        "default: 29500, or a free port when there is one node)",
        None,
        _checked("parse_count", 0),
        metavar="PORT",
    ),
    _Flag(
        "nodes",
        ("--local-addr",),
        "address this node advertises to the others",
        None,
        _checked("parse_host"),
        metavar="ADDR",
    ),
    _Flag(
        "nodes",
        ("--health-check",),
        "shell command run before every join: a node whose check does not exit 0 does not "
        "join, says why, and tries again after --health-check-cooldown",
        None,
        _checked("parse_command"),
        metavar="CMD",
    ),
    _Flag(
        "nodes",
        ("--health-check-timeout",),
        "seconds the health check may run before it is killed and counts as failed",
        DEFAULT_HEALTH_CHECK_TIMEOUT,
        _checked("parse_bound"),
        metavar="SECONDS",
    ),
    _Flag(
        "nodes",
        ("--health-check-cooldown",),
        "seconds between a failed health check and the next",
        DEFAULT_HEALTH_CHECK_COOLDOWN,
        _checked("parse_bound"),
        metavar="SECONDS",
    ),
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
        _checked("parse_rdzv_endpoint"),
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
        _checked("parse_count", 0),
        metavar="N",
    ),
    _Flag(
        "restarts",
        ("--monitor-interval",),
        "seconds between membership checks",
        0.1,
        _checked("parse_seconds", True),
        metavar="SECONDS",
    ),
    _Flag(
        "restarts",
        ("--shutdown-timeout",),
        "seconds between the stop signal and SIGKILL (also TORCH_ELASTIC_SHUTDOWN_TIMEOUT)",
        DEFAULT_SHUTDOWN_TIMEOUT,
        _checked("parse_seconds", False),
        metavar="SECONDS",
        env="TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
    ),
    _Flag(
        "restarts",
        ("--exit-barrier-timeout",),
        "seconds a node whose workers finished waits for the other nodes' before it ends the job",
        DEFAULT_EXIT_BARRIER_TIMEOUT,
        _checked("parse_bound"),
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
        _checked("parse_seconds", True),
        metavar="SECONDS",
    ),
    _Flag(
        "restarts",
        ("--restart-backoff",),
        "seconds before the second restart of a crash loop, doubling up to MAX; a group that "
        "ran 2 x MAX seconds ends the loop",
        "1:30",
        _checked("parse_backoff"),
        metavar="BASE:MAX",
    ),
    _Flag(
        "restarts",
        ("--max-stalled-restarts",),
        "stop the job, exit status 93 (do not requeue), after this many restarts in a row "
        "that made no progress (report_progress steps, sections, heartbeats) or failed the "
        "same way as the first; 0: never",
        3,
        _checked("parse_count", 0),
        metavar="N",
    ),
    _Flag(
        "restarts",
        ("--straggler-factor",),
        "flag a rank whose steps per second (report_progress) fall below the job's median "
        "divided by this",
        1.5,
        _checked("parse_factor"),
        metavar="F",
    ),
    _Flag(
        "restarts",
        ("--signals-to-handle",),
        "signals that stop the workers and relaunch",
        DEFAULT_SIGNALS,
        _checked("parse_signals"),
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
        "workers",
        ("--dry-run",),
        "print the first attempt's plan (each rank's command and environment) and start nothing",
        switch=True,
    ),
    _Flag(
        "workers", ("--start-method",), "how function workers start", "spawn", choices=START_METHODS
    ),
    _Flag(
        "workers",
        ("--device-per-rank",),
        "give each local rank its own CUDA_VISIBLE_DEVICES: the GPU of its index in gpu:LIST, "
        "else in the inherited CUDA_VISIBLE_DEVICES, else GPU LOCAL_RANK",
        switch=True,
    ),
    _Flag(
        "workers",
        ("--virtual-local-rank",),
        "give every worker LOCAL_RANK=0 and one GPU of its own as CUDA_VISIBLE_DEVICES "
        "(torchrun's): the GPU --device-per-rank would give it",
        switch=True,
    ),
    _Flag(
        "workers",
        ("--numa-binding",),
        "bind each worker to CPUs near its GPU (torch's modes): node, socket, exclusive or "
        "core-complex",
        None,
        choices=NUMA_MODES,
        metavar="MODE",
    ),
    _Flag(
        "workers",
        ("--preload",),
        "import these modules (comma-separated: torch,numpy) once, in a process that forks "
        "each Python worker at every start and restart: warm restarts (docs/preload.md)",
        None,
        _checked("parse_preload"),
        metavar="MODULES",
    ),
    _Flag(
        "state",
        ("--state-memory",),
        "shared memory this node keeps for relaunch.save_state, as bytes or with K, M, G or T "
        "(default: a quarter of the machine's memory)",
        None,
        _checked("parse_size"),
        metavar="SIZE",
    ),
    _Flag(
        "state",
        ("--state-dir",),
        "also write each rank's newest saved state here, in the background and at the end, "
        "so that a requeued job resumes from it through load_state()",
        None,
        metavar="DIR",
    ),
    _Flag(
        "state",
        ("--state-persist-every",),
        "write the state to --state-dir every N saves of each rank",
        10,
        _checked("parse_count", 1),
        metavar="N",
    ),
    _Flag(
        "state",
        ("--state-replicas",),
        "copy each node's state to the next N nodes in ring order, so that a job that loses "
        "up to N nodes at once keeps every rank's state (0: no copies)",
        1,
        _checked("parse_count", 0),
        metavar="N",
    ),
    _Flag(
        "state",
        ("--state-copy-every",),
        "copy the saves of every K-th step to the other nodes, and keep each rank's two "
        "newest of them: where each rank saves its own state and a copy takes longer than a "
        "step, a node's loss still finds a step every rank has (then at most 2K-1 steps redone)",
        1,
        _checked("parse_count", 1),
        metavar="K",
    ),
    _Flag(
        "state",
        ("--jit-save-timeout",),
        "when a rank fails, seconds the others that ask relaunch.failure_pending() get to "
        "save_state before they are stopped (0: none)",
        10.0,
        _checked("parse_seconds", False),
        metavar="SECONDS",
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
        _checked("parse_std"),
        metavar="MASK",
    ),
    _Flag(
        "logs",
        ("-t", "--tee"),
        "streams sent to log files and the console, each line prefixed by its rank (values as -r)",
        Std.NONE,
        _checked("parse_std"),
        metavar="MASK",
    ),
    _Flag(
        "logs",
        ("--local-ranks-filter",),
        "show only these local ranks on the console; the others keep their redirected and "
        "tee'd log files, and the rest of their output is dropped, as under torchrun",
        None,
        _checked("parse_ranks_filter"),
        metavar="RANKS",
    ),
    _Flag(
        "logs",
        ("--duplicate-stdout-filters",),
        "copy the tee'd stdout lines that contain any of these strings (comma-separated, ,, "
        "for a comma) to filtered_stdout.log in each attempt's log directory",
        None,
        _checked("parse_filters"),
        metavar="TEXT,...",
    ),
    _Flag(
        "logs",
        ("--duplicate-stderr-filters",),
        "the same for the tee'd stderr lines, to filtered_stderr.log",
        None,
        _checked("parse_filters"),
        metavar="TEXT,...",
    ),
    _Flag(
        "logs",
        ("--logs-specs",),
        "a LogsSpecs class that says where logs go, by its name in the torchrun.logs_specs "
        "entry points (torchrun's); it is given --log-dir, -r, -t and --local-ranks-filter",
        None,
        _checked("parse_logs_specs"),
        metavar="NAME",
    ),
    _Flag(
        "logs",
        ("--event-log-handler",),
        "where status events go: null, console or file:PATH",
        "null",
        metavar="HANDLER",
    ),
    _Flag(
        "logs",
        ("--metrics-port",),
        "serve Prometheus metrics at http://ADDR:PORT/metrics while the agent runs (ADDR: "
        "every interface when left out)",
        None,
        _checked("parse_metrics_port"),
        metavar="[ADDR:]PORT",
    ),
]


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
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
        for name in ("nodes", "rendezvous", "restarts", "state", "workers", "logs")
    }
    for flag in FLAGS:
        long_name = flag.names[-1]
        names = [*flag.names[:-1], *_spellings(long_name)]
        dest = long_name.lstrip("-").replace("-", "_")
        from_env = env.get(f"PET_{dest.upper()}")
        if from_env is None and flag.env is not None:
            from_env = env.get(flag.env)
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


def explicit_flags(argv: Sequence[str], environ: Mapping[str, str]) -> set[str]:
    """The flags (argparse's dests) given on the command line ``argv``, before the training
    script, or through their ``PET_*`` (or torchrun's) variable: what a scheduler's inference
    must not override."""
    spelled: dict[str, str] = {}
    takes_value: set[str] = set()
    for flag in FLAGS:
        dest = flag.names[-1].lstrip("-").replace("-", "_")
        for name in (*flag.names[:-1], *_spellings(flag.names[-1])):
            spelled[name] = dest
        if not flag.switch:
            takes_value.add(dest)
    given = {
        dest
        for flag in FLAGS
        for dest in (flag.names[-1].lstrip("-").replace("-", "_"),)
        if f"PET_{dest.upper()}" in environ or (flag.env is not None and flag.env in environ)
    }
    args = iter(argv)
    for arg in args:
        if not arg.startswith("-"):
            break  # the training script: what follows is its own
        found = spelled.get(arg.split("=", 1)[0])
        if found is None:
            continue
        given.add(found)
        if found in takes_value and "=" not in arg:
            next(args, None)
    return given
