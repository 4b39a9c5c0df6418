"""One launch configuration: ``LaunchConfig``, the rules on it, and the flags turned into one.

The checks on what a launch may be raise ``ConfigError`` (a ``ValueError``), which the
``relaunch`` command reports in one line with exit status 2. Here:

- ``LaunchConfig.__post_init__``: the counts every launch needs (nodes, workers, restarts);
- ``validate``: a config as a whole (backend, endpoint, static membership, ``rdzv_configs``);
- ``rdzv_settings`` and ``etcd_options``: the ``--rdzv-conf`` keys the rendezvous reads, typed;
- ``config_from_args``: the combinations of flags that never reach a config (``--standalone``,
  ``--module`` with ``--no-python``, the training script).

The text of each flag is checked by ``relaunch.cli.values``, with the same ``ConfigError``.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from relaunch.core.console_plan import agent_tee, relayed

# Nothing from relaunch.rendezvous at import time: the rendezvous code imports this module.
from relaunch.core.defaults import (
    DEFAULT_EXIT_BARRIER_TIMEOUT,
    DEFAULT_HEALTH_CHECK_COOLDOWN,
    DEFAULT_HEALTH_CHECK_TIMEOUT,
    DEFAULT_SHUTDOWN_TIMEOUT,
    NUMA_MODES,
)
from relaunch.core.streams import Std, per_rank
from relaunch.endpoints import parse_endpoint

if TYPE_CHECKING:
    import argparse

#: ``--master-port`` when not given, for more than one node (torchrun's).
STATIC_PORT = 29500
#: ``--signals-to-handle`` when not given (torchrun's).
DEFAULT_SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
#: The most workers one node may run (``--nproc-per-node``): twice the hardware threads of the
#: largest common two-socket machines (2 x 128 cores x 2 threads), so that ``cpu`` and any
#: sensible oversubscription fit, while a typo (65536) is refused before anything forks. Each
#: worker is a process with its own pipes and log files: past this, a node runs out of memory
#: or descriptors long before the job does useful work.
MAX_NPROC_PER_NODE = 1024
#: The longest any duration may be, in seconds (about 11.6 days): every wait the agent makes
#: must fit the kernel's (``poll`` takes at most 2**31 - 1 ms, about 24.8 days).
MAX_SECONDS = 1_000_000.0


class ConfigError(ValueError):
    """A launch that cannot be: the message says what is wrong and what to do."""


# -- the config ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchConfig:
    """How to launch: nodes, workers per node, rendezvous, restarts, logs.

    ``rdzv_backend="static"`` with ``rdzv_endpoint="MASTER_ADDR:MASTER_PORT"`` and
    ``rdzv_configs={"rank": NODE_RANK}`` runs a fixed set of nodes; a port of 0 picks a free one
    (one node). ``metrics_cfg`` may name ``{"handler": "console" | "file:PATH" | "null"}``.
    Frozen, and its dicts are copies of the caller's: change one with ``dataclasses.replace``.
    """

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    run_id: str = ""
    role: str = "default"
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
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    event_log_handler: str = "null"
    #: Run a file timer server for ``relaunch.timer.expires`` (None: when
    #: ``TORCHELASTIC_ENABLE_FILE_TIMER=1``); restart when a worker hangs this many seconds.
    timers: bool | None = None
    hang_timeout: float | None = None
    #: Seconds before the second restart of a crash loop, doubling up to the second number.
    restart_backoff: tuple[float, float] = (1.0, 30.0)
    #: Stop the job after this many restarts in a row that made no progress (0: never).
    max_stalled_restarts: int = 3
    #: Flag a rank whose steps per second fall below the job's median divided by this.
    straggler_factor: float = 1.5
    #: torchrun's ``--signals-to-handle``, given to workers as ``TORCHELASTIC_SIGNALS_TO_HANDLE``.
    signals_to_handle: str = DEFAULT_SIGNALS_TO_HANDLE
    #: Seconds a node whose workers finished waits for the other nodes' before closing the job.
    exit_barrier_timeout: float = DEFAULT_EXIT_BARRIER_TIMEOUT
    #: A shell command run before every join (exit 0: this node is healthy and joins), how long
    #: it may run, and how long a node whose check failed waits before the next.
    health_check: str | None = None
    health_check_timeout: float = DEFAULT_HEALTH_CHECK_TIMEOUT
    health_check_cooldown: float = DEFAULT_HEALTH_CHECK_COOLDOWN
    #: Serve Prometheus metrics on this port (0: a free one; None: none), on ``metrics_host``
    #: ("": every interface).
    metrics_port: int | None = None
    metrics_host: str = ""
    #: Device placement (``relaunch.core.placement``): the GPUs of ``--nproc-per-node gpu:LIST``
    #: (one worker each; None: not given), a device per rank (``--device-per-rank``), and
    #: torch's ``--numa-binding`` mode.
    devices: tuple[int, ...] | None = None
    device_per_rank: bool = False
    numa_binding: str | None = None

    def __post_init__(self) -> None:
        configs = dict(self.rdzv_configs)
        if self.rdzv_timeout > 0:
            configs.setdefault("timeout", self.rdzv_timeout)
        object.__setattr__(self, "rdzv_configs", configs)
        object.__setattr__(self, "metrics_cfg", dict(self.metrics_cfg))
        for name in ("redirects", "tee"):
            value = getattr(self, name)
            if isinstance(value, dict):
                object.__setattr__(self, name, dict(value))
        _check_counts(self)

    def __repr__(self) -> str:
        from dataclasses import fields

        from relaunch.rendezvous.api import redacted

        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        shown["rdzv_configs"] = redacted(self.rdzv_configs)
        return "LaunchConfig(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"


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
        ("health_check_timeout", False),
        ("health_check_cooldown", False),
    ):
        _check_seconds(name, getattr(config, name), zero_ok)
    if config.hang_timeout is not None:
        _check_seconds("hang_timeout", config.hang_timeout, False)
    for bound in config.restart_backoff:
        _check_seconds("restart_backoff", bound, True)
    if config.metrics_port is not None and not 0 <= config.metrics_port <= 65535:
        raise ConfigError(f"metrics_port must be a port 0..65535, got {config.metrics_port!r}")
    if config.health_check is not None and not config.health_check.strip():
        raise ConfigError("health_check must be a shell command, got an empty one")
    _check_placement(config)


def _check_seconds(name: str, value: float, zero_ok: bool) -> None:
    """A duration: a number > 0 (>= 0 when ``zero_ok``) and at most ``MAX_SECONDS``."""
    low_ok = value >= 0 if zero_ok else value > 0
    if isinstance(value, bool) or not (low_ok and value <= MAX_SECONDS):
        least = ">= 0" if zero_ok else "> 0"
        raise ConfigError(
            f"{name} must be a number of seconds {least} and at most {MAX_SECONDS:.0f}, got "
            f"{value!r}"
        )


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
    copied: ``core.console_plan``, given which of the launcher's streams are ``terminals``)
    the pipe it reads and the log file."""
    nprocs, hang = config.nproc_per_node, config.hang_timeout is not None
    tee = agent_tee(config.tee, config.redirects, nprocs, hang, terminals)
    relay = relayed(config.redirects, tee, nprocs, terminals, hang)
    redirects, teed = per_rank(config.redirects, nprocs), per_rank(tee, nprocs)
    needed = AGENT_DESCRIPTORS
    for rank in range(nprocs):
        streams = redirects[rank] | teed[rank] | relay[rank]
        needed += 2 + 2 * bin(int(streams)).count("1")
    return needed


