"""One launch configuration: ``LaunchConfig``, and the rules on it.

The checks on what a launch may be raise ``ConfigError`` (a ``ValueError``), which the
``relaunch`` command reports in one line with exit status 2. Here:

- ``LaunchConfig.__post_init__``: the counts and durations every launch needs (nodes, workers,
  restarts, timeouts, placement);
- ``LaunchConfig.rendezvous_settings``: ``rdzv_configs`` (``--rdzv-conf``) as the backend reads
  it, typed and checked once (``core.rendezvous.rdzv_conf``);
- ``check_rendezvous``: the rendezvous as a whole (backend, nodes, endpoint).

This module imports nothing of relaunch's but ``core`` and ``endpoints``: the flags become a
config in ``relaunch.cli.args``, which also checks what only the other layers can tell (the
event log, the log directory, the etcd members, the timer FIFO, the training script).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

from relaunch.core.defaults import (
    DEFAULT_EXIT_BARRIER_TIMEOUT,
    DEFAULT_SHUTDOWN_TIMEOUT,
    MAX_NPROC_PER_NODE,
    NUMA_MODES,
    numa_binding_of,
)
from relaunch.core.output.console_plan import agent_tee, console_shared, relayed
from relaunch.core.rendezvous import rdzv_conf
from relaunch.core.rendezvous.rdzv_conf import (
    BACKENDS,
    ETCD_BACKENDS,
    STATIC_BACKEND,
    RendezvousSettings,
    redacted,
)
from relaunch.core.run.settings import (
    GROUPS,
    UNSET,
    HangSettings,
    HealthSettings,
    MetricsEndpoint,
    RestartPolicy,
    check_seconds,
)
from relaunch.core.workers.logs_specs import LogsSpecs, is_logs_specs
from relaunch.core.workers.state_settings import StateSettings
from relaunch.core.workers.streams import Std, per_rank
from relaunch.endpoints import parse_endpoint, parse_endpoint_list

#: ``--signals-to-handle`` when not given (torchrun's).
DEFAULT_SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


class ConfigError(ValueError):
    """A launch that cannot be: the message says what is wrong and what to do."""


# -- the config ----------------------------------------------------------------------------------


# Its own __repr__, __eq__ and __hash__: dataclass compiles each method it makes, at every launch.
@dataclass(frozen=True, repr=False, eq=False)
class LaunchConfig:
    """How to launch: nodes, workers per node, rendezvous, restarts, logs.

    ``rdzv_backend="static"`` with ``rdzv_endpoint="MASTER_ADDR:MASTER_PORT"`` and
    ``rdzv_configs={"rank": NODE_RANK}`` runs a fixed set of nodes; a port of 0 picks a free one
    (one node). ``metrics_cfg`` may name ``{"handler": "console" | "file:PATH" | "null"}``.
    Frozen, and its dicts are copies of the caller's: change one with ``dataclasses.replace``.

    The settings groups (``restart_policy``, ``hang``, ``health``, ``metrics_endpoint``,
    ``state``: ``core.run.settings``) may be given whole, or by their flat fields (``hang_timeout``
    ...), which always read as their group's: a flat field given beside its group wins (so
    ``dataclasses.replace`` changes a group's setting through its flat field, if it has one).
    """

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    run_id: str = ""
    #: torch's LaunchConfig default ("default_role"); the ``relaunch`` command passes its
    #: ``--role`` ("default", torchrun's).
    role: str = "default_role"
    rdzv_endpoint: str = ""
    rdzv_backend: str = "static"
    rdzv_configs: dict[str, Any] = field(default_factory=dict)
    rdzv_timeout: int = -1
    max_restarts: int = 3
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_dir: str | None = None
    redirects: Std | dict[int, Std] = Std.NONE
    tee: Std | dict[int, Std] = Std.NONE
    metrics_cfg: dict[str, str] = field(default_factory=dict)
    local_addr: str | None = None
    #: Seconds the workers get to stop after SIGTERM (None, torch's default: relaunch's 30).
    shutdown_timeout: float | None = DEFAULT_SHUTDOWN_TIMEOUT
    event_log_handler: str = "null"
    #: Run a file timer server for ``relaunch.timer.expires`` (None: when
    #: ``TORCHELASTIC_ENABLE_FILE_TIMER=1``); restart when a worker hangs this many seconds.
    timers: bool | None = UNSET
    hang_timeout: float | None = UNSET
    #: Seconds before the second restart of a crash loop, doubling up to the second number.
    restart_backoff: tuple[float, float] = UNSET
    #: Stop the job after this many restarts in a row that made no progress (0: never).
    max_stalled_restarts: int = UNSET
    #: Flag a node whose ranks spend this times the other nodes' time in a section, or step
    #: below the job's median rate divided by this (``core.workers.stragglers``).
    straggler_factor: float = UNSET
    #: torchrun's ``--signals-to-handle``, given to workers as ``TORCHELASTIC_SIGNALS_TO_HANDLE``.
    signals_to_handle: str = DEFAULT_SIGNALS_TO_HANDLE
    #: Seconds a node whose workers finished waits for the other nodes' before closing the job.
    exit_barrier_timeout: float = DEFAULT_EXIT_BARRIER_TIMEOUT
    #: A shell command run before every join (exit 0: this node is healthy and joins), how long
    #: it may run, and how long a node whose check failed waits before the next.
    health_check: str | None = UNSET
    health_check_timeout: float = UNSET
    health_check_cooldown: float = UNSET
    #: Serve Prometheus metrics on this port (0: a free one; None: none), on ``metrics_host``
    #: ("": every interface).
    metrics_port: int | None = UNSET
    metrics_host: str = UNSET
    #: Device placement (``relaunch.core.workers.placement``): the GPUs of ``--nproc-per-node
    #: gpu:LIST`` (one worker each; None: not given), a device per rank (``--device-per-rank``), and
    #: torch's ``--numa-binding`` mode.
    devices: tuple[int, ...] | None = None
    device_per_rank: bool = False
    numa_binding: str | None = None
    #: torch's ``local_ranks_filter`` (the seeds' form, beside ``log_dir``, ``redirects`` and
    #: ``tee``): the local ranks shown on the console; the others' streams neither redirected
    #: nor tee'd are dropped (None: every rank's shown).
    local_ranks_filter: frozenset[int] | None = None
    #: torch 2.13's form: a ``LogsSpecs`` (``relaunch.procs.DefaultLogsSpecs`` or a user's
    #: own) that says where each attempt's logs go, in place of the four fields above.
    logs_specs: LogsSpecs | None = None
    #: torch's: each rank's console prefix, from ``${role_name}``, ``${rank}`` and
    #: ``${local_rank}`` (None: ``[{role}{local_rank}]:``); the ``relaunch`` command reads it
    #: from ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``, as torchrun does.
    log_line_prefix_template: str | None = None
    #: torch's: copy the tee'd stdout (stderr) lines of every rank that contain any of these
    #: strings to one file of each attempt, ``filtered_stdout.log`` (``filtered_stderr.log``).
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    #: torch's ``NumaOptions``: its ``affinity_mode`` becomes ``numa_binding`` (the same modes).
    numa_options: Any = None
    #: torch's: every worker has ``LOCAL_RANK=0`` and sees only its own GPU.
    virtual_local_rank: bool = False
    #: Modules a zygote imports once, from which each Python worker is forked at every start
    #: (``--preload``; ``relaunch.procs.zygote``); empty: every worker starts cold.
    preload: tuple[str, ...] = ()
    #: ``relaunch.save_state``: at most this many bytes of shared memory for the node's kept
    #: state (None: a quarter of the machine's memory); a copy in ``state_dir`` every
    #: ``state_persist_every`` saves of each rank and at the end (None: none); and how long a
    #: failure waits for the saves of workers that listen (``failure_pending``; 0: no wait);
    #: the nodes next in ring order that keep a copy of the node's state (0: none), and every
    #: how many steps they get one (every node copies the same steps: ``core.workers.state``).
    state_memory: int | None = UNSET
    state_dir: str | None = UNSET
    state_persist_every: int = UNSET
    jit_save_timeout: float = UNSET
    state_replicas: int = UNSET
    state_copy_every: int = UNSET
    #: The settings groups (``GROUPS``; left out: made of their flat fields).
    restart_policy: RestartPolicy = field(default=UNSET, kw_only=True, repr=False)
    hang: HangSettings = field(default=UNSET, kw_only=True, repr=False)
    health: HealthSettings = field(default=UNSET, kw_only=True, repr=False)
    metrics_endpoint: MetricsEndpoint = field(default=UNSET, kw_only=True, repr=False)
    #: How the agent keeps its workers' state (``core.workers.state``).
    state: StateSettings = field(default=UNSET, kw_only=True, repr=False)

    def __post_init__(self) -> None:
        if self.shutdown_timeout is None:
            object.__setattr__(self, "shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT)
        if self.numa_options is not None:
            _take_numa_options(self)
        configs = dict(self.rdzv_configs)
        if self.rdzv_timeout > 0:
            configs.setdefault("timeout", self.rdzv_timeout)
        object.__setattr__(self, "rdzv_configs", configs)
        object.__setattr__(self, "metrics_cfg", dict(self.metrics_cfg))
        for name in ("redirects", "tee"):
            value = getattr(self, name)
            if isinstance(value, dict):
                object.__setattr__(self, name, dict(value))
        if self.local_ranks_filter is not None:
            object.__setattr__(self, "local_ranks_filter", frozenset(self.local_ranks_filter))
        object.__setattr__(self, "preload", _checked_modules(self.preload))
        _check_counts(self)
        _join_groups(self)
        _check_seconds("jit_save_timeout", self.jit_save_timeout, True)
        _check_placement(self)
        _check_logs(self)

    def __repr__(self) -> str:
        shown = {f.name: getattr(self, f.name) for f in fields(self) if f.repr}
        shown["rdzv_configs"] = redacted(self.rdzv_configs)
        return "LaunchConfig(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    def __eq__(self, other: object) -> bool:
        """Equal to a config of the same class with equal fields, as a dataclass is."""
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, LaunchConfig)
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    @cached_property
    def rendezvous_settings(self) -> RendezvousSettings:
        """``rdzv_configs`` as ``rdzv_backend`` reads it (``read_rdzv_conf``): read once, when
        first asked for, so that a config may be built before it is checked; ConfigError when
        it cannot be."""
        return read_rdzv_conf(self.rdzv_backend, self.rdzv_configs)


def _check_counts(config: LaunchConfig) -> None:
    if not 0 < config.min_nodes <= config.max_nodes:
        raise ConfigError(
            f"nodes must satisfy 0 < min_nodes <= max_nodes, got {config.min_nodes}:"
            f"{config.max_nodes}"
        )
    if not 1 <= config.nproc_per_node <= MAX_NPROC_PER_NODE:
        raise ConfigError(
            f"nproc_per_node must be 1..{MAX_NPROC_PER_NODE} (workers on one node), got "
            f"{config.nproc_per_node}: run more nodes for more workers"
        )
    if config.max_restarts < 0:
        raise ConfigError(f"max_restarts must be >= 0, got {config.max_restarts}")
    for name, zero_ok in (
        ("monitor_interval", False),
        ("shutdown_timeout", True),
        ("exit_barrier_timeout", False),
    ):
        _check_seconds(name, getattr(config, name), zero_ok)


def _join_groups(config: LaunchConfig) -> None:
    """Each settings group, checked once: the one given, or its class's defaults, with the flat
    fields given changed in it; then every flat field reads as its group's."""
    for name, (kind, twins) in GROUPS.items():
        group = getattr(config, name)
        changes = {
            key: getattr(config, flat)
            for key, flat in twins.items()
            if getattr(config, flat) is not UNSET
            and (group is UNSET or getattr(config, flat) != getattr(group, key))
        }
        try:
            group = kind(**changes) if group is UNSET else group.replace(**changes)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        object.__setattr__(config, name, group)
        for key, flat in twins.items():
            object.__setattr__(config, flat, getattr(group, key))


