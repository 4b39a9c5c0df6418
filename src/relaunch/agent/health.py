"""Before every join: run the node's health check, and keep a node that fails it (or that the
job excluded for failing it too often, ``core.exclusion``) out of the job until it may join.

``--health-check CMD`` is a shell command; exit status 0 means healthy. It runs with the
agent's environment plus ``LOCAL_WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``, ``ROLE_NAME`` and
``TORCHELASTIC_RESTART_COUNT`` (ranks are not known before the join), in a process group of its
own that the orphan guardian kills should relaunch die, with its stdout and stderr read by the
agent. A check that runs past its timeout is killed, and has failed.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass

from relaunch.agent.spec import WorkerGroup
from relaunch.core.defaults import DEFAULT_HEALTH_CHECK_COOLDOWN, DEFAULT_HEALTH_CHECK_TIMEOUT
from relaunch.core.durations import seconds
from relaunch.procs.guardian import guardian
from relaunch.rendezvous.api import RendezvousClosedError
from relaunch.rendezvous.job import JobServices
from relaunch.runtime import SYSTEM_CLOCK, Clock

log = logging.getLogger(__name__)

#: The most of a failed check's last line that its log line quotes.
LAST_LINE_CHARS = 200


@dataclass(frozen=True)
class HealthCheck:
    """``command`` (a shell command) must exit 0 within ``timeout`` seconds for this node to
    join; after a failure the node tries again ``cooldown`` seconds later."""

    command: str
    timeout: float = DEFAULT_HEALTH_CHECK_TIMEOUT
    cooldown: float = DEFAULT_HEALTH_CHECK_COOLDOWN


@dataclass(frozen=True)
class HealthResult:
    """How a check went: ``healthy``, what it ended with, and the last line it printed."""

    healthy: bool
    status: str
    last_line: str = ""


def run_check(check: HealthCheck, env: Mapping[str, str]) -> HealthResult:
    """Run ``check`` once with ``env``; its whole process group is gone when this returns."""
    try:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", check.command],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
        )
    except OSError as exc:
        return HealthResult(False, f"could not start: {exc}")
    keeper = guardian()
    keeper.register(proc.pid)
    try:
        try:
            output, _ = proc.communicate(timeout=check.timeout)
            status = _status(proc.returncode)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            output, _ = proc.communicate()
            status = f"timed out after {seconds(check.timeout)}"
    finally:  # a signal that stops relaunch stops the check too
        _kill_group(proc.pid)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        keeper.unregister(proc.pid)
    lines = [line for line in output.decode(errors="replace").splitlines() if line.strip()]
    last = lines[-1].strip()[:LAST_LINE_CHARS] if lines else ""
    return HealthResult(status == "exit 0", status, last)


def _status(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit {returncode}"


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def check_env(local_world_size: int, run_id: str, role: str, restarts: int) -> dict[str, str]:
    """The health check's environment: the agent's, and what is known of the node before it
    joins."""
    return {
        **os.environ,
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "TORCHELASTIC_RUN_ID": run_id,
        "ROLE_NAME": role,
        "TORCHELASTIC_RESTART_COUNT": str(restarts),
    }


def await_admission(
    job: JobServices,
    run_id: str,
    check: HealthCheck | None,
    env: Mapping[str, str],
    backoff: float = 0.0,
    clock: Clock = SYSTEM_CLOCK,
) -> None:
    """Return once this node may join: it left its running round (so the others stop at
    once), waited ``backoff`` seconds (a crash loop's), is not excluded from the job, and
    passed its health check. Says on the console why it waits, and until when (an exclusion
    ends at a ``clock.time()``); ``RendezvousClosedError`` when the job finishes meanwhile."""
    while True:
        until = job.prepare_join()
        if backoff > 0:
            if job.wait_closed(backoff):
                raise RendezvousClosedError(f"the job {run_id!r} has finished")
            backoff = 0.0
            continue
        if until is not None:
            log.warning(
                "this node is excluded from the job until %s (it failed the job too often); "
                "it will try to join again then",
                time.strftime("%H:%M:%S", time.localtime(until)),
            )
            if job.wait_closed(until - clock.time()):
                raise RendezvousClosedError(f"the job {run_id!r} has finished")
            continue
        if check is None:
            return
        result = run_check(check, env)
        if result.healthy:
            return
        quoted = f": {result.last_line!r}" if result.last_line else ", no output"
        log.warning(
            "health check failed (%s%s): %s; not joining, trying again in %gs",
            result.status,
            quoted,
            check.command,
            check.cooldown,
        )
        if job.wait_closed(check.cooldown):
            raise RendezvousClosedError(f"the job {run_id!r} has finished")


def join(
    job: JobServices,
    group: WorkerGroup,
    check: HealthCheck | None,
    backoff: float,
    restarts: int,
    clock: Clock = SYSTEM_CLOCK,
) -> float:
    """Join the next round once this node may (``await_admission``, after ``backoff``
    seconds; the job has used ``restarts`` restarts): ``group`` takes its place in it. The
    seconds the join took, from when this node was admitted."""
    spec = group.spec
    run_id = spec.rdzv_handler.get_run_id()
    env = check_env(spec.local_world_size, run_id, spec.role, restarts)
    job.set_workers(spec.role, spec.local_world_size)  # what this node's join carries
    await_admission(job, run_id, check, env, backoff, clock)
    began = clock.monotonic()
    group.join(spec.rdzv_handler.next_rendezvous())
    return clock.monotonic() - began
