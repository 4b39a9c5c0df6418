"""The launch's settings groups: each travels as one typed value from the parsed flags
(``relaunch.cli.flags`` names each row's group and field) through ``LaunchConfig`` to the code
that reads it, checked once here. ``StateSettings`` (``core.workers.state_settings``) is one more.
"""

from __future__ import annotations

from typing import Any

from relaunch.core.defaults import (
    DEFAULT_HEALTH_CHECK_COOLDOWN,
    DEFAULT_HEALTH_CHECK_TIMEOUT,
    MAX_SECONDS,
)
from relaunch.core.run.restart import Backoff
from relaunch.core.value import Value
from relaunch.core.workers.state_settings import StateSettings


def check_seconds(name: str, value: float, zero_ok: bool) -> None:
    """A duration: a number > 0 (>= 0 when ``zero_ok``) and at most ``MAX_SECONDS``;
    ValueError naming ``name`` otherwise."""
    low_ok = value >= 0 if zero_ok else value > 0
    if isinstance(value, bool) or not (low_ok and value <= MAX_SECONDS):
        least = ">= 0" if zero_ok else "> 0"
        raise ValueError(
            f"{name} must be a number of seconds {least} and at most {MAX_SECONDS:.0f}, got "
            f"{value!r}"
        )


class RestartPolicy(Value):
    """How a crash loop is slowed and ended: ``backoff`` (base, max) seconds before the second
    restart in a row, doubling up to max; a group that ran ``healthy`` seconds (None: 2 x max,
    at least 1) ends the loop; the job stops after ``max_stalled`` restarts in a row that made
    no progress (0: never)."""

    __slots__ = ("backoff", "healthy", "max_stalled")

    backoff: tuple[float, float]
    max_stalled: int
    healthy: float | None

    def __init__(
        self,
        backoff: tuple[float, float] = (1.0, 30.0),
        max_stalled: int = 3,
        healthy: float | None = None,
    ) -> None:
        self._set(backoff=backoff, max_stalled=max_stalled, healthy=healthy)
        for bound in self.backoff:
            check_seconds("restart_backoff", bound, True)

    @property
    def rule(self) -> Backoff:
        """The waits between restarts (``core.run.restart.Backoff``)."""
        base, cap = self.backoff
        healthy = max(2 * cap, 1.0) if self.healthy is None else self.healthy
        return Backoff(base, cap, healthy)


class HangSettings(Value):
    """When a worker is hung, and who is slow: ``timeout`` seconds without a sign of life
    (None: never by silence); ``timers``, a file timer server for ``relaunch.timer.expires``
    (None: when ``TORCHELASTIC_ENABLE_FILE_TIMER=1``); a node whose ranks spend
    ``straggler_factor`` times the other nodes' time in a section, or step below the job's
    median rate divided by it, is flagged (``core.workers.stragglers``); a node flagged for
    ``evict_stragglers`` seconds is evicted to a waiting spare (None: never;
    ``core.workers.eviction``)."""

    __slots__ = ("evict_stragglers", "straggler_factor", "timeout", "timers")

    timeout: float | None
    timers: bool | None
    straggler_factor: float
    evict_stragglers: float | None

    def __init__(
        self,
        timeout: float | None = None,
        timers: bool | None = None,
        straggler_factor: float = 1.5,
        evict_stragglers: float | None = None,
    ) -> None:
        self._set(timeout=timeout, timers=timers, straggler_factor=straggler_factor)
        self._set(evict_stragglers=evict_stragglers)
        if self.timeout is not None:
            check_seconds("hang_timeout", self.timeout, False)
        if self.evict_stragglers is not None:
            check_seconds("evict_stragglers", self.evict_stragglers, False)