def _take_numa_options(config: LaunchConfig) -> None:
    """torch's ``numa_options`` as ``numa_binding`` (both may be given if they agree)."""
    try:
        mode = numa_binding_of(config.numa_options)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if config.numa_binding not in (None, mode):
        raise ConfigError(
            f"numa_options asks for {mode!r} and numa_binding for {config.numa_binding!r}: "
            "give one of them"
        )
    object.__setattr__(config, "numa_binding", mode)


def _check_logs(config: LaunchConfig) -> None:
    """Logs are said one way: a ``logs_specs`` (torch 2.13's) or the seeds' fields."""
    if is_logs_specs(config.run_id):  # torch's 4th field is logs_specs; here it is run_id
        raise ConfigError(
            "LaunchConfig's 4th field is run_id: give logs_specs by keyword, "
            "LaunchConfig(min_nodes, max_nodes, nproc_per_node, logs_specs=...)"
        )
    specs = config.logs_specs
    if specs is None:
        return
    if not is_logs_specs(specs):
        raise ConfigError(
            f"logs_specs must be a LogsSpecs (relaunch.procs.DefaultLogsSpecs or a subclass), "
            f"got {type(specs).__name__}"
        )
    given = [
        name
        for name, value in (
            ("log_dir", config.log_dir),
            ("redirects", config.redirects or None),
            ("tee", config.tee or None),
            ("local_ranks_filter", config.local_ranks_filter),
        )
        if value is not None
    ]
    if given:
        raise ConfigError(
            f"logs_specs says where logs go: leave {', '.join(given)} out of the LaunchConfig "
            "and give them to DefaultLogsSpecs(log_dir, redirects, tee, local_ranks_filter)"
        )


