"""The saves an agent's workers commit (``relaunch.save_state``), counted by local rank as the
channel tells them (``Channel.saves_to``), and the waits for them when a failure is pending
(the just-in-time saves)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping

#: How often a wait for just-in-time saves looks whether the workers it waits for still run.
EXIT_CHECK = 0.05


class SaveCounts:
    """Saves committed so far in this run, by local rank, and the ranks whose next save is
    awaited."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._saves: dict[int, int] = {}  # local rank -> saves committed, in this run
        self._expected: dict[int, int] = {}  # local rank -> saves it had when told to save
        self._on_expected: Callable[[], None] | None = None

    def add(self, new: Mapping[int, int]) -> int:
        """Count ``new`` saves (by local rank); the total so far."""
        with self._changed:
            for rank, count in new.items():
                self._saves[rank] = self._saves.get(rank, 0) + count
            self._settle_expected()
            self._changed.notify_all()
            return sum(self._saves.values())

    def saves(self) -> dict[int, int]:
        """Saves committed so far, by local rank."""
        with self._changed:
            return dict(self._saves)

    def expect_saves(self, ranks: Collection[int], then: Callable[[], None]) -> None:
        """Call ``then()`` (from the saves' thread) once each local rank of ``ranks`` has
        saved from now on, or is counted out (``not_expected``)."""
        with self._changed:
            self._expected = {rank: self._saves.get(rank, 0) for rank in ranks}
            self._on_expected = then
            self._settle_expected()

    def not_expected(self, rank: int) -> None:
        """Local rank ``rank`` will not save (it ended)."""
        with self._changed:
            self._expected.pop(rank, None)
            self._settle_expected()

    def _settle_expected(self) -> None:
        """Drop the ranks that saved; ``then()`` once none is left (the lock held)."""
        for rank, before in list(self._expected.items()):
            if self._saves.get(rank, 0) > before:
                del self._expected[rank]
        if not self._expected and self._on_expected is not None:
            then, self._on_expected = self._on_expected, None
            then()

    def wait_for_saves(
        self,
        ranks: Collection[int],
        running: Callable[[], Collection[int]],
        timeout: float,
        tell: Callable[[], None],
    ) -> set[int]:
        """``tell()`` the local ranks ``ranks`` to save (once their saves are expected: none
        is missed), then wait up to ``timeout`` seconds until each has saved or ended
        (``running()``, asked every ``EXIT_CHECK`` seconds: a worker's end has no event here);
        the ranks that did neither."""
        saved = threading.Event()
        self.expect_saves(ranks, saved.set)
        tell()
        deadline = time.monotonic() + timeout
        while not saved.wait(min(EXIT_CHECK, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                break
            alive = set(running())
            for rank in set(ranks) - alive:
                self.not_expected(rank)
        with self._changed:
            missing, self._expected, self._on_expected = set(self._expected), {}, None
        return missing
