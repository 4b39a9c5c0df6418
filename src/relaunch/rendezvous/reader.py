"""A read-only look at one job in its rendezvous store: what ``relaunch status`` prints.

It connects as a client (it never hosts the store) and only reads, under
``relaunch/{run_id}/`` (see ``rounds``)::

    round                       the round nodes join now
    news/r{n}/final             the completed round n: its member count, when it formed
    r{n}/size                   how many nodes a round wants (its lead's ``min:max``)
    news/r{n}/changed           round n is being re-formed, and why
    r{n}/joins, r{n}/join/      who joined a round still forming (a counter; keys on etcd)
    r{n}/notes/status/{g}       each member's ``NodeStatus``, posted every few seconds
    r{n}/notes/job              group rank 0's ``JobView`` (stragglers, pace)
    restarts                    the group restarts the job used
    news/closed                 the job finished

While round n forms (or has just started and posted nothing yet) the notes of round n - 1 are
shown, and the snapshot says so. Times in the notes are the agents' clocks (``time.time()``).
``JobReader`` reads the built-in store; ``EtcdJobReader`` etcd, where joins are keys and a
round's notes come in one range read.

Everything read is checked where it enters (``MalformedJob`` names the key and what is wrong
with it), and the work a read does is bounded by what a real job can be, not by what the store
claims: at most ``MAX_MEMBERS`` members, ``MAX_NOTE`` bytes a value and ``MAX_READ`` bytes in
all, whatever a corrupt or hostile store holds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from relaunch.core.output import status as core
from relaunch.core.output import status_table
from relaunch.core.rendezvous.membership import ChangeKind, MembershipChange, decode_change
from relaunch.core.rendezvous.rounds import (
    JOIN_TOTAL_DIGITS,
    decode_size,
    joined_words,
    unpack_join,
)
from relaunch.core.workers import stragglers
from relaunch.rendezvous.api import RendezvousError
from relaunch.rendezvous.rounds import CLOSED, NEWS, closing_failure, news_prefix
from relaunch.runtime import SYSTEM_CLOCK, Clock
from relaunch.store.api import StoreProtocolError, Versioned

#: Rounds the ``round`` key may lag behind the newest completed one (its lead writes the final
#: record first), looked past at most.
LOOK_AHEAD = 3
#: The most members a round read may claim: four times the 4,096 nodes relaunch's rendezvous is
#: benchmarked with (``benchmarks/rendezvous/``). A final record claiming more is refused
#: rather than read (on the built-in store, one request per member).
MAX_MEMBERS = 16384
#: The largest value read: a node's status (its ranks and restart reasons) is a few KiB.
MAX_NOTE = 1 << 20
#: The most bytes one read of the job takes in, all values together.
MAX_READ = 64 << 20
#: The largest counter read (restarts, round numbers): 64 bits.
_MAX_INT = (1 << 63) - 1
#: What parsing a value from outside may raise, besides ValueError.
_SHAPE_ERRORS = (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError)


class MalformedJob(StoreProtocolError):
    """The store holds, under the job's keys, what no relaunch agent writes."""


_Note = TypeVar("_Note", core.NodeStatus, core.JobView)


class Readable(Protocol):
    """All the reader asks of a store: reads."""

    def get(self, key: str) -> Versioned:
        """The value and version of ``key`` (``Versioned(None, 0)`` when absent)."""


class PrefixReadable(Readable, Protocol):
    """A store that also reads by prefix (etcd)."""

    def count_prefix(self, prefix: str) -> tuple[int, int]:
        """How many keys start with ``prefix``, and the store's revision."""

    def read_prefix(self, prefix: str, limit: int = 0) -> tuple[dict[str, Versioned], int]:
        """The keys under ``prefix`` (at most ``limit``; 0: all), and the store's revision."""


class JobNotFound(RendezvousError):
    """Nothing of the job is in the store: a wrong ``--rdzv-id``, or no node joined yet."""