def _checked_modules(names: Any) -> tuple[str, ...]:
    """``preload``: module names (``torch``, ``numpy.linalg``), as a tuple."""
    if isinstance(names, str):
        raise ConfigError(f"preload must be a sequence of module names, got the string {names!r}")
    modules = tuple(names)
    for name in modules:
        if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
            raise ConfigError(f"preload: {name!r} is not a module name (torch, numpy.linalg)")
    return modules


def _check_seconds(name: str, value: float, zero_ok: bool) -> None:
    """A duration: a number > 0 (>= 0 when ``zero_ok``) and at most ``MAX_SECONDS``."""
    try:
        check_seconds(name, value, zero_ok)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _check_placement(config: LaunchConfig) -> None:
    devices = config.devices
    if devices is not None:
        if len(devices) != config.nproc_per_node:
            raise ConfigError(
                f"devices lists {len(devices)} GPUs for nproc_per_node={config.nproc_per_node}: "
                "one worker per GPU"
            )
        if len(set(devices)) != len(devices) or any(d < 0 for d in devices):
            raise ConfigError(f"devices must be distinct GPU indexes >= 0, got {devices!r}")
    if config.numa_binding is not None and config.numa_binding not in NUMA_MODES:
        raise ConfigError(
            f"numa_binding {config.numa_binding!r} is unknown: expected one of "
            + ", ".join(NUMA_MODES)
        )


