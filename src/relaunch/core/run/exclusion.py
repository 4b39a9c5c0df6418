"""Excluding a node that keeps failing the job, as decisions: pure functions of its record and
``now`` (Horovod's blacklist with a cooldown).

Each node has a record in the rendezvous store (``relaunch/{run_id}/nodes/{identity}``, written
only by that node): how many group restarts its workers caused since it was last excluded, and
until when it is excluded. A failure counts against a node when its restart is the one that
re-formed the round (the node was the root cause, not a node that failed with it). At
``ExclusionPolicy.after`` such failures the node is excluded for ``cooldown`` seconds, unless
the job could not go on without it (fewer than ``min_nodes`` would be left): then it stays,
and its next failure is weighed again. An excluded node does not join a round until its
cooldown ends; its count starts again from 0.

Times here are wall-clock seconds (``time.time()``): the end of a cooldown is read by every
node of the job, on every host, so the hosts' clocks must agree (NTP) to a few seconds.
"""

from __future__ import annotations

import json

from relaunch.core.value import Value

#: Failures a node may cause before it is excluded (``--rdzv-conf exclude_after``; 0: never).
DEFAULT_EXCLUDE_AFTER = 3
#: Seconds an excluded node stays out (``--rdzv-conf exclude_cooldown``).
DEFAULT_EXCLUDE_COOLDOWN = 600.0


class ExclusionPolicy(Value):
    """When a node is excluded: after ``after`` failures it caused (0: never), for
    ``cooldown`` seconds."""

    __slots__ = ("after", "cooldown")

    after: int
    cooldown: float

    def __init__(
        self, after: int = DEFAULT_EXCLUDE_AFTER, cooldown: float = DEFAULT_EXCLUDE_COOLDOWN
    ) -> None:
        self._set(after=after, cooldown=cooldown)
        if self.after < 0:
            raise ValueError(f"exclude_after must be >= 0, got {self.after}")
        if not self.cooldown > 0:
            raise ValueError(f"exclude_cooldown must be > 0 seconds, got {self.cooldown}")


class NodeRecord(Value):
    """A node's record: ``failures`` it caused since its last exclusion, the wall-clock end
    of its last exclusion (0: never excluded), and how many times it was excluded."""

    __slots__ = ("excluded_until", "exclusions", "failures")

    failures: int
    excluded_until: float
    exclusions: int

    def __init__(self, failures: int = 0, excluded_until: float = 0.0, exclusions: int = 0) -> None:
        self._set(failures=failures, excluded_until=excluded_until, exclusions=exclusions)


def after_failure(
    record: NodeRecord, policy: ExclusionPolicy, now: float, others: int, min_nodes: int
) -> NodeRecord:
    """The record once the node caused one more failure at ``now``; ``others``: the nodes the
    next round would have without it (the round's other members and the nodes waiting)."""
    failures = record.failures + 1
    if policy.after and failures >= policy.after and others >= min_nodes:
        return NodeRecord(0, now + policy.cooldown, record.exclusions + 1)
    return NodeRecord(failures, record.excluded_until, record.exclusions)


def excluded_until(record: NodeRecord, now: float) -> float | None:
    """When the node's exclusion ends, if it is excluded at ``now``; else None."""
    return record.excluded_until if record.excluded_until > now else None


def encode_record(record: NodeRecord) -> bytes:
    return json.dumps(
        {
            "failures": record.failures,
            "excluded_until": record.excluded_until,
            "exclusions": record.exclusions,
        }
    ).encode()


def decode_record(raw: bytes | None) -> NodeRecord:
    """The record stored as ``raw`` (``encode_record``); an absent one is a clean record.
    ValueError saying what is wrong when no relaunch wrote it: a record read as clean would
    silently forget the node's failures, or lift its exclusion."""
    if not raw:
        return NodeRecord()
    try:
        data = json.loads(raw)
    except ValueError:
        raise ValueError("not JSON") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    failures = _count(data, "failures")
    exclusions = _count(data, "exclusions")
    until = data.get("excluded_until", 0.0)
    if isinstance(until, bool) or not isinstance(until, (int, float)):
        raise ValueError("excluded_until is not a number")
    if not 0 <= until < float("inf"):
        raise ValueError("excluded_until is not a time")
    return NodeRecord(failures, float(until), exclusions)


def _count(data: dict[str, object], name: str) -> int:
    value = data.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} is not a count")
    return value


def valid_node_name(name: str) -> bool:
    """Whether ``name`` (``--rdzv-conf node_name``) may be part of a store key: 1 to 64 of
    letters, digits, ``.``, ``_`` and ``-``."""
    return 0 < len(name) <= 64 and all(c.isascii() and (c.isalnum() or c in "._-") for c in name)


def node_identity(hostname: str, node_name: str | None) -> str:
    """How the job knows a node across its restarts: its host's name, and the ``node_name``
    the user gave it (to tell apart several agents on one host)."""
    return f"{hostname}/{node_name}" if node_name else hostname
