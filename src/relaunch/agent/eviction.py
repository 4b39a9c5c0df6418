"""``--evict-stragglers``: the judge (the agent of group rank 0) decides which node to evict
(``core.workers.eviction``) from each view of the job it posts, names it in that view
(``JobView.evict``) and re-forms the round without it (``JobServices.evict``): every node,
the one evicted too, sees the change at once, as a failure's. Should that fail, the node named
re-forms the round itself when it reads the view. Runs on the status thread
(``agent.status``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from relaunch.core.output.status import JobView, NodeStatus
from relaunch.core.workers import eviction
from relaunch.rendezvous.job import JobServices

log = logging.getLogger("relaunch.agent.status")


class Evictor:
    """Evicts a node flagged as a straggler for ``window`` seconds to a waiting spare."""

    def __init__(self, window: float) -> None:
        self._window = window
        self._watch = eviction.Watch()
        #: The node this round evicts, named in every view until the round re-forms (the node
        #: may read a later view than the first that named it).
        self._evicting: eviction.Evict | None = None

    def new_round(self) -> None:
        self._watch, self._evicting = self._watch.new_round(), None

    def judge(
        self, view: JobView, posts: Sequence[NodeStatus], members: int, job: JobServices
    ) -> JobView:
        """``view`` (of a round of ``members`` nodes, from their ``posts``) with the node to
        evict named in it, if one is; a node that stays for want of a spare is said once."""
        if self._evicting is not None:
            return view.replace(evict=self._evicting)
        flagged = view.slow_nodes  # ``stragglers.flagged_nodes``: by sections' time or rates
        if not flagged and not self._watch.since:
            return view  # nothing flagged, nothing to remember
        self._watch, decided = eviction.decide(
            self._watch,
            flagged,
            view.posted_at,
            self._window,
            members,
            job.min_nodes,
            job.spares() if flagged else 0,
        )
        if isinstance(decided, eviction.NoSpare):
            log.warning("%s", decided.line)
        if isinstance(decided, eviction.Evict):
            self._evicting = decided
            job.evict(decided.node_rank, decided.line)
        return view if self._evicting is None else view.replace(evict=self._evicting)

    @staticmethod
    def heed(view: JobView, group_rank: int, job: JobServices) -> None:
        """Leave the job when ``view`` evicts this node (``group_rank``) and flags it: a view
        that evicts a node it does not flag is not the judge's, and is refused."""
        evict = view.evict
        if evict is None or evict.node_rank != group_rank:
            return
        if not any(slow.node_rank == group_rank for slow in view.slow_nodes):
            log.debug("a view of the job evicts this node without flagging it: ignored")
            return
        job.evict(group_rank, evict.line)
