"""Workers' heartbeats and sections as the agent reads them from the channel, which are overdue,
and the time each spent in its sections (layout in ``core.channel``; the workers' side in
``relaunch.worker``)."""

from __future__ import annotations

from collections.abc import Mapping

from relaunch.core.channel import (
    BOUND_GIVEN,
    BOUND_LEARNED,
    LIVE_FIELDS,
    LIVE_OFFSET,
    NAME_END,
    NAME_OFFSET,
    SEQ,
    TIME_ENTRY,
    TIME_FIELDS,
    TIMES,
    TIMES_OFFSET,
    slot_offset,
)
from relaunch.core.durations import seconds
from relaunch.core.value import Value

_HOW = {BOUND_GIVEN: "given", BOUND_LEARNED: "learned"}


class Liveness(Value):
    """One worker's heartbeats and open section (times are ``time.time()``; 0: none)."""

    __slots__ = (
        "beat_at",
        "beat_bound",
        "beat_due",
        "beats",
        "entered",
        "section",
        "section_bound",
        "section_due",
        "sections_done",
    )

    beat_at: float
    beat_due: float
    section: str
    entered: float
    section_due: float
    sections_done: int
    beats: int
    section_bound: str  # "given", "learned" or ""
    beat_bound: str

    def __init__(
        self,
        beat_at: float,
        beat_due: float,
        section: str,
        entered: float,
        section_due: float,
        sections_done: int,
        beats: int,
        section_bound: str,
        beat_bound: str,
    ) -> None:
        self._set(
            beat_at=beat_at,
            beat_due=beat_due,
            section=section,
            entered=entered,
            section_due=section_due,
            sections_done=sections_done,
            beats=beats,
            section_bound=section_bound,
            beat_bound=beat_bound,
        )

    @property
    def used(self) -> bool:
        """Whether the worker has called ``heartbeat`` or entered a ``section``."""
        return self.beats > 0 or self.entered > 0 or self.sections_done > 0

    @property
    def last_sign(self) -> float:
        """When it last showed life through them (0: never)."""
        return max(self.beat_at, self.entered)


def read_liveness(
    buffer: bytes | bytearray | memoryview, rank: int, tries: int = 8
) -> Liveness | None:
    """The liveness block of ``rank``; None before it wrote one (or if always torn)."""
    offset = slot_offset(rank) + LIVE_OFFSET
    for _ in range(tries):
        (before,) = SEQ.unpack_from(buffer, offset)
        if before == 0:
            return None
        if before % 2:
            continue
        beat_at, beat_due, entered, due, done, beats, how, beat_how = LIVE_FIELDS.unpack_from(
            buffer, offset + 8
        )
        start = slot_offset(rank) + NAME_OFFSET
        name = bytes(buffer[start : slot_offset(rank) + NAME_END]).split(b"\0", 1)[0]
        (after,) = SEQ.unpack_from(buffer, offset)
        if after == before:
            return Liveness(
                beat_at,
                beat_due,
                name.decode("utf-8", errors="replace"),
                entered,
                due,
                done,
                beats,
                _HOW.get(how, ""),
                _HOW.get(beat_how, ""),
            )
    return None


def read_section_times(
    buffer: bytes | bytearray | memoryview, rank: int, tries: int = 8
) -> dict[str, tuple[float, int]]:
    """The seconds ``rank`` spent in each of its sections and the runs that ended, by name
    (the first ``TIMES`` names it ended; an entry torn at every try is left out)."""
    times = {}
    for entry in range(TIMES):
        at = slot_offset(rank) + TIMES_OFFSET + entry * TIME_ENTRY
        for _ in range(tries):
            (before,) = SEQ.unpack_from(buffer, at)
            if before % 2:
                continue
            spent, runs = TIME_FIELDS.unpack_from(buffer, at + 8)
            name = bytes(buffer[at + 24 : at + TIME_ENTRY]).split(b"\0", 1)[0]
            if SEQ.unpack_from(buffer, at)[0] == before:
                if before and name:
                    times[name.decode("utf-8", errors="replace")] = (spent, runs)
                break
    return times


class Overdue(Value):
    """A rank past a deadline it set itself: what it was in, since when, and its bound."""

    __slots__ = ("bound", "due", "rank", "since", "what")

    rank: int
    what: str  # "section 'step'" or "heartbeat"
    since: float  # entered the section, or the last heartbeat
    due: float
    bound: str  # "given" or "learned"

    def __init__(self, rank: int, what: str, since: float, due: float, bound: str) -> None:
        self._set(rank=rank, what=what, since=since, due=due, bound=bound)

    def describe(self, now: float) -> str:
        allowed = self.due - self.since
        if self.what == "heartbeat":
            return (
                f"no heartbeat for {now - self.since:.1f}s; the next was due within "
                f"{seconds(allowed)} ({self.bound})"
            )
        return (
            f"{self.what} overdue: entered {now - self.since:.1f}s ago, its bound is "
            f"{seconds(allowed)} ({self.bound})"
        )


def overdue(lives: Mapping[int, Liveness | None], now: float) -> list[Overdue]:
    """The ranks past a deadline at ``now``: an open section's, or the next heartbeat's."""
    late = []
    for rank, live in sorted(lives.items()):
        if live is None:
            continue
        if live.section_due and now >= live.section_due:
            what = f"section {live.section!r}"
            late.append(Overdue(rank, what, live.entered, live.section_due, live.section_bound))
        elif live.beat_due and now >= live.beat_due:
            late.append(Overdue(rank, "heartbeat", live.beat_at, live.beat_due, live.beat_bound))
    return late


def next_due(lives: Mapping[int, Liveness | None]) -> float | None:
    """The earliest deadline among ``lives`` (None: no deadline is set)."""
    dues = [
        due
        for live in lives.values()
        if live is not None
        for due in (live.section_due, live.beat_due)
        if due
    ]
    return min(dues, default=None)