class HealthSettings(Value):
    """A shell ``command`` run before every join (exit 0: this node joins; None: no check),
    killed after ``timeout`` seconds; a node whose check failed tries again after
    ``cooldown``."""

    __slots__ = ("command", "cooldown", "timeout")

    command: str | None
    timeout: float
    cooldown: float

    def __init__(
        self,
        command: str | None = None,
        timeout: float = DEFAULT_HEALTH_CHECK_TIMEOUT,
        cooldown: float = DEFAULT_HEALTH_CHECK_COOLDOWN,
    ) -> None:
        self._set(command=command, timeout=timeout, cooldown=cooldown)
        check_seconds("health_check_timeout", self.timeout, False)
        check_seconds("health_check_cooldown", self.cooldown, False)
        if self.command is not None and not self.command.strip():
            raise ValueError("health_check must be a shell command, got an empty one")


class MetricsEndpoint(Value):
    """Where Prometheus metrics are served: ``port`` (0: a free one; None: not served) on
    ``host`` ("": every interface)."""

    __slots__ = ("host", "port")

    host: str
    port: int | None

    def __init__(self, host: str = "", port: int | None = None) -> None:
        self._set(host=host, port=port)
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ValueError(f"metrics_port must be a port 0..65535, got {self.port!r}")


def agent_groups(
    groups: tuple[
        RestartPolicy | None, HangSettings | None, HealthSettings | None, MetricsEndpoint | None
    ],
    flat: dict[str, Any],
) -> tuple[RestartPolicy, HangSettings, HealthSettings, MetricsEndpoint]:
    """The agent's groups (``restart_policy``, ``hang``, ``health``, ``metrics_endpoint``):
    each as given, or made of its ``flat`` keywords (the compatibility form:
    ``restart_backoff`` a ``Backoff``, ``health_check`` a check with ``command``, ``timeout``
    and ``cooldown``). TypeError when a group is given beside flat keywords of its own."""
    backoff, check = flat["restart_backoff"], flat["health_check"]
    restart = RestartPolicy(
        (1.0, 30.0) if backoff is None else (backoff.base, backoff.cap),
        flat["max_stalled_restarts"],
        None if backoff is None else backoff.healthy,
    )
    hang = HangSettings(flat["hang_timeout"], flat["timers"], flat["straggler_factor"])
    health = (
        HealthSettings()
        if check is None
        else HealthSettings(check.command, check.timeout, check.cooldown)
    )
    endpoint = MetricsEndpoint(flat["metrics_host"], flat["metrics_port"])
    for given, made in zip(groups, (restart, hang, health, endpoint), strict=True):
        if given is not None and made != type(made)():
            raise TypeError(f"give {type(made).__name__} or its flat keywords, not both: {made}")
    return (
        groups[0] or restart,
        groups[1] or hang,
        groups[2] or health,
        groups[3] or endpoint,
    )


class _Unset:
    def __repr__(self) -> str:
        return "<from its group>"


#: The default of ``LaunchConfig``'s flat fields that have a group: the group's field decides.
UNSET: Any = _Unset()

#: Each settings group of the config: its class and its fields' flat twins, the keywords
#: ``LaunchConfig`` took before the groups (the compatibility form, kept in step with them).
GROUPS: dict[str, tuple[type, dict[str, str]]] = {
    "restart_policy": (
        RestartPolicy,
        {"backoff": "restart_backoff", "max_stalled": "max_stalled_restarts"},
    ),
    "hang": (
        HangSettings,
        {"timeout": "hang_timeout", "timers": "timers", "straggler_factor": "straggler_factor"},
    ),
    "health": (
        HealthSettings,
        {
            "command": "health_check",
            "timeout": "health_check_timeout",
            "cooldown": "health_check_cooldown",
        },
    ),
    "metrics_endpoint": (MetricsEndpoint, {"host": "metrics_host", "port": "metrics_port"}),
    "state": (
        StateSettings,
        {
            "memory": "state_memory",
            "directory": "state_dir",
            "persist_every": "state_persist_every",
            "jit_save_timeout": "jit_save_timeout",
            "replicas": "state_replicas",
            "copy_every": "state_copy_every",
        },
    ),
}