def validate(config: LaunchConfig) -> None:
    """Check ``config`` as a whole, before anything starts; ConfigError on the first problem."""
    from relaunch.rendezvous.api import BACKENDS

    _check_counts(config)
    backend, endpoint, conf = config.rdzv_backend, config.rdzv_endpoint, config.rdzv_configs
    if backend not in BACKENDS:
        raise ConfigError(
            f"--rdzv-backend {backend!r} is unknown: valid backends are " + ", ".join(BACKENDS)
        )
    if backend == "static":
        if config.min_nodes != config.max_nodes:
            raise ConfigError(
                f"--nnodes {config.min_nodes}:{config.max_nodes} needs an elastic rendezvous "
                "backend; the static backend takes a fixed number of nodes"
            )
        rank = _number(conf, "rank", 0, whole=True)
        if rank < 0:
            raise ConfigError(f"--node-rank {rank} must be >= 0")
        if rank >= config.max_nodes:
            raise ConfigError(f"--node-rank {rank} must be below --nnodes {config.max_nodes}")
        _endpoint(endpoint)
        # The one dynamic key the static backend reads: how long the master's name may take
        # to resolve (rendezvous.static); the others it ignores.
        rdzv_settings({"join_timeout": conf.get("join_timeout", 600)})
    elif backend in ("etcd", "etcd-v2"):
        options = etcd_options(conf)
        from relaunch.store.etcd import parse_endpoints

        try:
            parse_endpoints(endpoint or "127.0.0.1", options["protocol"])
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    else:
        if "," in endpoint:
            raise ConfigError(
                f"--rdzv-backend {backend} takes one --rdzv-endpoint HOST:PORT; a "
                "list of members is for --rdzv-backend etcd"
            )
        _endpoint(endpoint or "127.0.0.1")
        rdzv_settings(conf)
    from relaunch.events import check_log_file, event_handler_from_spec, spec_path

    try:
        event_handler_from_spec(config.event_log_handler).close()
        path = spec_path(config.event_log_handler)
        if path:
            check_log_file(path, "--event-log-handler file:")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if config.log_dir is not None:
        check_log_dir(config.log_dir)


