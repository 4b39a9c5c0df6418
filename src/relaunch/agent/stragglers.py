"""Finds stragglers for the agent: samples its ranks' steps, shares their rates through the
rendezvous, and flags the ranks of the job slower than its median (``core.stragglers``).

Every ``INTERVAL`` seconds each agent posts its ranks' rates as the note ``rates/<group rank>``;
the agent of group rank 0 reads every node's, and posts the verdict as ``stragglers``, which the
others read: one write and one read per node and interval, and one read per node for rank 0's.
A job of one node needs no store: its agent judges its own ranks.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping

from relaunch.core import stragglers as core
from relaunch.core.progress import Progress
from relaunch.rendezvous.api import RendezvousHandler

log = logging.getLogger(__name__)

VERDICT = "stragglers"


class StragglerWatch:
    """Flags slow ranks of the job: on this node's console (all of them on group rank 0's,
    this node's own elsewhere), through ``on_flag``, and in ``flagged`` for the run summary."""

    def __init__(
        self,
        factor: float,
        on_flag: Callable[[core.Straggler], None] = lambda straggler: None,
        interval: float = core.INTERVAL,
    ) -> None:
        self._factor = factor
        self._on_flag = on_flag
        self._interval = interval
        self._rates = core.RankRates()
        self._ranks: dict[int, int] = {}  # local rank -> global rank
        self._group_rank = 0
        self._nodes = 1
        self._world = 0
        self._next_at: float | None = None
        self._said: set[int] = set()
        #: Every straggler flagged during the run, by global rank (the latest verdict on it).
        self.flagged: dict[int, core.Straggler] = {}

    def restart(self, ranks: Mapping[int, int], group_rank: int, nodes: int, world: int) -> None:
        """A new group started: ``ranks`` maps its local ranks to their global ranks."""
        self._rates = core.RankRates()
        self._ranks = dict(ranks)
        self._group_rank, self._nodes, self._world = group_rank, nodes, world
        self._said.clear()
        self._next_at = time.monotonic() + self._interval if world > 1 else None

    def stop(self) -> None:
        self._next_at = None

    def due_in(self) -> float | None:
        """Seconds until the next sample (None: none is due, a job of one rank)."""
        return None if self._next_at is None else max(0.0, self._next_at - time.monotonic())

    def tick(self, progress: Callable[[int], Progress | None], handler: RendezvousHandler) -> None:
        """Sample, share and judge, if it is time."""
        if self._next_at is None or time.monotonic() < self._next_at:
            return
        self._next_at = time.monotonic() + self._interval
        for local, rank in self._ranks.items():
            report = progress(local)
            if report is not None:
                self._rates.add(rank, report.time, report.step)
        mine = self._rates.rates(time.time())
        if self._nodes <= 1:
            self._said_about(core.flag(mine, self._factor)[1])
            return
        handler.post_note(f"rates/{self._group_rank}", json.dumps(mine).encode())
        if self._group_rank == 0:
            names = [f"rates/{node}" for node in range(self._nodes)]
            rates = {
                int(rank): float(rate)
                for note in handler.read_notes(names).values()
                for rank, rate in json.loads(note).items()
            }
            median, slow = core.flag(rates, self._factor)
            verdict = {"median": median, "slow": {s.rank: s.rate for s in slow}}
            handler.post_note(VERDICT, json.dumps(verdict).encode())
            self._said_about(slow)
            return
        note = handler.read_notes([VERDICT]).get(VERDICT)
        if note is not None:
            verdict = json.loads(note)
            slow = [
                core.Straggler(int(rank), float(rate), float(verdict["median"]))
                for rank, rate in verdict["slow"].items()
            ]
            self._said_about([s for s in slow if s.rank in self._ranks.values()])

    def _said_about(self, slow: list[core.Straggler]) -> None:
        for straggler in slow:
            self.flagged[straggler.rank] = straggler
            if straggler.rank in self._said:
                continue
            self._said.add(straggler.rank)
            log.warning("%s", straggler.describe(self._factor))
            self._on_flag(straggler)
        self._said &= {s.rank for s in slow}  # a rank that caught up is flagged again if it lags