@dataclass(frozen=True)
class Snapshot:
    """The job as read at ``read_at``: its round and phase (``forming``, ``running``,
    ``re-forming``, ``starting`` or ``finished``), the members of the round, the notes shown
    (of round ``notes_round``), and the restarts used."""

    run_id: str
    round: int
    phase: str
    members: int | None
    notes_round: int | None
    restarts: int
    read_at: float
    nodes: list[core.NodeStatus] = field(default_factory=list)
    view: core.JobView | None = None
    why: str = ""  # what re-forms the round, or how many joined one that forms
    #: What the round shown says of its posts (a node lost, a round over, when it formed).
    standing: core.Standing = field(default_factory=core.Standing)

    @property
    def note(self) -> str:
        """The phase in words, for the table's first line."""
        words = "finished" if self.phase == "finished" else f"round {self.round} {self.phase}"
        if self.why:
            words += f" ({self.why})"
        if self.notes_round is not None and self.notes_round != self.round:
            words += f"; showing round {self.notes_round}'s last posts"
        return words

    def table(self, now: float | None = None) -> str:
        """The table ``relaunch status`` prints (``core.output.status_table.format_table``)."""
        return status_table.format_table(
            self.run_id,
            self.nodes,
            self.view,
            self.restarts,
            self.read_at if now is None else now,
            self.note,
            self.members if self.notes_round in (self.round, None) else None,
            self.standing,
        )

    def as_json(self) -> dict[str, Any]:
        """The same for scripts: ``core.output.status_table.as_json`` with the round, phase and read
        time."""
        members = self.members if self.notes_round in (self.round, None) else None
        data = status_table.as_json(
            self.run_id, self.nodes, self.view, self.restarts, members, self.standing, self.read_at
        )
        data.update(
            round=self.round,
            phase=self.phase,
            why=self.why,
            members=self.members,
            notes_round=self.notes_round,
            read_at=self.read_at,
        )
        return data