def check_log_dir(log_dir: str) -> None:
    """``--log-dir``: an existing directory this process may write to, or one it may create;
    ConfigError in one line otherwise. Creates nothing."""
    from relaunch.events import creatable

    if not log_dir:
        raise ConfigError("--log-dir is empty: name a directory (it is created if need be)")
    try:
        os.stat(log_dir)
    except FileNotFoundError:
        problem = creatable(log_dir)
        if problem:
            raise ConfigError(f"--log-dir {log_dir} cannot be created: {problem}") from None
        return
    except OSError as exc:
        parent = os.path.dirname(os.path.abspath(log_dir))
        why = creatable(parent) or exc.strerror
        raise ConfigError(f"--log-dir {log_dir} cannot be used: {why}") from None
    if not os.path.isdir(log_dir):
        raise ConfigError(
            f"--log-dir {log_dir} is a file, not a directory: name a directory (it is created "
            "if need be)"
        )
    effective = os.access in os.supports_effective_ids
    if not os.access(log_dir, os.W_OK | os.X_OK, effective_ids=effective):
        raise ConfigError(
            f"--log-dir {log_dir} is not writable by this user (or is on a read-only "
            "filesystem): name a directory you can write"
        )


def _endpoint(endpoint: str) -> None:
    try:
        parse_endpoint(endpoint, default_port=0)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


# -- the --rdzv-conf keys ------------------------------------------------------------------------


class RdzvSettings(NamedTuple):
    """The ``--rdzv-conf`` keys the dynamic rendezvous reads, typed, with torchrun's defaults.

    A named tuple, not a dataclass: cheaper to create on the launch path.
    """

    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    keep_alive_interval: float = 5.0
    keep_alive_max_attempt: int = 3
    #: Seconds each store operation may take.
    timeout: float = 60.0
    #: Host the store on this node: None (not given) hosts it when the endpoint can be bound.
    is_host: bool | None = None
    #: The store's shared secret (else ``$RELAUNCH_RDZV_TOKEN``, read by the rendezvous).
    token: str | None = None
    #: This node's name within its host, for the job's record of it (``core.exclusion``).
    node_name: str | None = None
    #: Failures a node may cause before it is excluded (0: never), and for how many seconds.
    exclude_after: int = 3
    exclude_cooldown: float = 600.0


def _number(conf: Mapping[str, Any], key: str, default: float, whole: bool = False) -> Any:
    value = conf.get(key, default)
    try:
        return int(value) if whole else float(value)
    except (TypeError, ValueError):
        kind = "a whole number" if whole else "a number of seconds"
        raise ConfigError(f"--rdzv-conf {key}={value!r}: expected {kind}") from None


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def rdzv_settings(conf: Mapping[str, Any]) -> RdzvSettings:
    """The dynamic rendezvous' settings in ``conf`` (``--rdzv-conf``, ``rdzv_configs``)."""
    settings = RdzvSettings(
        join_timeout=_number(conf, "join_timeout", 600),
        last_call_timeout=_number(conf, "last_call_timeout", 30),
        keep_alive_interval=_number(conf, "keep_alive_interval", 5),
        keep_alive_max_attempt=_number(conf, "keep_alive_max_attempt", 3, whole=True),
        timeout=_number(conf, "timeout", 60),
        is_host=None if conf.get("is_host") is None else _truthy(conf["is_host"]),
        token=conf.get("token") or None,
        node_name=conf.get("node_name") or None,
        exclude_after=_number(conf, "exclude_after", 3, whole=True),
        exclude_cooldown=_number(conf, "exclude_cooldown", 600),
    )
    from relaunch.core.exclusion import valid_node_name

    if settings.node_name is not None and not valid_node_name(str(settings.node_name)):
        raise ConfigError(
            f"--rdzv-conf node_name={settings.node_name!r}: expected 1 to 64 letters, digits, "
            "'.', '_' or '-'"
        )
    if settings.exclude_after < 0:
        raise ConfigError(
            f"--rdzv-conf exclude_after={conf['exclude_after']!r}: expected a whole number >= 0"
        )
    if not 0 < settings.exclude_cooldown <= MAX_SECONDS:
        raise ConfigError(
            f"--rdzv-conf exclude_cooldown={conf['exclude_cooldown']!r}: expected a number of "
            "seconds > 0"
        )
    for key in ("join_timeout", "last_call_timeout", "keep_alive_interval", "timeout"):
        if not 0 < getattr(settings, key) <= MAX_SECONDS:  # nan and inf are not durations
            raise ConfigError(
                f"--rdzv-conf {key}={conf[key]!r}: expected a number of seconds > 0 and at most "
                f"{MAX_SECONDS:.0f}"
            )
    if settings.keep_alive_max_attempt < 1:
        raise ConfigError(
            f"--rdzv-conf keep_alive_max_attempt={conf['keep_alive_max_attempt']!r}: "
            "expected a whole number >= 1"
        )
    return settings


