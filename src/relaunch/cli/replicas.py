"""One node's replica groups (``relaunch --replica-groups R`` on one node): the launcher becomes
their supervisor.

It serves the built-in store once, on a free loopback port, and starts R group agents: each a
``relaunch`` of the same command line with ``--replica-group g``, told the store and the job's
run id by ``GROUP_STORE_ENV`` and ``GROUP_RUN_ID_ENV`` (``cli.args`` turns them into the group's
own c10d rendezvous, run id ``RUN_ID-group{g}``). Each agent is a whole launcher with its own
workers, ``MASTER_PORT``, restarts and budget: nothing one group does reaches another. The
supervisor forwards the stop signals sent to it (a terminal's reach every process of its group
already), ends when every group has ended, says how each did in one line, and exits with the
worst status.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from relaunch.cli.args import (
    GROUP_RUN_ID_ENV,
    GROUP_STORE_ENV,
    GROUP_SUPERVISOR_ENV,
    config_from_args,
)
from relaunch.core.run import replica_groups

if TYPE_CHECKING:
    import argparse

    from relaunch.config import LaunchConfig

#: Seconds to read a group's restarts from the store once it ended.
READ_TIMEOUT = 2.0


def _nothing() -> None:
    pass


def job_services(
    config: LaunchConfig,
    count: int,
    say: Callable[[str], None],
    start: bool = True,
    log_dir: str | None = None,
    script: str | None = None,
) -> tuple[dict[str, str], Callable[[], None]]:
    """What every group's workers get besides their group's variables, and how to stop the
    services that live as long as the run: torchft's lighthouse, where the job wants one
    (``agent.lighthouse``: torchft importable, ``TORCHFT_LIGHTHOUSE`` unset), kept alive until
    the stop, logging in ``log_dir`` (the job's); ``script``, the groups' Python script, is
    read for whether to say how to restart warm. Without ``start`` (a dry run), what it would
    give, started nothing."""
    from relaunch.core.run import lighthouse as decide

    if not start:
        from relaunch.agent.lighthouse import torchft_importable

        if not decide.wants_lighthouse(os.environ, torchft_importable(), count):
            return {}, _nothing
        return {
            decide.ADDRESS_VAR: "http://127.0.0.1:<a free port at the start>",
            **decide.worker_defaults(os.environ),
        }, _nothing
    from relaunch.agent.lighthouse import start_if_wanted

    log_dir = log_dir or config.log_dir or "."
    os.makedirs(log_dir, exist_ok=True)
    lighthouse = start_if_wanted(
        os.environ, count, log_dir, say=lambda line: say(f"relaunch: {line}")
    )
    if lighthouse is None:
        return {}, _nothing
    say(
        f"relaunch: torchft's lighthouse for the {count} groups: {lighthouse.address} "
        f"(pid {lighthouse.pid}, kept alive; its log: {os.path.join(log_dir, 'lighthouse.log')})"
    )
    hint = decide.warm_hint(config.preload)
    if hint is not None and _names_torchft(script):
        say(f"relaunch: {hint}")
    return {**lighthouse.environment(), **decide.worker_defaults(os.environ)}, lighthouse.close


def _names_torchft(script: str | None) -> bool:
    """Whether the groups' program is a torchft job as far as can be told without running it:
    its Python ``script`` names torchft (None: a module or a binary, not read)."""
    if script is None:
        return False
    try:
        with open(script, "rb") as text:
            return b"torchft" in text.read(1 << 20)
    except OSError:
        return False


def dry_run_groups(
    args: argparse.Namespace,
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str,
    entry_args: Sequence[str],
) -> str:
    """``--dry-run`` of one node's groups: each group's first attempt, as its agent plans it."""
    from relaunch.agent.dry_run import dry_run
    from relaunch.launcher import placement_of

    count = args.replica_groups
    extra, _ = job_services(config, count, say=lambda line: None, start=False)
    texts = [
        f"relaunch: {count} replica groups of {config.nproc_per_node} worker(s) on this node, "
        f"each its own world, restarts and budget (--max-restarts {config.max_restarts} each); "
        "the supervisor serves their store on a free port at the start\n"
    ]
    for group in range(count):
        environ = {
            **os.environ,
            GROUP_STORE_ENV: "127.0.0.1:0",
            GROUP_RUN_ID_ENV: config.run_id or "<a fresh run id>",
        }
        group_args = _with_group(args, group)
        group_config, _, _ = config_from_args(group_args, environ)
        where = (
            f"replica group {group} (run id {group_config.run_id}, MASTER_PORT: a free port at "
            "the start)"
        )
        texts.append(
            dry_run(
                group_config,
                entrypoint,
                entry_args,
                placement=placement_of(group_config),
                group_env={**extra, **replica_groups.group_env(group, count)},
                where=where,
            )
        )
    return "".join(texts)


def _with_group(args: argparse.Namespace, group: int) -> argparse.Namespace:
    import argparse

    return argparse.Namespace(**{**vars(args), "replica_group": group})


def run_groups(
    argv: Sequence[str],
    args: argparse.Namespace,
    config: LaunchConfig,
    say: Callable[[str], None],
) -> int:
    """Run one node's ``--replica-groups`` as child agents until all have ended, telling people
    through ``say`` (the command's stderr); the worst exit status."""
    from relaunch.agent.lighthouse import LighthouseError
    from relaunch.core.rendezvous.rdzv_conf import TOKEN_ENV
    from relaunch.store.server import TcpStoreServer

    count = args.replica_groups
    try:
        server = TcpStoreServer("127.0.0.1", 0, os.environ.get(TOKEN_ENV), 4 * count).start()
    except OSError as exc:
        say(f"relaunch: error: cannot serve the replica groups' store: {exc.strerror or exc}")
        return 1
    log_dir = config.log_dir
    if log_dir is None:  # one folder for the job: each group's and the lighthouse's logs
        import tempfile

        from relaunch.procs.logs_specs import TEMP_PREFIX

        log_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX)
        argv = ["--log-dir", log_dir, *argv]
    try:
        script = None if args.module or args.no_python else args.training_script
        extra, stop_services = job_services(config, count, say, log_dir=log_dir, script=script)
    except (LighthouseError, OSError) as exc:
        server.stop()
        why = str(exc) if isinstance(exc, LighthouseError) else exc.strerror or str(exc)
        say(f"relaunch: error: {why}")
        return 1
    say(
        f"relaunch: {count} replica groups of {config.nproc_per_node} worker(s), each restarting "
        f"on its own; their store: {server.endpoint}, run ids {config.run_id}-group0.."
        f"{count - 1} (all of them: relaunch status --rdzv-endpoint {server.endpoint} "
        f"--rdzv-id {config.run_id})"
    )
    environ = {
        **os.environ,
        **extra,
        GROUP_STORE_ENV: server.endpoint,
        GROUP_RUN_ID_ENV: config.run_id,
        GROUP_SUPERVISOR_ENV: str(os.getpid()),
    }
    try:
        ends = _supervise(argv, count, environ, tuple(args.signals_to_handle), say)
    finally:
        stop_services()
    restarts = {group: _restarts(server.endpoint, config.run_id, group) for group in ends}
    server.stop()
    for group, status in sorted(ends.items()):
        killed = _killed_by(status)
        say(
            "relaunch: "
            + replica_groups.format_group_end(
                group, replica_groups.exit_status(status), restarts[group], killed
            )
        )
    return replica_groups.worst_status(replica_groups.exit_status(s) for s in ends.values())


def _supervise(
    argv: Sequence[str],
    count: int,
    environ: Mapping[str, str],
    signals: tuple[signal.Signals, ...],
    say: Callable[[str], None],
) -> dict[int, int]:
    """Start the group agents and wait for each to end, forwarding the stop signals sent to
    this process (``kill``; not a terminal's, which reached the agents already); each group's
    ``waitpid`` return code (negative: killed by that signal)."""
    waited = {signal.SIGCHLD, *signals}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    agents: dict[int, int] = {}
    ends: dict[int, int] = {}
    stopping: signal.Signals | None = None
    try:
        for group in range(count):
            # before the script: what follows it is the script's own arguments
            command = [sys.executable, "-m", "relaunch", "--replica-group", str(group), *argv]
            pid = os.posix_spawn(sys.executable, command, environ, setsigmask=previous)
            agents[pid] = group
        while agents:
            info = signal.sigwaitinfo(waited)
            if info.si_signo != signal.SIGCHLD:
                stopping = signal.Signals(info.si_signo)
                if info.si_code <= 0:  # sent by a process, to this one alone
                    for pid in agents:
                        _signal(pid, stopping)
                continue
            for pid, code in _reaped(agents):
                if pid not in agents:
                    continue
                group = agents.pop(pid)
                ends[group] = code
                killed = _killed_by(code)
                if killed is not None and stopping is None and agents:
                    say(
                        f"relaunch: replica group {group}: its agent was killed by {killed}; "
                        "the other groups go on"
                    )
    finally:
        for pid in agents:  # only when starting or waiting failed: leave none behind
            _signal(pid, signal.SIGTERM)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return ends


def _reaped(agents: Mapping[int, int]) -> list[tuple[int, int]]:
    """Every agent of ``agents`` that ended, and its return code (negative: killed by that
    signal); only those: the lighthouse, a child too, is waited on by its own keeper."""
    ended: list[tuple[int, int]] = []
    for pid in list(agents):
        try:
            waited, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        if waited == pid:
            ended.append((pid, os.waitstatus_to_exitcode(status)))
    return ended


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _killed_by(code: int) -> str | None:
    """The signal's name when ``code`` says the agent was killed by SIGKILL (a stop signal it
    handles ends it with 128 + n instead)."""
    return signal.Signals(-code).name if code < 0 else None


def _restarts(endpoint: str, run_id: str, group: int) -> int | None:
    """The restarts group ``group`` used, as its rendezvous recorded them; None when it cannot
    be read (the group never formed)."""
    from relaunch.core.rendezvous.rdzv_conf import TOKEN_ENV
    from relaunch.rendezvous.reader import JobReader
    from relaunch.store.client import TcpStore

    host, _, port = endpoint.rpartition(":")
    try:
        store = TcpStore(
            host, int(port), os.environ.get(TOKEN_ENV), timeout=READ_TIMEOUT,
            connect_timeout=READ_TIMEOUT,
        )  # fmt: skip
        try:
            return JobReader(store, replica_groups.group_run_id(run_id, group)).read().restarts
        finally:
            store.close()
    except Exception:  # a group that never formed, or a store that cannot say: not known
        return None
