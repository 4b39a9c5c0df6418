"""A hang's culprit named job-wide: where this node's ranks stopped, from the stacks they wrote
(``core.run.culprit.place_of``), gathered from every node through the store, and the verdict
over all of them, the same on every node.

Each node posts its ranks' places (``encode``: a few dozen bytes a rank) as its part of the
round's note ``culprit`` and waits for the others' up to ``GATHER_TIMEOUT``; a node whose part
does not come (lost, or its store failed) is named in the verdict, which is given over the rest.
A part from another host is checked (``decode``) before it is read.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from relaunch.agent.expiry import ABORT_GRACE
from relaunch.core.run.culprit import Place, Verdict, decode, encode, place_of, verdict
from relaunch.core.run.failures import faulthandler_dump
from relaunch.rendezvous.job import JobServices

if TYPE_CHECKING:
    from relaunch.agent.hooks import Run

log = logging.getLogger(__name__)

#: The round's note each node posts its ranks' places as.
NOTE = "culprit"
#: Seconds a node waits for the others' places: a rank asked for its stack may take
#: ``ABORT_GRACE`` to write it and die, then its node reads it; a few seconds more for the store.
GATHER_TIMEOUT = ABORT_GRACE + 5.0
#: The most bytes of a rank's stderr read for its stack (the dump is at its end).
STDERR_TAIL = 256 * 1024


def local_places(stderr_files: Mapping[int, str]) -> dict[int, Place | None]:
    """Where each rank stopped, by the key of ``stderr_files`` (None: no Python stack)."""
    from relaunch.procs.process_failure import read_tail  # a hang: loaded then

    return {
        rank: place_of(faulthandler_dump(read_tail(path, STDERR_TAIL)) if path else "")
        for rank, path in stderr_files.items()
    }


def job_verdict(
    job: JobServices,
    node: int,
    nodes: int,
    places: Mapping[int, Place | None],
    timeout: float = GATHER_TIMEOUT,
) -> Verdict:
    """The verdict over every node's places: this node (group rank ``node`` of ``nodes``)
    posts ``places`` (by global rank) and waits up to ``timeout`` for the others'."""
    mine = encode(places)
    parts = job.gather(NOTE, node, nodes, mine, timeout)
    if parts is None:  # not every part came: those that did
        names = {member: f"{NOTE}/{member}" for member in range(nodes)}
        came = job.read_notes(list(names.values()))
        parts = {member: came[name] for member, name in names.items() if name in came}
        parts[node] = mine
    missing = [member for member in range(nodes) if member not in parts]
    job_places: dict[int, Place | None] = {}
    for member, data in sorted(parts.items()):
        try:
            theirs = places if member == node else decode(data)
        except ValueError as exc:
            log.warning("node %d sent its ranks' places unreadable (%s): not counted", member, exc)
            missing.append(member)
            continue
        for rank, place in theirs.items():
            job_places.setdefault(rank, place)
    return verdict(job_places, sorted(missing), timeout)


def judge_hang(run: Run, failed: Mapping[int, object], restart_count: int) -> Verdict:
    """The culprit of the hang that ended ``run``'s attempt, from where every rank of the job
    stopped (``failed``: this node's failed local ranks; one that had ended well is not hung),
    told to the report, the run's summary and a status event."""
    group, pcontext = run.group, run.pcontext
    assert pcontext is not None
    stderrs = {rank: pcontext.stderrs[rank] for rank in failed if rank in pcontext.stderrs}
    places = group.by_global_rank(local_places(stderrs))
    found = job_verdict(run.job, group.group_rank or 0, group.group_world_size or 1, places)
    run.report.hang_verdict(found, restart_count)
    return found