def etcd_options(conf: Mapping[str, Any]) -> dict[str, Any]:
    """``EtcdStore``'s keyword arguments in ``conf``: protocol, TLS files, credentials, timeout."""
    options: dict[str, Any] = {
        "protocol": str(conf.get("protocol", "http")),
        "cacert": conf.get("cacert"),
        "cert": conf.get("cert"),
        "key": conf.get("key"),
        "user": conf.get("user"),
        "password": conf.get("password"),
        "timeout": rdzv_settings(conf).timeout,
    }
    if options["protocol"] not in ("http", "https"):
        raise ConfigError(f"--rdzv-conf protocol={options['protocol']!r}: expected http or https")
    for path_option in ("cacert", "cert", "key"):
        path = options[path_option]
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"--rdzv-conf {path_option}={path}: no such file")
    if (options["user"] is None) != (options["password"] is None):
        raise ConfigError("--rdzv-conf: etcd authentication needs both user and password")
    if options["key"] is not None and options["cert"] is None:
        raise ConfigError("--rdzv-conf: etcd TLS: key= needs cert= too")
    return options


# -- the flags, as one config --------------------------------------------------------------------


def new_run_id() -> str:
    """A fresh random run id, a uuid4 in its text form as torchrun's (``str(uuid.uuid4())``).

    Built from ``os.urandom`` so that the launch path does not import ``uuid`` (5 ms).
    """
    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 4122 variant
    text = raw.hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def gpu_subset(value: str) -> tuple[int, ...] | None:
    """The GPUs of ``--nproc-per-node gpu:LIST`` (``gpu:1,3``, ``gpu:0-3``); None for the rest."""
    if not value.startswith("gpu:"):
        return None
    from relaunch.core.placement import parse_index_list

    try:
        return parse_index_list(value[4:])
    except ValueError as exc:
        raise ConfigError(f"--nproc-per-node {value}: {exc}") from None


def resolve_nproc(value: str, cpus: int, gpus: int) -> int:
    """``--nproc-per-node`` as a number: ``cpu`` is ``cpus``, ``gpu`` ``gpus``, ``auto`` either,
    ``gpu:LIST`` the number of GPUs listed (each below ``gpus``, when GPUs could be counted)."""
    if value.isdigit():
        return int(value)
    subset = gpu_subset(value)
    if subset is not None:
        if gpus and max(subset) >= gpus:
            raise ConfigError(
                f"--nproc-per-node {value}: GPU {max(subset)} does not exist: the launcher sees "
                f"{gpus} (0-{gpus - 1}; CUDA_VISIBLE_DEVICES or nvidia-smi -L)"
            )
        return len(subset)
    if value == "cpu":
        return cpus
    if value == "gpu" and gpus == 0:
        raise ConfigError(
            "--nproc-per-node gpu: no GPU found (CUDA_VISIBLE_DEVICES and nvidia-smi -L list "
            "none); give a number or use cpu"
        )
    return gpus or cpus


