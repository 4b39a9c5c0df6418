"""A read-only look at one job in its rendezvous store: what ``relaunch status`` prints.

It connects as a client (it never hosts the store) and only reads, under
``relaunch/{run_id}/`` (see ``rounds``)::

    round                       the round nodes join now
    news/r{n}/final             the completed round n: its member count
    news/r{n}/changed           round n is being re-formed, and why
    r{n}/joins, r{n}/join/      who joined a round still forming (a counter; keys on etcd)
    r{n}/notes/status/{g}       each member's ``NodeStatus``, posted every few seconds
    r{n}/notes/job              group rank 0's ``JobView`` (stragglers, pace)
    restarts                    the group restarts the job used
    news/closed                 the job finished

While round n forms (or has just started and posted nothing yet) the notes of round n - 1 are
shown, and the snapshot says so. Times in the notes are the agents' clocks (``time.time()``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from relaunch.core import status as core
from relaunch.core.membership import decode_change
from relaunch.core.rendezvous import unpack_join
from relaunch.rendezvous.api import RendezvousError
from relaunch.rendezvous.rounds import CLOSED, NEWS, news_prefix
from relaunch.store.api import Versioned

if TYPE_CHECKING:
    from relaunch.store.etcd import EtcdStore

#: Rounds the ``round`` key may lag behind the newest completed one (its lead writes the final
#: record first), looked past at most.
LOOK_AHEAD = 3


class Readable(Protocol):
    """All the reader asks of a store: reads."""

    def get(self, key: str) -> Versioned:
        """The value and version of ``key`` (``Versioned(None, 0)`` when absent)."""


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
        """The table ``relaunch status`` prints (``core.status.format_table``)."""
        return core.format_table(
            self.run_id,
            self.nodes,
            self.view,
            self.restarts,
            self.read_at if now is None else now,
            self.note,
            self.members if self.notes_round in (self.round, None) else None,
        )

    def as_json(self) -> dict[str, Any]:
        """The same for scripts: ``core.status.as_json`` and the round, phase and read time."""
        members = self.members if self.notes_round in (self.round, None) else None
        data = core.as_json(self.run_id, self.nodes, self.view, self.restarts, members)
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
    """Reads job ``run_id`` from ``store``; ``keyed``: the store is etcd (joins are keys, and
    a round's notes come in one range read)."""

    def __init__(
        self,
        store: Readable,
        run_id: str,
        keyed: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._run_id = run_id
        self._keyed = keyed
        self._clock = clock
        self._prefix = f"relaunch/{run_id}/"

    def key(self, name: str, round_: int | None = None) -> str:
        """The store key ``name`` of the job, or of its round ``round_`` (as ``rounds.Rounds``)."""
        base = news_prefix(self._run_id) if name in NEWS else self._prefix
        return f"{base}{name}" if round_ is None else f"{base}r{round_}/{name}"

    def _get(self, name: str, round_: int | None = None) -> bytes | None:
        return self._store.get(self.key(name, round_)).value

    def _members(self, round_: int) -> int | bytes | None:
        """The member count of round ``round_``: None while it forms, CLOSED past the end."""
        final = self._get("final", round_)
        if final is None or final == CLOSED:
            return final
        return int(json.loads(final)["count"])

    def read(self) -> Snapshot:
        """The job now; ``JobNotFound`` when the store holds nothing of it."""
        restarts = int(self._get("restarts") or 0)
        closed = self._get("closed") is not None
        round_ = int(self._get("round") or 0)
        members = self._members(round_)
        for _ in range(LOOK_AHEAD):  # the lead writes the final record, then ``round``
            ahead = self._members(round_ + 1)
            if ahead is None:
                break
            round_, members = round_ + 1, ahead
            if ahead == CLOSED:
                break
        why = ""
        if closed or members == CLOSED:
            phase = "finished"
            if members == CLOSED and round_ > 0:  # the round after the last: show the last
                round_ -= 1
                members = self._members(round_)
                members = None if members == CLOSED else members
            else:
                members = None if members == CLOSED else members
        elif members is None:
            joined = self._joined(round_)
            if round_ == 0 and joined == 0 and restarts == 0:
                raise JobNotFound(f"no job {self._run_id!r} in the store")
            phase = "re-forming" if round_ > 0 else "forming"
            why = f"{joined} node(s) joined"
        else:
            changed = self._get("changed", round_)
            phase = "running"
            if changed is not None:
                change, _ = decode_change(changed)
                phase, why = "re-forming", change.reason or change.kind.value
        assert not isinstance(members, bytes)
        notes_round: int | None = round_
        notes = self._notes(round_) if members is not None else {}
        if not any(name.startswith("status/") for name in notes) and round_ > 0:
            notes_round = round_ - 1
            notes = self._notes(notes_round)
            if phase == "running":
                phase = "starting"
        if not notes:
            notes_round = None
        nodes = [core.NodeStatus.decode(raw) for name, raw in notes.items() if name != "job"]
        view = core.JobView.decode(notes["job"]) if "job" in notes else None
        return Snapshot(
            self._run_id,
            round_,
            phase,
            members,
            notes_round,
            restarts,
            self._clock(),
            sorted(nodes, key=lambda node: node.group_rank),
            view,
            why,
        )

    def _joined(self, round_: int) -> int:
        if self._keyed:
            return self._etcd().count_prefix(self.key("join/", round_))[0]
        value = self._get("joins", round_)
        return unpack_join(int(value))[0] if value else 0

    def _notes(self, round_: int) -> Mapping[str, bytes]:
        """The notes ``status/*`` and ``job`` of round ``round_``, by name."""
        prefix = self.key("notes/", round_)
        if self._keyed:  # one range read
            found, _ = self._etcd().read_prefix(prefix)
            pairs = [(key[len(prefix) :], kv.value) for key, kv in found.items()]
        else:
            members = self._members(round_)
            count = members if isinstance(members, int) else 0
            names = ["job", *(f"status/{rank}" for rank in range(count))]
            pairs = [(name, self._get(f"notes/{name}", round_)) for name in names]
        return {
            name: value
            for name, value in pairs
            if value is not None and (name == "job" or name.startswith("status/"))
        }

    def _etcd(self) -> EtcdStore:
        from relaunch.store.etcd import EtcdStore

        assert isinstance(self._store, EtcdStore)
        return self._store