class JobReader:
    """Reads job ``run_id`` from ``store`` (the built-in store: joins are counters, and notes
    are read one by one); a snapshot is stamped with ``clock.time()``."""

    def __init__(self, store: Readable, run_id: str, clock: Clock = SYSTEM_CLOCK) -> None:
        self._store = store
        self._run_id = run_id
        self._clock = clock
        self._prefix = f"relaunch/{run_id}/"
        self._read = 0  # bytes taken in by the read under way

    @property
    def taken(self) -> int:
        """The bytes the last read took in."""
        return self._read

    def of(self, run_id: str) -> JobReader:
        """A reader of job ``run_id`` on the same store."""
        return JobReader(self._store, run_id, self._clock)

    def _malformed(self, key: str, what: str) -> MalformedJob:
        return MalformedJob(f"{key} holds what no relaunch agent writes: {what}")

    def _checked(self, key: str, value: bytes | None) -> bytes | None:
        """``value`` of ``key`` if within the bounds of a read (``MAX_NOTE``, ``MAX_READ``)."""
        if value is None:
            return None
        if not isinstance(value, bytes):
            raise self._malformed(key, f"a value of type {type(value).__name__}")
        if len(value) > MAX_NOTE:
            raise self._malformed(key, f"a value of {len(value)} bytes (at most {MAX_NOTE})")
        self._read += len(value)
        if self._read > MAX_READ:
            raise MalformedJob(f"the job's keys hold more than {MAX_READ} bytes in all")
        return value

    def _integer(
        self, key: str, value: bytes | None, high: int = _MAX_INT, digits: int = 19
    ) -> int:
        """The decimal integer ``value`` of ``key`` (0 when absent) of at most ``digits``
        digits, within 0..``high``."""
        if value is None:
            return 0
        text = value.strip()
        if not (text.isdigit() and len(text) <= digits and int(text) <= high):
            shown = repr(value[:20]) + ("..." if len(value) > 20 else "")
            raise self._malformed(key, f"{shown}, where an integer up to {high} belongs")
        return int(text)

    def key(self, name: str, round_: int | None = None) -> str:
        """The store key ``name`` of the job, or of its round ``round_`` (as ``rounds.Rounds``)."""
        base = news_prefix(self._run_id) if name in NEWS else self._prefix
        return f"{base}{name}" if round_ is None else f"{base}r{round_}/{name}"

    def _get(self, name: str, round_: int | None = None) -> bytes | None:
        key = self.key(name, round_)
        return self._checked(key, self._store.get(key).value)

    def _members(self, round_: int) -> int | bytes | None:
        """The member count of round ``round_``: None while it forms, CLOSED past the end."""
        final = self._get("final", round_)
        if final is None or final == CLOSED:
            return final
        key = self.key("final", round_)
        try:
            count = json.loads(final)["count"]
        except _SHAPE_ERRORS:
            raise self._malformed(key, "not a final record with a member count") from None
        if isinstance(count, bool) or not isinstance(count, int) or not 0 < count <= MAX_MEMBERS:
            shown = repr(count)[:30]
            raise self._malformed(key, f"a member count of {shown} (1 to {MAX_MEMBERS})")
        return count

    def _change(self, round_: int) -> MembershipChange | None:
        """The change that ended round ``round_``, if one did."""
        changed = self._get("changed", round_)
        if changed is None:
            return None
        try:
            return decode_change(changed)[0]
        except _SHAPE_ERRORS as exc:
            raise self._malformed(self.key("changed", round_), str(exc)) from None

    def _closing_failure(self, record: bytes | None) -> MembershipChange | None:
        """The failure the job's ``closed`` record holds, if any."""
        try:
            return closing_failure(record)
        except _SHAPE_ERRORS as exc:
            raise self._malformed(self.key("closed"), str(exc)) from None

    def read(self) -> Snapshot:
        """The job now; ``JobNotFound`` when the store holds nothing of it; ``MalformedJob``
        when a key holds what no agent writes."""
        self._read = 0
        restarts = self._integer(self.key("restarts"), self._get("restarts"))
        closed_record = self._get("closed")
        round_ = self._integer(self.key("round"), self._get("round"), _MAX_INT - LOOK_AHEAD)
        round_, members = self._latest_round(round_)
        round_, members, phase, why = self._phase(round_, members, closed_record, restarts)
        assert not isinstance(members, bytes)
        notes_round, notes, phase = self._round_notes(round_, members is not None, phase)
        nodes = [
            self._decode(core.NodeStatus.decode, notes_round, name, raw)
            for name, raw in notes.items()
            if name != "job"
        ]
        view = (
            self._decode(core.JobView.decode, notes_round, "job", notes["job"])
            if "job" in notes
            else None
        )
        return Snapshot(
            self._run_id,
            round_,
            phase,
            members,
            notes_round,
            restarts,
            self._clock.time(),
            sorted(nodes, key=lambda node: node.group_rank),
            view,
            why,
            self._standing(round_, notes_round, phase, members or 0),
        )

    def _standing(
        self, round_: int, notes_round: int | None, phase: str, members: int
    ) -> core.Standing:
        """What round ``notes_round`` (whose posts are shown) says of them: over once it re-forms
        or a newer round formed, the member its change removed, and when it formed."""
        if notes_round is None:
            notes_round = round_
        change = self._change(notes_round)
        lost = change.member if change is not None and change.kind.removes_member else None
        over = notes_round != round_ or phase in ("re-forming", "finished")
        every = stragglers.interval(members, stragglers.INTERVAL)
        return core.Standing(over, lost, self._formed_at(notes_round), every)

    def _formed_at(self, round_: int) -> float | None:
        """When round ``round_`` formed (its final record's ``at``; None: not said)."""
        final = self._get("final", round_)
        if final is None or final == CLOSED:
            return None
        try:
            at = json.loads(final).get("at")
        except _SHAPE_ERRORS:
            return None  # ``_members`` said what is wrong with it
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at):
            return None
        return float(at)

    def _wanted(self, round_: int, joined: int) -> str:
        """How many of how many joined round ``round_``, which forms."""
        raw = self._get("size", round_)
        if raw is None:
            return f"{joined} node(s) joined"
        try:
            low, high = decode_size(raw)
        except ValueError as exc:
            raise self._malformed(self.key("size", round_), str(exc)) from None
        return joined_words(joined, low, high)

    def _latest_round(self, round_: int) -> tuple[int, int | bytes | None]:
        """The latest round from ``round_`` on with a final record, and its members: the lead
        writes the final record, then ``round``."""
        members = self._members(round_)
        for _ in range(LOOK_AHEAD):
            ahead = self._members(round_ + 1)
            if ahead is None:
                break
            round_, members = round_ + 1, ahead
            if ahead == CLOSED:
                break
        return round_, members

    def _phase(
        self, round_: int, members: int | bytes | None, closed_record: bytes | None, restarts: int
    ) -> tuple[int, int | bytes | None, str, str]:
        """The round to show, its members, the job's phase and why; ``JobNotFound`` when the
        store holds nothing of the job."""
        why = ""
        if closed_record is not None or members == CLOSED:
            phase = "finished"
            if members == CLOSED and round_ > 0:  # the round after the last: show the last
                round_ -= 1
                members = self._members(round_)
            members = None if members == CLOSED else members
            change = self._change(round_)
            if change is None or change.kind is not ChangeKind.FAILED:
                change = self._closing_failure(closed_record)  # on etcd, the one record left
            if change is not None:
                why = change.reason + ("" if change.requeue else "; do not requeue it")
        elif members is None:
            joined = self._joined(round_)
            if round_ == 0 and joined == 0 and restarts == 0:
                raise JobNotFound(f"no job {self._run_id!r} in the store")
            phase = "re-forming" if round_ > 0 else "forming"
            why = self._wanted(round_, joined)
        else:
            change = self._change(round_)
            phase = "running"
            if change is not None:
                phase, why = "re-forming", change.reason or change.kind.value
                joined = self._joined(round_ + 1)
                if joined:
                    why += f"; round {round_ + 1}: {self._wanted(round_ + 1, joined)}"
        return round_, members, phase, why

    def _round_notes(
        self, round_: int, placed: bool, phase: str
    ) -> tuple[int | None, Mapping[str, bytes], str]:
        """The round whose notes to show (None: none), its notes, and the phase: a round whose
        nodes posted nothing yet shows the round before's, and is still starting."""
        notes_round: int | None = round_
        notes = self._notes(round_) if placed else {}
        if not any(name.startswith("status/") for name in notes) and round_ > 0:
            notes_round = round_ - 1
            notes = self._notes(notes_round)
            if phase == "running":
                phase = "starting"
        if not notes:
            notes_round = None
        return notes_round, notes, phase

    def _decode(
        self, decode: Callable[[bytes], _Note], round_: int | None, name: str, raw: bytes
    ) -> _Note:
        """A note decoded (``core.output.status``), or ``MalformedJob`` naming its key."""
        try:
            return decode(raw)
        except _SHAPE_ERRORS as exc:
            raise self._malformed(self.key(f"notes/{name}", round_), str(exc)) from None

    def _joined(self, round_: int) -> int:
        """How many nodes joined round ``round_`` (a counter)."""
        key = self.key("joins", round_)
        value = self._get("joins", round_)
        total = self._integer(key, value, 10**JOIN_TOTAL_DIGITS, JOIN_TOTAL_DIGITS)
        return unpack_join(total).ticket

    def _notes(self, round_: int) -> Mapping[str, bytes]:
        """The notes ``status/*`` and ``job`` of round ``round_``, by name: one read each."""
        members = self._members(round_)
        count = members if isinstance(members, int) else 0
        names = ["job", *(f"status/{rank}" for rank in range(count))]
        return _notes_of([(name, self._get(f"notes/{name}", round_)) for name in names])


