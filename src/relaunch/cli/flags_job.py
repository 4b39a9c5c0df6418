"""The flag table's rows for the job: its nodes, its rendezvous, its restarts."""

from __future__ import annotations

from relaunch.cli.flag_row import Flag, checked, parse_nnodes, parse_rdzv_conf
from relaunch.core.defaults import (
    DEFAULT_EXIT_BARRIER_TIMEOUT,
    DEFAULT_HEALTH_CHECK_COOLDOWN,
    DEFAULT_HEALTH_CHECK_TIMEOUT,
    DEFAULT_SHUTDOWN_TIMEOUT,
)

DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"

JOB_FLAGS = [
    Flag(
        "nodes",
        ("--nnodes",),
        "number of nodes, or MIN:MAX for an elastic job",
        "1:1",
        parse_nnodes,
        metavar="N|MIN:MAX",
    ),
    Flag(
        "nodes",
        ("--nproc-per-node",),
        "workers per node: a number, cpu, gpu (one per GPU), gpu:LIST (one per listed GPU, "
        "each seeing just those: gpu:1,3 or gpu:0-3) or auto",
        "1",
        checked("parse_nproc"),
        metavar="N",
    ),
    Flag(
        "nodes",
        ("--node-rank",),
        "rank of this node: its group rank (static rendezvous), or its place in the order "
        "the group ranks follow (c10d, etcd)",
        None,
        checked("parse_count", 0),
        metavar="RANK",
    ),
    Flag(
        "nodes",
        ("--replica-groups",),
        "run R replica groups, each its own world with its own ranks, MASTER_PORT and "
        "restarts: one node runs R groups of --nproc-per-node workers; several nodes form the "
        "groups, nnodes / R each (docs/replica-groups.md)",
        1,
        checked("parse_count", 1),
        metavar="R",
    ),
    Flag(
        "nodes",
        ("--replica-group",),
        "this node's replica group, 0..R-1 (default: from --node-rank, or the scheduler's "
        "node order)",
        None,
        checked("parse_count", 0),
        metavar="G",
    ),
    Flag(
        "nodes",
        ("--master-addr",),
        "address of the node of rank 0 (static rendezvous)",
        "127.0.0.1",
        checked("parse_host"),
        metavar="ADDR",
    ),
    Flag(
        "nodes",
        ("--master-port",),
        "port on the node of rank 0 (static rendezvous; "
        "default: 29500, or a free port when there is one node)",
        None,
        checked("parse_count", 0),
        metavar="PORT",
    ),
    Flag(
        "nodes",
        ("--local-addr",),
        "address this node advertises to the others",
        None,
        checked("parse_host"),
        metavar="ADDR",
        field="local_addr",
    ),
    Flag(
        "nodes",
        ("--health-check",),
        "shell command run before every join: a node whose check does not exit 0 does not "
        "join, says why, and tries again after --health-check-cooldown",
        None,
        checked("parse_command"),
        metavar="CMD",
        field="health.command",
    ),
    Flag(
        "nodes",
        ("--health-check-timeout",),
        "seconds the health check may run before it is killed and counts as failed",
        DEFAULT_HEALTH_CHECK_TIMEOUT,
        checked("parse_bound"),
        metavar="SECONDS",
        field="health.timeout",
    ),
    Flag(
        "nodes",
        ("--health-check-cooldown",),
        "seconds between a failed health check and the next",
        DEFAULT_HEALTH_CHECK_COOLDOWN,
        checked("parse_bound"),
        metavar="SECONDS",
        field="health.cooldown",
    ),
    Flag(
        "rendezvous",
        ("--standalone",),
        "one node: a local rendezvous on a free port, nothing to set up",
        switch=True,
    ),
    Flag(
        "rendezvous",
        ("--rdzv-backend",),
        "rendezvous backend: c10d (the built-in store), etcd (an etcd v3 cluster) or static",
        "static",
        metavar="NAME",
    ),
    Flag(
        "rendezvous",
        ("--rdzv-endpoint",),
        "rendezvous endpoint (etcd: the members, comma-separated)",
        "",
        checked("parse_rdzv_endpoint"),
        metavar="HOST:PORT",
    ),
    Flag(
        "rendezvous", ("--rdzv-id",), "job id shared by every node of the job", "none", metavar="ID"
    ),
    Flag(
        "rendezvous",
        ("--rdzv-conf",),
        "extra rendezvous settings",
        "",
        parse_rdzv_conf,
        metavar="KEY=VALUE,...",
    ),
    Flag(
        "restarts",
        ("--max-restarts",),
        "restarts of the worker group after a failure",
        0,
        checked("parse_count", 0),
        metavar="N",
        field="max_restarts",
    ),
    Flag(
        "restarts",
        ("--monitor-interval",),
        "seconds between membership checks",
        0.1,
        checked("parse_seconds", True),
        metavar="SECONDS",
        field="monitor_interval",
    ),
    Flag(
        "restarts",
        ("--shutdown-timeout",),
        "seconds between the stop signal and SIGKILL (also TORCH_ELASTIC_SHUTDOWN_TIMEOUT)",
        DEFAULT_SHUTDOWN_TIMEOUT,
        checked("parse_seconds", False),
        metavar="SECONDS",
        env="TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
        field="shutdown_timeout",
    ),
    Flag(
        "restarts",
        ("--exit-barrier-timeout",),
        "seconds a node whose workers finished waits for the other nodes' before it ends the job",
        DEFAULT_EXIT_BARRIER_TIMEOUT,
        checked("parse_bound"),
        metavar="SECONDS",
        field="exit_barrier_timeout",
    ),
    Flag(
        "restarts",
        ("--timers",),
        "serve expiry timers (relaunch.timer.expires) to the "
        "workers; also on with TORCHELASTIC_ENABLE_FILE_TIMER=1",
        switch=True,
        field="hang.timers",
    ),
    Flag(
        "restarts",
        ("--hang-timeout",),
        "restart the group when a worker shows no sign of life (output, timer activity) "
        "for this long; the report names the rank the others wait for",
        None,
        checked("parse_seconds", True),
        metavar="SECONDS",
        field="hang.timeout",
    ),
    Flag(
        "restarts",
        ("--restart-backoff",),
        "seconds before the second restart of a crash loop, doubling up to MAX; a group that "
        "ran 2 x MAX seconds ends the loop",
        "1:30",
        checked("parse_backoff"),
        metavar="BASE:MAX",
        field="restart_policy.backoff",
    ),
    Flag(
        "restarts",
        ("--max-stalled-restarts",),
        "stop the job, exit status 93 (do not requeue), after this many restarts in a row "
        "that made no progress (report_progress steps, sections, heartbeats) or failed the "
        "same way as the first; 0: never",
        3,
        checked("parse_count", 0),
        metavar="N",
        field="restart_policy.max_stalled",
    ),
    Flag(
        "restarts",
        ("--straggler-factor",),
        "flag a rank whose steps per second (report_progress) fall below the job's median "
        "divided by this",
        1.5,
        checked("parse_factor"),
        metavar="F",
        field="hang.straggler_factor",
    ),
    Flag(
        "restarts",
        ("--evict-stragglers",),
        "evict a node flagged as a straggler for this long to a waiting spare (one more agent "
        "than the maximum of --nnodes): it is excluded for --rdzv-conf exclude_cooldown and "
        "the group restarts with the spare; without a spare it is only flagged",
        None,
        checked("parse_seconds", True),
        metavar="SECONDS",
        field="hang.evict_stragglers",
    ),
    Flag(
        "restarts",
        ("--signals-to-handle",),
        "signals that stop the workers and relaunch",
        DEFAULT_SIGNALS,
        checked("parse_signals"),
        metavar="SIGNALS",
    ),
]
