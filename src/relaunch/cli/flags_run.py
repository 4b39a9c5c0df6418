"""The flag table's rows for each run of the workers: how they start, their kept state, their
logs and metrics."""

from __future__ import annotations

from relaunch.cli.flag_row import Flag, checked
from relaunch.core.defaults import NUMA_MODES, START_METHODS
from relaunch.core.workers.streams import Std

RUN_FLAGS = [
    Flag(
        "workers",
        ("--role",),
        "name of the workers' role",
        "default",
        metavar="NAME",
        field="role",
    ),
    Flag(
        "workers",
        ("-m", "--module"),
        "run the script as a Python module, like python -m",
        switch=True,
    ),
    Flag("workers", ("--no-python",), "run the script as a binary, without Python", switch=True),
    Flag(
        "workers",
        ("--run-path",),
        "run the script with runpy.run_path in a function worker",
        switch=True,
    ),
    Flag(
        "workers",
        ("--dry-run",),
        "print the first attempt's plan (each rank's command and environment) and start nothing",
        switch=True,
    ),
    Flag(
        "workers",
        ("--start-method",),
        "how function workers start",
        "spawn",
        choices=START_METHODS,
        field="start_method",
    ),
    Flag(
        "workers",
        ("--device-per-rank",),
        "give each local rank its own CUDA_VISIBLE_DEVICES: the GPU of its index in gpu:LIST, "
        "else in the inherited CUDA_VISIBLE_DEVICES, else GPU LOCAL_RANK",
        switch=True,
        field="device_per_rank",
    ),
    Flag(
        "workers",
        ("--virtual-local-rank",),
        "give every worker LOCAL_RANK=0 and one GPU of its own as CUDA_VISIBLE_DEVICES "
        "(torchrun's): the GPU --device-per-rank would give it",
        switch=True,
        field="virtual_local_rank",
    ),
    Flag(
        "workers",
        ("--numa-binding",),
        "bind each worker to CPUs near its GPU (torch's modes): node, socket, exclusive or "
        "core-complex",
        None,
        choices=NUMA_MODES,
        metavar="MODE",
        field="numa_binding",
    ),
    Flag(
        "workers",
        ("--preload",),
        "import these modules (comma-separated: torch,numpy) once, in a process that forks "
        "each Python worker at every start and restart: warm restarts (docs/preload.md)",
        None,
        checked("parse_preload"),
        metavar="MODULES",
        field="preload",
    ),
    Flag(
        "state",
        ("--state-memory",),
        "shared memory this node keeps for relaunch.save_state, as bytes or with K, M, G or T "
        "(default: a quarter of the machine's memory)",
        None,
        checked("parse_size"),
        metavar="SIZE",
        field="state.memory",
    ),
    Flag(
        "state",
        ("--state-dir",),
        "also write each rank's newest saved state here, in the background and at the end, "
        "so that a requeued job resumes from it through load_state()",
        None,
        metavar="DIR",
        field="state.directory",
    ),
    Flag(
        "state",
        ("--state-persist-every",),
        "write the state to --state-dir every N saves of each rank",
        10,
        checked("parse_count", 1),
        metavar="N",
        field="state.persist_every",
    ),
    Flag(
        "state",
        ("--state-replicas",),
        "copy each node's state to the next N nodes in ring order, so that a job that loses "
        "up to N nodes at once keeps every rank's state (0: no copies)",
        1,
        checked("parse_count", 0),
        metavar="N",
        field="state.replicas",
    ),
    Flag(
        "state",
        ("--state-copy-every",),
        "copy the saves of every K-th step to the other nodes, and keep each rank's two "
        "newest of them: where each rank saves its own state and a copy takes longer than a "
        "step, a node's loss still finds a step every rank has (then at most 2K-1 steps redone)",
        1,
        checked("parse_count", 1),
        metavar="K",
        field="state.copy_every",
    ),
    Flag(
        "state",
        ("--jit-save-timeout",),
        "when a rank fails, seconds the others that ask relaunch.failure_pending() get to "
        "save_state before they are stopped (0: none)",
        10.0,
        checked("parse_seconds", False),
        metavar="SECONDS",
        field="state.jit_save_timeout",
    ),
    Flag(
        "logs",
        ("--log-dir",),
        "base directory for log files (default: a new temporary directory)",
        metavar="DIR",
    ),
    Flag(
        "logs",
        ("-r", "--redirects"),
        "streams sent to log files only: 0 none, 1 stdout, "
        "2 stderr, 3 both, or per rank as 0:1,1:2",
        Std.NONE,
        checked("parse_std"),
        metavar="MASK",
    ),
    Flag(
        "logs",
        ("-t", "--tee"),
        "streams sent to log files and the console, each line prefixed by its rank (values as -r)",
        Std.NONE,
        checked("parse_std"),
        metavar="MASK",
    ),
    Flag(
        "logs",
        ("--local-ranks-filter",),
        "show only these local ranks on the console; the others keep their redirected and "
        "tee'd log files, and the rest of their output is dropped, as under torchrun",
        None,
        checked("parse_ranks_filter"),
        metavar="RANKS",
    ),
    Flag(
        "logs",
        ("--duplicate-stdout-filters",),
        "copy the tee'd stdout lines that contain any of these strings (comma-separated, ,, "
        "for a comma) to filtered_stdout.log in each attempt's log directory",
        None,
        checked("parse_filters"),
        metavar="TEXT,...",
    ),
    Flag(
        "logs",
        ("--duplicate-stderr-filters",),
        "the same for the tee'd stderr lines, to filtered_stderr.log",
        None,
        checked("parse_filters"),
        metavar="TEXT,...",
    ),
    Flag(
        "logs",
        ("--logs-specs",),
        "a LogsSpecs class that says where logs go, by its name in the torchrun.logs_specs "
        "entry points (torchrun's); it is given --log-dir, -r, -t and --local-ranks-filter",
        None,
        checked("parse_logs_specs"),
        metavar="NAME",
    ),
    Flag(
        "logs",
        ("--event-log-handler",),
        "where status events go: null, console or file:PATH",
        "null",
        metavar="HANDLER",
        field="event_log_handler",
    ),
    Flag(
        "logs",
        ("--metrics-port",),
        "serve Prometheus metrics at http://ADDR:PORT/metrics while the agent runs (ADDR: "
        "every interface when left out)",
        None,
        checked("parse_metrics_port"),
        metavar="[ADDR:]PORT",
    ),
]