def config_from_args(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    gpus: int,
    *,
    cpus: int | None = None,
    fresh_run_id: str = "",
) -> tuple[LaunchConfig, Callable[..., Any] | str, tuple[str, ...]]:
    """The checked ``LaunchConfig``, the entrypoint and its arguments the parsed flags describe.

    Reads nothing but its arguments (and the training script's file): ``environ`` gives ``PATH``
    for ``--no-python`` and ``PYTHON_EXEC`` (torchrun's: the Python that runs the script),
    ``gpus`` and ``cpus`` (default: ``os.cpu_count()``) resolve ``--nproc-per-node
    gpu/cpu/auto``, and ``fresh_run_id`` is the run id of a job that
    torchrun gives a fresh one (empty: a fresh one at launch): ``--standalone``, and one node with
    the static backend, no ``--rdzv-endpoint`` and no ``--master-port``, which torchrun 2.13 runs
    as ``--standalone`` (ignoring ``--rdzv-id``), so that runs on one machine never share an id.
    That one stays on the static backend, with a free port (as fast, and a failure is final at
    once: the dynamic rendezvous waits for a lost node to be noticed first).
    """
    cpus = (os.cpu_count() or 1) if cpus is None else cpus
    nproc = resolve_nproc(args.nproc_per_node, cpus, gpus)
    min_nodes, max_nodes = args.nnodes
    backend, run_id, endpoint = args.rdzv_backend, args.rdzv_id, args.rdzv_endpoint
    rdzv_configs: dict[str, Any] = dict(args.rdzv_conf)
    if args.standalone:
        if max_nodes != 1:
            raise ConfigError("--standalone runs one node: drop --nnodes or use --rdzv-backend")
        backend, endpoint, run_id = "c10d", "127.0.0.1:0", fresh_run_id
        rdzv_configs["is_host"] = "true"
    if backend == "static":
        if not endpoint:
            port = args.master_port
            if port is None and max_nodes == 1:
                # torchrun 2.13 runs this as --standalone: a fresh run id (whatever --rdzv-id
                # says) and a free port. The static backend with port 0 does the same here.
                port, run_id = 0, fresh_run_id
            elif port is None:
                port = STATIC_PORT
            endpoint = f"{args.master_addr}:{port}"
        rdzv_configs["rank"] = args.node_rank
    redirects, tee = _console_filter(args, nproc)
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
        restart_backoff=args.restart_backoff,
        max_stalled_restarts=args.max_stalled_restarts,
        straggler_factor=args.straggler_factor,
        signals_to_handle=",".join(sig.name for sig in args.signals_to_handle),
        exit_barrier_timeout=args.exit_barrier_timeout,
        health_check=args.health_check,
        health_check_timeout=args.health_check_timeout,
        health_check_cooldown=args.health_check_cooldown,
        metrics_host=args.metrics_port[0] if args.metrics_port else "",
        metrics_port=args.metrics_port[1] if args.metrics_port else None,
        devices=gpu_subset(args.nproc_per_node),
        device_per_rank=args.device_per_rank,
        numa_binding=args.numa_binding,
    )
    validate(config)
    if backend != "static" and not endpoint:
        raise ConfigError(f"--rdzv-backend {backend} needs --rdzv-endpoint HOST:PORT")
    _check_timer_file(args.timers, environ)
    entrypoint, entry_args = _command(args, environ)
    return config, entrypoint, entry_args


def _check_timer_file(timers: bool, environ: Mapping[str, str]) -> None:
    """With timers on, a FIFO named by ``TORCHELASTIC_TIMER_FILE`` must be safe to serve: a FIFO
    of this user's that no one else can write (whoever writes names the pids that are killed)."""
    from relaunch.core.timers import ENABLE_FILE_TIMER_ENV, TIMER_FILE_ENV

    path = environ.get(TIMER_FILE_ENV)
    if not path or not (timers or environ.get(ENABLE_FILE_TIMER_ENV, "") == "1"):
        return
    from relaunch.timer.file_based_local_timer import check_server_fifo

    try:
        check_server_fifo(path)
    except ValueError as exc:
        raise ConfigError(f"{TIMER_FILE_ENV}: {exc}") from None


def _command(
    args: argparse.Namespace, environ: Mapping[str, str]
) -> tuple[Callable[..., Any] | str, tuple[str, ...]]:
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
        raise ConfigError(f"{' and '.join(modes)} cannot be used together")
    if args.no_python:
        if os.sep in script:
            usable = os.path.isfile(script) and os.access(script, os.X_OK)
        else:
            usable = shutil.which(script, path=environ.get("PATH", os.defpath)) is not None
        if not usable:
            raise ConfigError(f"binary {script!r} was not found or is not executable")
        return script, rest
    python = environ.get("PYTHON_EXEC") or sys.executable  # torchrun's variable
    if args.module:
        return python, ("-u", "-m", script, *rest)
    if not os.path.isfile(script):
        raise ConfigError(f"training script {script!r} does not exist")
    if args.run_path:
        from relaunch._run_path import run_script

        return run_script, (script, *rest)
    return python, ("-u", script, *rest)


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
