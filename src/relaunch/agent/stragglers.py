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
import threading
import time
from collections.abc import Callable, Mapping

from relaunch.core import stragglers as core
from relaunch.core.progress import Progress
from relaunch.rendezvous.api import RendezvousHandler

log = logging.getLogger(__name__)

VERDICT = "stragglers"


class StragglerWatch:
    """Flags slow ranks of the job, from a thread of its own (the store may be slow to answer;
    the agent must not wait on it): on this node's console (every straggler on group rank 0's
    node, its own ranks elsewhere), and through ``on_flag`` (the status event and summary)."""

    def __init__(
        self,
        factor: float,
        on_flag: Callable[[core.Straggler], None] = lambda straggler: None,
        interval: float = core.INTERVAL,
    ) -> None:
        self._factor = factor
        self._on_flag = on_flag
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # The group watched: set by ``start``, read by its thread only.
        self._ranks: dict[int, int] = {}
        self._progress: Callable[[int], Progress | None] = lambda rank: None
        self._handler: RendezvousHandler | None = None
        self._group_rank = 0
        self._nodes = 1
        self._rates = core.RankRates()
        self._said: set[int] = set()

    def start(
        self,
        ranks: Mapping[int, int],
        progress: Callable[[int], Progress | None],
        handler: RendezvousHandler | None,
        group_rank: int,
        nodes: int,
    ) -> None:
        """Watch a new group: ``ranks`` maps its local ranks to their global ranks,
        ``progress(local_rank)`` is a rank's last report, ``handler`` shares the rates (not
        needed by a job of one node)."""
        self.stop()
        if nodes * len(ranks) < 2:
            return  # one rank: nobody to compare it with
        self._ranks, self._progress, self._handler = dict(ranks), progress, handler
        self._group_rank, self._nodes = group_rank, nodes
        self._rates, self._said = core.RankRates(), set()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(self._stop,), name="relaunch-stragglers", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(self._interval):
            try:
                self._sample()
            except Exception:  # a straggler check must never end the run
                log.debug("straggler check failed", exc_info=True)

    def _sample(self) -> None:
        """Sample the ranks' steps, share their rates, and judge (group rank 0) or read the
        verdict (the others)."""
        for local, rank in self._ranks.items():
            report = self._progress(local)
            if report is not None:
                self._rates.add(rank, report.time, report.step)
        mine = self._rates.rates(time.time())
        handler = self._handler
        if self._nodes <= 1 or handler is None:
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
            if straggler.rank in self._said:
                continue
            self._said.add(straggler.rank)
            log.warning("%s", straggler.describe(self._factor))
            self._on_flag(straggler)
        self._said &= {s.rank for s in slow}  # a rank that caught up is flagged again if it lags
