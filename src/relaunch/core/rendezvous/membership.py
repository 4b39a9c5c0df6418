"""Membership changes of a running rendezvous round: what happened, and how big the next round is.

A member that notices a change marks the round for re-forming with a record (``news/r{n}/changed``)
that every member reads. The record says what kind of change it was, why (for the logs), and
how many nodes the next round expects: the round's members, less the one lost or gone, plus
the nodes waiting to join. The kind, not the wording of the reason, decides that size: a
reason may quote a worker's error, whose text can say anything.
"""

from __future__ import annotations

import enum
import json
from typing import Any

from relaunch.core.value import Value


class ChangeKind(str, enum.Enum):
    NODES_WAITING = "nodes_waiting"  # nodes wait to join: the next round grows
    MEMBER_LOST = "member_lost"  # a member stopped heartbeating (seen by its ring neighbour)
    MEMBER_LEFT = "member_left"  # a member shut down before the job finished
    MEMBER_EXCLUDED = "member_excluded"  # a member failed the job too often (core.run.exclusion)
    MEMBER_EVICTED = "member_evicted"  # a straggler, evicted to a spare (core.workers.eviction)
    RESTARTING = "restarting"  # a member restarts its workers (after a failure, say)
    FINISHED = "finished"  # the job finished: nobody re-forms, late nodes exit
    FAILED = "failed"  # a failure with no restart left ended the job: every node stops
    STORE_LOST = "store_lost"  # this node could not reach the store: no member is gone

    @property
    def removes_member(self) -> bool:
        """Whether the round loses one of its members by this change."""
        return self in (
            ChangeKind.MEMBER_LOST,
            ChangeKind.MEMBER_LEFT,
            ChangeKind.MEMBER_EXCLUDED,
            ChangeKind.MEMBER_EVICTED,
        )


class MembershipChange(Value):
    """Why a running round must be re-formed.

    ``member`` is the group rank of the member lost or gone; ``detected_by`` the group rank of
    the member that noticed a loss. ``reason`` is the line the logs and restart reasons show.
    ``stacks``: a worker hung, so every member asks its workers for their stacks before it
    stops them. ``requeue`` (a failed job): False when restarting cannot help, so that every
    node ends with the status that says not to requeue the job.
    """

    __slots__ = ("detected_by", "kind", "member", "reason", "requeue", "stacks")

    kind: ChangeKind
    reason: str
    member: int | None
    detected_by: int | None
    stacks: bool
    requeue: bool

    def __init__(
        self,
        kind: ChangeKind,
        reason: str,
        member: int | None = None,
        detected_by: int | None = None,
        stacks: bool = False,
        requeue: bool = True,
    ) -> None:
        self._set(
            kind=kind,
            reason=reason,
            member=member,
            detected_by=detected_by,
            stacks=stacks,
            requeue=requeue,
        )

    def __str__(self) -> str:
        return self.reason

    @classmethod
    def nodes_waiting(cls, count: int) -> MembershipChange:
        return cls(ChangeKind.NODES_WAITING, f"{count} node(s) waiting to join")

    @classmethod
    def member_lost(cls, member: int, why: str, detected_by: int | None) -> MembershipChange:
        reason = f"node of group rank {member} lost ({why})"
        return cls(ChangeKind.MEMBER_LOST, reason, member, detected_by)

    @classmethod
    def member_left(cls, member: int) -> MembershipChange:
        return cls(ChangeKind.MEMBER_LEFT, f"node of group rank {member} left the job", member)

    @classmethod
    def member_excluded(cls, member: int, reason: str) -> MembershipChange:
        """Member ``member`` restarts after a failure that excludes it: the others re-form
        without it (``reason`` says why, and until when)."""
        return cls(ChangeKind.MEMBER_EXCLUDED, reason, member)

    @classmethod
    def member_evicted(cls, member: int, reason: str, judge: int) -> MembershipChange:
        """Member ``member`` is evicted as a straggler by the judge (group rank ``judge``,
        ``core.workers.eviction``): the others re-form with a spare in its place, and the
        member, seeing this change, stays out for the exclusion cooldown."""
        return cls(ChangeKind.MEMBER_EVICTED, reason, member, judge)

    @classmethod
    def restarting(cls, reason: str = "", stacks: bool = False) -> MembershipChange:
        return cls(ChangeKind.RESTARTING, reason or "the worker group is restarting", stacks=stacks)

    @classmethod
    def finished(cls) -> MembershipChange:
        return cls(ChangeKind.FINISHED, "the job finished")

    @classmethod
    def failed(cls, reason: str, stacks: bool = False, requeue: bool = True) -> MembershipChange:
        return cls(ChangeKind.FAILED, f"the job failed: {reason}", stacks=stacks, requeue=requeue)

    @classmethod
    def store_lost(cls, error: object) -> MembershipChange:
        return cls(ChangeKind.STORE_LOST, f"lost the rendezvous store: {error}")


def expected_size(members: int, change: MembershipChange, waiting: int = 0) -> int:
    """How many nodes the round after one of ``members`` nodes expects, ``waiting`` more
    having asked to join: one fewer when ``change`` removed a member."""
    return members - (1 if change.kind.removes_member else 0) + waiting


def encode_change(change: MembershipChange, expected: int) -> bytes:
    """The ``changed`` record: the change, and the size of the round that re-forms after it."""
    record: dict[str, Any] = {
        "kind": change.kind.value,
        "reason": change.reason,
        "expected": expected,
    }
    if change.member is not None:
        record["member"] = change.member
    if change.detected_by is not None:
        record["detected_by"] = change.detected_by
    if change.stacks:
        record["stacks"] = True
    if not change.requeue:
        record["requeue"] = False
    return json.dumps(record).encode()


def decode_change(raw: bytes) -> tuple[MembershipChange, int | None]:
    """The change a ``changed`` record holds and the size it expects (None if it says none).

    A record without a known kind (written by an older relaunch) counts as a restart, which
    never shrinks the next round below its size. ``ValueError`` (saying what is wrong) for a
    record no relaunch wrote: not a JSON object, or fields of the wrong type.
    """
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    try:
        kind = ChangeKind(data.get("kind"))
    except ValueError:
        kind = ChangeKind.RESTARTING
    member, detected_by = _optional_int(data, "member"), _optional_int(data, "detected_by")
    change = MembershipChange(
        kind,
        str(data.get("reason", "")),
        member,
        detected_by,
        bool(data.get("stacks", False)),
        data.get("requeue", True) is not False,
    )
    expected = _optional_int(data, "expected")
    if expected is not None and expected < 0:
        raise ValueError(f"'expected' is negative ({expected})")
    return change, expected


def _optional_int(data: dict[str, Any], name: str) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name!r} is not an integer ({value!r:.40})")
    return value