#: Descriptors an agent holds whatever its workers: its store or its connection to one, the
#: event log, the timer FIFO, the channel, wake-up pipes, the metrics socket, with room to spare.
AGENT_DESCRIPTORS = 64


def open_files_needed(config: LaunchConfig, terminals: Std = Std.NONE) -> int:
    """About how many descriptors the agent of ``config`` holds at once, at most: its own
    (``AGENT_DESCRIPTORS``), and for each worker a pidfd and one spare (a pipe end while it
    starts), and for each of its streams that goes through relaunch (redirected, tee'd, or
    copied: ``core.output.console_plan``, given which of the launcher's streams are ``terminals``)
    the pipe it reads and the log file. A rank left off the console (``local_ranks_filter``)
    has both its streams read; with ``logs_specs`` every stream may be."""
    nprocs, hang = config.nproc_per_node, config.hang_timeout is not None
    tee = agent_tee(config.tee, config.redirects, nprocs, hang, terminals)
    relay = relayed(config.redirects, tee, nprocs, terminals, hang, console_shared(os.environ))
    redirects, teed = per_rank(config.redirects, nprocs), per_rank(tee, nprocs)
    shown = config.local_ranks_filter or range(nprocs)
    needed = AGENT_DESCRIPTORS
    for rank in range(nprocs):
        streams = redirects[rank] | teed[rank] | relay[rank]
        if config.logs_specs is not None or rank not in shown:
            streams = Std.ALL
        needed += 2 + 2 * bin(int(streams)).count("1")
    return needed


