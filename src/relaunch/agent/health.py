"""The node's health check, run before every join (``agent.join``): a node that fails it is
kept out of the job until it passes.

``--health-check CMD`` is a shell command; exit status 0 means healthy. It runs with the
agent's environment plus ``LOCAL_WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``, ``ROLE_NAME`` and
``TORCHELASTIC_RESTART_COUNT`` (ranks are not known before the join), in a process group of its
own that the orphan guardian kills should relaunch die, with its stdout and stderr read by the
agent. A check that runs past its timeout is killed, and has failed.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping

from relaunch.core.defaults import DEFAULT_HEALTH_CHECK_COOLDOWN, DEFAULT_HEALTH_CHECK_TIMEOUT
from relaunch.core.durations import seconds
from relaunch.core.value import Value
from relaunch.procs.guardian import guardian

#: The most of a failed check's last line that its log line quotes.
LAST_LINE_CHARS = 200


class HealthCheck(Value):
    """``command`` (a shell command) must exit 0 within ``timeout`` seconds for this node to
    join; after a failure the node tries again ``cooldown`` seconds later."""

    __slots__ = ("command", "cooldown", "timeout")

    command: str
    timeout: float
    cooldown: float

    def __init__(
        self,
        command: str,
        timeout: float = DEFAULT_HEALTH_CHECK_TIMEOUT,
        cooldown: float = DEFAULT_HEALTH_CHECK_COOLDOWN,
    ) -> None:
        self._set(command=command, timeout=timeout, cooldown=cooldown)


class HealthResult(Value):
    """How a check went: ``healthy``, what it ended with, and the last line it printed."""

    __slots__ = ("healthy", "last_line", "status")

    healthy: bool
    status: str
    last_line: str

    def __init__(self, healthy: bool, status: str, last_line: str = "") -> None:
        self._set(healthy=healthy, status=status, last_line=last_line)


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
