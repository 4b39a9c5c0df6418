"""The parsed flags into one checked ``LaunchConfig``, and the command every worker runs.

Each input is read once, into a typed value: ``--nproc-per-node`` into a ``DeviceRequest`` (its
number of workers decided by the machine's counts, which ``relaunch.placement`` reads),
``--rdzv-conf`` into the config's ``rendezvous_settings`` (``core.rendezvous.rdzv_conf``). The
checks only the other layers can make (the event log, the log directory, the etcd members, the
timer FIFO, the training script) are made here too, so that ``relaunch.config`` imports none of
them. Every problem is a ``ConfigError``, which the command reports in one line (exit status 2).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from typing import Any

from relaunch.cli.devices import DeviceRequest as DeviceRequest
from relaunch.cli.devices import parse_device_request as parse_device_request
from relaunch.cli.flags import FLAGS
from relaunch.config import ConfigError, LaunchConfig, check_rendezvous, new_run_id
from relaunch.core.rendezvous.rdzv_conf import ETCD_BACKENDS, unknown_key
from relaunch.core.run.settings import GROUPS, MetricsEndpoint

#: ``--master-port`` when not given, for more than one node (torchrun's).
STATIC_PORT = 29500
#: Set by the supervisor of one node's replica groups (``cli.replicas``) for each group agent it
#: starts: the store it serves (``HOST:PORT``), and the job's run id.
GROUP_STORE_ENV = "RELAUNCH_REPLICA_STORE"
GROUP_RUN_ID_ENV = "RELAUNCH_REPLICA_RUN_ID"
GROUP_SUPERVISOR_ENV = "RELAUNCH_REPLICA_SUPERVISOR"
#: Where no directory of a job's may be: the kernel's own filesystems (a directory made there is
#: a cgroup or nothing, and no log file can be written in it).
KERNEL_FILESYSTEMS = ("/proc", "/sys")


def device_request(text: str) -> DeviceRequest:
    """``--nproc-per-node``'s text (a flag, ``PET_NPROC_PER_NODE`` or a scheduler's) as a
    request; ConfigError naming the flag."""
    try:
        return parse_device_request(text)
    except ValueError as exc:
        raise ConfigError(f"--nproc-per-node {text}: {exc}") from None


def resolve_nproc(text: str, cpus: int | None = None, gpus: int | None = None) -> int:
    """``--nproc-per-node`` as a number of workers: ``cpu`` is ``cpus``, ``gpu`` ``gpus``,
    ``auto`` either, ``gpu:LIST`` the number of GPUs listed (each below ``gpus``, when GPUs
    could be counted). A count not given is this machine's (``relaunch.placement``), read only
    when the request needs it."""
    request = device_request(text)
    return _workers(request, text, cpus, gpus, os.environ)


def _workers(
    request: DeviceRequest,
    text: str,
    cpus: int | None,
    gpus: int | None,
    environ: Mapping[str, str],
) -> int:
    if request.number is None and (cpus is None or (gpus is None and request.counts_gpus)):
        from relaunch import placement

        cpus = placement.cpu_count() if cpus is None else cpus
        if gpus is None and request.counts_gpus:
            gpus = placement.count_gpus(environ)
    try:
        return request.workers(cpus or 0, gpus or 0)
    except ValueError as exc:
        raise ConfigError(f"--nproc-per-node {text}: {exc}") from None


def config_from_args(
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    gpus: int | None = None,
    *,
    cpus: int | None = None,
    fresh_run_id: str | None = None,
) -> tuple[LaunchConfig, Callable[..., Any] | str, tuple[str, ...]]:
    """The checked ``LaunchConfig``, the entrypoint and its arguments the parsed flags describe.

    Reads nothing but its arguments (and the training script's file) when all are given:
    ``environ`` (default: ``os.environ``) gives ``PATH`` for ``--no-python`` and
    ``PYTHON_EXEC`` (torchrun's: the Python that runs the script); ``gpus`` and ``cpus``
    (default: this machine's, read only when ``--nproc-per-node`` needs them) resolve
    ``gpu``/``cpu``/``auto``; ``fresh_run_id`` (default: a new one) is the run id of a job that
    torchrun gives a fresh one: ``--standalone``, and one node with the static backend, no
    ``--rdzv-endpoint`` and no ``--master-port``, which torchrun 2.13 runs as ``--standalone``
    (ignoring ``--rdzv-id``), so that runs on one machine never share an id. That one stays on
    the static backend, with a free port (as fast, and a failure is final at once: the dynamic
    rendezvous waits for a lost node to be noticed first).
    """
    environ = os.environ if environ is None else environ
    fresh_run_id = new_run_id() if fresh_run_id is None else fresh_run_id
    request = device_request(args.nproc_per_node)
    min_nodes, max_nodes = args.nnodes
    group = replica_group(args, environ)
    if group is not None and max_nodes > 1:
        min_nodes, max_nodes = _group_nodes(args)
    backend, run_id, endpoint, rdzv_configs = _rendezvous(args, max_nodes, fresh_run_id)
    if group is not None:
        backend, run_id, endpoint = _group_rendezvous(
            args, group, (backend, run_id, endpoint), rdzv_configs, environ
        )
    metrics = args.metrics_port and {"metrics_endpoint": _metrics(args.metrics_port, group)}
    config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=_workers(request, args.nproc_per_node, cpus, gpus, environ),
        run_id=run_id,
        rdzv_endpoint=endpoint,
        rdzv_backend=backend,
        rdzv_configs=rdzv_configs,
        **_logs(args, environ, group),
        **settings_from_flags(args),
        **(metrics or {}),
        signals_to_handle=",".join(sig.name for sig in args.signals_to_handle),
        devices=request.subset,
    )
    validate(config)
    if backend != "static" and not endpoint:
        raise ConfigError(f"--rdzv-backend {backend} needs --rdzv-endpoint HOST:PORT")
    _check_timer_file(args.timers, environ)
    entrypoint, entry_args = _command(args, environ)
    return config, entrypoint, entry_args


def settings_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The ``LaunchConfig`` keywords the flag table names (``Flag.field``), each settings group
    (``group.field``) made whole: a flag not given (None, or a switch left off) leaves its
    field at its default."""
    keywords: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for flag in FLAGS:
        value = getattr(args, flag.dest)
        if flag.field is None or value is None or (flag.switch and not value):
            continue
        group, _, name = flag.field.rpartition(".")
        (groups.setdefault(group, {}) if group else keywords)[name] = value
    for group, values in groups.items():
        try:
            keywords[group] = GROUPS[group][0](**values)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return keywords


def _rendezvous(
    args: argparse.Namespace, max_nodes: int, fresh_run_id: str
) -> tuple[str, str, str, dict[str, Any]]:
    """The backend, run id, endpoint and ``rdzv_configs`` of the flags: ``--standalone``'s,
    the static backend's endpoint of ``--master-addr`` and ``--master-port``, and the node's
    rank (static: its group rank; dynamic: the nodes' order)."""
    backend, run_id, endpoint = args.rdzv_backend, args.rdzv_id, args.rdzv_endpoint
    rdzv_configs: dict[str, Any] = dict(args.rdzv_conf)
    if args.standalone:
        if max_nodes != 1:
            raise ConfigError("--standalone runs one node: drop --nnodes or use --rdzv-backend")
        backend, endpoint, run_id = "c10d", "127.0.0.1:0", fresh_run_id
        rdzv_configs["is_host"] = "true"
    if backend == "static" and not endpoint:
        port = args.master_port
        if port is None and max_nodes == 1:
            # torchrun 2.13 runs this as --standalone: a fresh run id (whatever --rdzv-id
            # says) and a free port. The static backend with port 0 does the same here.
            port, run_id = 0, fresh_run_id
        elif port is None:
            port = STATIC_PORT
        endpoint = f"{args.master_addr}:{port}"
    if args.node_rank is not None:
        rdzv_configs["rank"] = args.node_rank
    return backend, run_id, endpoint, rdzv_configs


def replica_group(args: argparse.Namespace, environ: Mapping[str, str]) -> int | None:
    """This node's replica group (``--replica-groups``): ``--replica-group``, else its place in
    the nodes' order (``--node-rank``, which a scheduler's environment fills in); None when it
    runs no group of its own: no replica groups, or one node, whose launcher supervises all of
    them (``cli.replicas``). ConfigError when the flags do not say one."""
    count: int = args.replica_groups
    group: int | None = args.replica_group
    if count == 1 and group is None:
        return None
    from relaunch.core.run import replica_groups

    try:
        if group is not None:
            replica_groups.check_group(group, count)
        max_nodes = args.nnodes[1]
        if max_nodes == 1:
            return group
        _group_nodes(args)
        if group is not None:
            return group
        if args.node_rank is None:
            raise ValueError(
                f"--replica-groups {count} on {max_nodes} nodes: say which group this node "
                "serves with --replica-group G or --node-rank RANK"
            )
        return replica_groups.group_of_node(int(args.node_rank), max_nodes, count)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _group_nodes(args: argparse.Namespace) -> tuple[int, int]:
    """Each replica group's ``MIN:MAX`` nodes; ConfigError when ``--nnodes`` does not divide."""
    from relaunch.core.run.replica_groups import group_nodes

    try:
        min_nodes, max_nodes = args.nnodes
        return group_nodes(min_nodes, max_nodes, args.replica_groups)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _group_rendezvous(
    args: argparse.Namespace,
    group: int,
    rendezvous: tuple[str, str, str],
    rdzv_configs: dict[str, Any],
    environ: Mapping[str, str],
) -> tuple[str, str, str]:
    """A replica group's own rendezvous: its own run id on the job's store. A group agent
    started by one node's supervisor follows the supervisor's store; on several nodes, a
    node's rank is its place in its group."""
    from relaunch.core.run.replica_groups import group_run_id

    backend, run_id, endpoint = rendezvous
    store = environ.get(GROUP_STORE_ENV)
    if store:
        rdzv_configs["is_host"] = "false"
        return "c10d", group_run_id(environ.get(GROUP_RUN_ID_ENV) or run_id, group), store
    nodes = args.nnodes[1]
    if nodes > 1:
        if backend == "static":
            raise ConfigError(
                "--replica-groups on several nodes needs a rendezvous each group can form on its "
                "own: --rdzv-backend c10d or etcd with --rdzv-endpoint"
            )
        if args.node_rank is not None:
            rdzv_configs["rank"] = args.node_rank % (nodes // args.replica_groups)
    return backend, group_run_id(run_id, group), endpoint


def _metrics(given: tuple[str, int | None], group: int | None) -> MetricsEndpoint:
    """``--metrics-port``'s endpoint; replica group g serves at the port + g."""
    host, port = given
    if group is not None:
        from relaunch.core.run.replica_groups import metrics_port

        port = metrics_port(port, group)
    try:
        return MetricsEndpoint(host, port)
    except ValueError as exc:
        raise ConfigError(
            f"--metrics-port serves replica group {group} at port + {group}: {exc}"
        ) from None


def validate(config: LaunchConfig) -> None:
    """Check ``config`` as a whole, before anything starts: its rendezvous (its
    ``--rdzv-conf`` keys, ``relaunch.config.check_rendezvous``, then the etcd members), its
    event log, its log directory and its state directory; ConfigError on the first problem."""
    problem = unknown_key(config.rdzv_backend, config.rdzv_configs)
    if problem:
        raise ConfigError(problem)
    settings = check_rendezvous(config)
    if config.rdzv_backend in ETCD_BACKENDS and settings.etcd is not None:
        from relaunch.store.etcd import parse_endpoints

        try:
            parse_endpoints(config.rdzv_endpoint or "127.0.0.1", settings.etcd.protocol)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if config.event_log_handler != "null":  # the default: nothing to check
        check_event_log(config.event_log_handler)
    if config.log_dir is not None:
        check_directory(config.log_dir)
    if config.state_dir is not None:
        check_directory(config.state_dir, "--state-dir")


def check_event_log(spec: str) -> None:
    """``--event-log-handler``: a spec it takes, and a file it names one this process can
    append to; ConfigError in one line otherwise."""
    from relaunch.events import check_log_file, event_handler_from_spec, spec_path

    try:
        event_handler_from_spec(spec).close()
        path = spec_path(spec)
        if path:
            check_log_file(path, "--event-log-handler file:")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_directory(path: str, flag: str = "--log-dir") -> None:
    """``--log-dir``, ``--state-dir``: an existing directory this process can write in, or one
    it can create; ConfigError in one line otherwise. Leaves nothing behind (``creatable`` and
    ``unwritable`` try, and undo)."""
    from relaunch.events import creatable, unwritable

    if not path:
        raise ConfigError(f"{flag} is empty: name a directory (it is created if need be)")
    real = os.path.realpath(path)
    kernel = next((top for top in KERNEL_FILESYSTEMS if os.path.commonpath((top, real)) == top), "")
    if kernel:
        raise ConfigError(
            f"{flag} {path} is under {kernel}, which holds the kernel's files, not a job's: name "
            "a directory on disk (it is created if need be)"
        )
    try:
        os.stat(path)
    except FileNotFoundError:
        problem = creatable(path)
        if problem:
            raise ConfigError(f"{flag} {path} cannot be created: {problem}") from None
        return
    except OSError as exc:
        parent = os.path.dirname(os.path.abspath(path))
        why = creatable(parent) or exc.strerror
        raise ConfigError(f"{flag} {path} cannot be used: {why}") from None
    if not os.path.isdir(path):
        raise ConfigError(
            f"{flag} {path} is a file, not a directory: name a directory (it is created if need be)"
        )
    problem = unwritable(path)
    if problem:
        raise ConfigError(f"{flag} {problem}: name a directory you can write")


def make_log_dir(config: LaunchConfig) -> None:
    """Make ``--log-dir`` before anything starts (``--dry-run`` makes nothing): what
    ``check_directory`` could not foresee (a race, a filesystem that refuses the name) is one
    line too, not a traceback once the rendezvous has begun."""
    if config.logs_specs is not None or not config.log_dir or config.log_dir == os.devnull:
        return
    try:
        os.makedirs(config.log_dir, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"--log-dir {config.log_dir} cannot be created ({exc.strerror or exc}): name a "
            "directory you can write"
        ) from None


def _check_timer_file(timers: bool, environ: Mapping[str, str]) -> None:
    """With timers on, a FIFO named by ``TORCHELASTIC_TIMER_FILE`` must be safe to serve: a FIFO
    of this user's that no one else can write (whoever writes names the pids that are killed)."""
    from relaunch.core.workers.timers import ENABLE_FILE_TIMER_ENV, TIMER_FILE_ENV

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
        if not environ.get("PYTHON_EXEC"):  # another Python's path is its own
            _check_module(script, environ)
        return python, ("-u", "-m", script, *rest)
    if not os.path.isfile(script):
        raise ConfigError(f"training script {script!r} does not exist")
    if args.run_path:
        from relaunch._run_path import run_script

        return run_script, (script, *rest)
    return python, ("-u", script, *rest)


def _check_module(name: str, environ: Mapping[str, str]) -> None:
    """``-m NAME``: its top-level package must be found where a worker's ``python -m`` looks (its
    cwd, which is this one, ``PYTHONPATH`` and this Python's path); ConfigError otherwise.
    Nothing is imported (a package's code runs in the workers only), so a missing submodule is
    left for the worker to report."""
    if name.endswith(".py") and os.path.isfile(name):
        raise ConfigError(
            f"-m {name}: -m takes a module name, not a file: -m {name[:-3]}, or drop -m"
        )
    top = name.partition(".")[0]
    if top in sys.modules or top in sys.builtin_module_names:
        return
    import importlib.machinery
    import importlib.util
    import site

    cwd = os.getcwd()
    extra = [entry for entry in environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    path = [cwd, *extra, *sys.path, site.getusersitepackages()]
    if importlib.machinery.PathFinder.find_spec(top, path) is not None:
        return
    try:
        if importlib.util.find_spec(top) is not None:  # frozen, and installs' own finders
            return
    except (ImportError, ValueError):
        pass
    raise ConfigError(
        f"-m {name}: no module named {top!r} in {cwd}, PYTHONPATH or this Python's packages: "
        "check the name, install it, or run from the directory that holds it"
    )


def _logs(
    args: argparse.Namespace, environ: Mapping[str, str], group: int | None = None
) -> dict[str, Any]:
    """The config's logging fields, as torchrun makes them: ``--log-dir``, ``-r``, ``-t`` and
    ``--local-ranks-filter`` given to the ``LogsSpecs`` class ``--logs-specs`` names (then
    made here, as torchrun makes it), else (or for ``default``) kept as they are: a
    ``DefaultLogsSpecs`` is made of them when the agent starts, so ``--dry-run`` makes no
    directory; the console prefix template from
    ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` (a replica group's ``[g1 default0]:`` when it is
    not set), and the duplicate filters."""
    from relaunch.core.output.console_plan import LOG_LINE_PREFIX_TEMPLATE_ENV

    template = environ.get(LOG_LINE_PREFIX_TEMPLATE_ENV) or None
    if template is None and group is not None:
        from relaunch.core.run.replica_groups import group_prefix_template

        template = group_prefix_template(group)

    fields: dict[str, Any] = {
        "log_dir": args.log_dir,
        "redirects": args.redirects,
        "tee": args.tee,
        "local_ranks_filter": args.local_ranks_filter,
    }
    shared = {
        "log_line_prefix_template": template,
        "duplicate_stdout_filters": args.duplicate_stdout_filters,
        "duplicate_stderr_filters": args.duplicate_stderr_filters,
    }
    if args.logs_specs is None:
        return {**fields, **shared}
    from relaunch.procs.logs_specs import DefaultLogsSpecs

    if args.logs_specs is DefaultLogsSpecs:  # made when the agent starts: not here
        return {**fields, **shared}
    if args.log_dir is not None:
        check_directory(args.log_dir)
    try:
        logs_specs = args.logs_specs(**fields)
    except Exception as exc:
        raise ConfigError(
            f"--logs-specs: {args.logs_specs.__name__}(log_dir, redirects, tee, "
            f"local_ranks_filter) failed: {type(exc).__name__}: {exc}"
        ) from None
    return {"logs_specs": logs_specs, **shared}