def check_rendezvous(config: LaunchConfig) -> RendezvousSettings:
    """Check the rendezvous ``config`` names, as a whole (backend, nodes, endpoint, and
    ``rdzv_configs`` as the backend reads them); its settings, or ConfigError on the first
    problem. The etcd members' list is the store's to read (``relaunch.cli.args.validate``)."""
    backend, endpoint = config.rdzv_backend, config.rdzv_endpoint
    if backend not in BACKENDS:
        raise ConfigError(
            f"--rdzv-backend {backend!r} is unknown: valid backends are " + ", ".join(BACKENDS)
        )
    if backend == STATIC_BACKEND:
        if config.min_nodes != config.max_nodes:
            raise ConfigError(
                f"--nnodes {config.min_nodes}:{config.max_nodes} needs an elastic rendezvous "
                "backend; the static backend takes a fixed number of nodes"
            )
        settings = config.rendezvous_settings
        if (settings.rank or 0) >= config.max_nodes:
            raise ConfigError(
                f"--node-rank {settings.rank} must be below --nnodes {config.max_nodes}"
            )
        _endpoint(endpoint)
        return settings
    if backend not in ETCD_BACKENDS:
        # c10d: several hosts are where its store may move (docs/store-failover.md).
        hosts = _endpoint(endpoint or "127.0.0.1", several=True)
        if hosts > 1 and config.rendezvous_settings.job_token(os.environ) is None:
            raise ConfigError(rdzv_conf.failover_without_token(hosts))
    return config.rendezvous_settings


def _endpoint(endpoint: str, several: bool = False) -> int:
    """How many hosts ``endpoint`` names; ConfigError if it is not one (or, ``several``, a
    list of them)."""
    try:
        if several:
            return len(parse_endpoint_list(endpoint, default_port=0))
        parse_endpoint(endpoint, default_port=0)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return 1


# -- the --rdzv-conf keys ------------------------------------------------------------------------


def read_rdzv_conf(backend: str, conf: Mapping[str, Any]) -> RendezvousSettings:
    """``conf`` (``--rdzv-conf``, ``rdzv_configs``) as ``backend`` reads it, typed and checked
    once (``core.rendezvous.rdzv_conf.parse``, with this machine's TLS files looked for);
    ConfigError saying what is wrong."""
    try:
        return rdzv_conf.parse(backend, conf, is_file=os.path.isfile)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


# -- the run id ---------------------------------------------------------------------------------


def new_run_id() -> str:
    """A fresh random run id, a uuid4 in its text form as torchrun's (``str(uuid.uuid4())``).

    Built from ``os.urandom`` so that the launch path does not import ``uuid`` (5 ms).
    """
    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 4122 variant
    text = raw.hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"
