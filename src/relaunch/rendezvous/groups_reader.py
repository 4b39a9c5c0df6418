"""``relaunch status`` of a job of replica groups (``--replica-groups``): each group is a job of
its own (run id ``RUN_ID-group{g}``), read by ``reader.JobReader`` over one store, all within
one job's bounds."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from relaunch.core.run.replica_groups import MAX_GROUPS
from relaunch.rendezvous import reader as job
from relaunch.rendezvous.reader import JobNotFound, JobReader, MalformedJob, Snapshot


@dataclass(frozen=True)
class GroupsSnapshot:
    """A job of replica groups (``--replica-groups``) as read: each group's own snapshot, in
    group order. ``phase`` is ``finished`` once every group finished."""

    run_id: str
    groups: list[Snapshot]

    @property
    def phase(self) -> str:
        return "finished" if all(g.phase == "finished" for g in self.groups) else "running"

    def table(self, now: float | None = None) -> str:
        """Each group's table under a line naming it."""
        return "\n\n".join(
            f"replica group {number} of {len(self.groups)}:\n{group.table(now)}"
            for number, group in enumerate(self.groups)
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "phase": self.phase,
            "replica_groups": [group.as_json() for group in self.groups],
        }


class GroupsReader:
    """Reads the replica groups of job ``run_id`` (run ids ``RUN_ID-group0``, ``-group1``, ...,
    as far as ``find`` found them) over one store."""

    def __init__(self, readers: list[JobReader], run_id: str) -> None:
        self._readers, self._run_id = readers, run_id

    @classmethod
    def find(cls, reader: JobReader, run_id: str) -> tuple[GroupsReader, GroupsSnapshot] | None:
        """The reader of ``run_id``'s replica groups (those found from group 0 on, up to the
        first not found, over ``reader``'s store) and what it read; None when it has none."""
        from relaunch.core.run.replica_groups import group_run_id

        readers = (reader.of(group_run_id(run_id, g)) for g in range(MAX_GROUPS))
        found = cls([], run_id)
        snapshot = found._read(readers, stop_at_missing=True)
        return (found, snapshot) if snapshot.groups else None

    def read(self) -> GroupsSnapshot:
        """Every group, read one after the other."""
        return self._read(self._readers, stop_at_missing=False)

    def _read(self, readers: Iterable[JobReader], stop_at_missing: bool) -> GroupsSnapshot:
        """The groups ``readers`` read, within one read's bounds in all (``reader.MAX_READ``: what
        one job may hold, whatever the number of groups); the readers that found theirs are kept."""
        groups: list[Snapshot] = []
        kept: list[JobReader] = []
        taken = 0
        for reader in readers:
            try:
                groups.append(reader.read())
            except JobNotFound:
                if stop_at_missing:
                    break
                raise
            kept.append(reader)
            taken += reader.taken
            if taken > job.MAX_READ:
                raise MalformedJob(f"the job's groups hold more than {job.MAX_READ} bytes in all")
        self._readers = kept
        return GroupsSnapshot(self._run_id, groups)