class EtcdJobReader(JobReader):
    """Reads job ``run_id`` from etcd: joins are keys, counted, and a round's notes come in one
    range read."""

    def __init__(self, store: PrefixReadable, run_id: str, clock: Clock = SYSTEM_CLOCK) -> None:
        super().__init__(store, run_id, clock)
        self._etcd = store

    def _joined(self, round_: int) -> int:
        return self._etcd.count_prefix(self.key("join/", round_))[0]

    def _notes(self, round_: int) -> Mapping[str, bytes]:
        """One range read, of at most as many notes as a round can have."""
        prefix = self.key("notes/", round_)
        found, _ = self._etcd.read_prefix(prefix, limit=MAX_MEMBERS + 1)
        if len(found) > MAX_MEMBERS:
            raise self._malformed(prefix, f"more than {MAX_MEMBERS} notes")
        return _notes_of(
            [(key[len(prefix) :], self._checked(key, kv.value)) for key, kv in found.items()]
        )


def _notes_of(pairs: list[tuple[str, bytes | None]]) -> dict[str, bytes]:
    """The notes a snapshot shows (``status/*`` and ``job``) of ``pairs`` read, by name."""
    return {
        name: value
        for name, value in pairs
        if value is not None and (name == "job" or name.startswith("status/"))
    }
