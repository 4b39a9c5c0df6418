"""How long a section (or the gap between heartbeats) may last when no timeout was given.

A worker learns it from what it has seen: after ``LEARN_AFTER`` completed observations of a
section name, the bound is ``LEARN_FACTOR`` times the longest one seen so far, and never less
than ``LEARN_FLOOR`` seconds. The longest observation keeps rising with the run, so a slow but
healthy step widens the bound rather than tripping it; a fivefold margin over the worst step
seen is what a hang detector needs to stay quiet through garbage collection, a slow batch or a
stalled file system, and still catch a collective that waits forever within a few steps' time.

Imported by the worker side (``relaunch.worker``, which keeps a ``Learner`` per section name):
plain functions, numbers and one small class (json only when a table of learned bounds is read
or written).

The job keeps what its workers learned (``Learned``): the agent collects each worker's table,
merges it into the job's in the store, and hands it to the workers it starts next
(``BOUNDS_ENV``), so that a restarted or replacement worker is protected from its first step.
"""

from __future__ import annotations

from relaunch.core.channel import BOUND_GIVEN, BOUND_LEARNED, BOUND_NONE

#: Completed observations of a section before its bound is learned.
LEARN_AFTER = 5
#: The learned bound over the longest observation.
LEARN_FACTOR = 5.0
#: The least learned bound, in seconds.
LEARN_FLOOR = 5.0


def learned_bound(observations: int, longest: float) -> float | None:
    """The bound on the next run of a section seen ``observations`` times, the longest lasting
    ``longest`` seconds; None while too few were seen."""
    if observations < LEARN_AFTER:
        return None
    return max(LEARN_FLOOR, LEARN_FACTOR * longest)


class Learner:
    """Durations seen of one section name (or of the gaps between heartbeats)."""

    __slots__ = ("count", "longest")

    def __init__(self) -> None:
        self.count = 0
        self.longest = 0.0

    def widen(self, count: int, longest: float) -> None:
        """Take in what was seen elsewhere: at least ``count`` runs, the longest ``longest``."""
        self.count = max(self.count, count)
        self.longest = max(self.longest, longest)

    def observe(self, seconds: float) -> bool:
        """Count ``seconds``; whether that changed what the job keeps: the bound was just
        learned, or its longest observation grew."""
        self.count += 1
        grew = seconds > self.longest
        if grew:
            self.longest = seconds
        return self.count == LEARN_AFTER or (grew and self.count > LEARN_AFTER)

    def bound(self, given: float | None) -> tuple[float, int]:
        """``(seconds, BOUND_*)`` (``core.channel``): the timeout given, else the learned one,
        else none (0)."""
        if given is not None:
            return given, BOUND_GIVEN
        learned = learned_bound(self.count, self.longest)
        return (0.0, BOUND_NONE) if learned is None else (learned, BOUND_LEARNED)


# -- what the job keeps of the learning, across restarts and nodes ------------------------------

#: The environment variable that hands a worker the bounds learned before its start.
BOUNDS_ENV = "RELAUNCH_BOUNDS"
#: Limits on a table read from the store or a file: what comes from outside stays small.
MAX_NAMES = 256
MAX_NAME = 128
MAX_LONGEST = 7 * 24 * 3600.0

#: ``(observations, longest seconds)`` of one section name, or of the gaps between heartbeats.
Seen = tuple[int, float]


class Learned(tuple[dict[str, Seen], "Seen | None"]):
    """What workers learned: per section name, and of the gaps between heartbeats (``beats``;
    None: nothing learned). Only learned entries (``LEARN_AFTER`` observations or more) are
    kept: fewer teach no bound."""

    __slots__ = ()

    def __new__(cls, sections: dict[str, Seen] | None = None, beats: Seen | None = None) -> Learned:
        return super().__new__(cls, (dict(sections or {}), beats))

    @property
    def sections(self) -> dict[str, Seen]:
        return self[0]

    @property
    def beats(self) -> Seen | None:
        return self[1]

    def __bool__(self) -> bool:
        return bool(self.sections) or self.beats is not None


def merge(one: Learned, other: Learned) -> Learned:
    """Both tables in one: for each name, the most observations and the longest duration."""
    sections = dict(one.sections)
    for name, seen in other.sections.items():
        sections[name] = _wider(sections.get(name), seen)
    beats = other.beats if one.beats is None else _wider(other.beats, one.beats)
    return Learned(sections, beats)


def _wider(seen: Seen | None, other: Seen) -> Seen:
    if seen is None:
        return other
    return max(seen[0], other[0]), max(seen[1], other[1])


def encode_learned(learned: Learned) -> str:
    """``learned`` as JSON (the store's record, a worker's file, ``BOUNDS_ENV``)."""
    import json

    # What ``decode_learned`` takes: names it would refuse are left out, not the whole table.
    kept = [(name, seen) for name, seen in learned.sections.items() if len(name) <= MAX_NAME]
    record: dict[str, object] = {"sections": {k: list(v) for k, v in kept[:MAX_NAMES]}}
    if learned.beats is not None:
        record["beats"] = list(learned.beats)
    return json.dumps(record, separators=(",", ":"))


def decode_learned(text: str | bytes) -> Learned:
    """The table ``encode_learned`` wrote; ValueError saying what is wrong with one it did not
    (an entry not yet learned is dropped)."""
    import json

    try:
        record = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(record, dict) or not isinstance(record.get("sections", {}), dict):
        raise ValueError("not a table of learned bounds")
    named = record.get("sections", {})
    if len(named) > MAX_NAMES:
        raise ValueError(f"more than {MAX_NAMES} sections")
    sections = {}
    for name, seen in named.items():
        if len(name) > MAX_NAME:
            raise ValueError(f"a section name longer than {MAX_NAME} characters")
        checked = _seen(seen)
        if checked[0] >= LEARN_AFTER:
            sections[name] = checked
    beats = None if record.get("beats") is None else _seen(record["beats"])
    return Learned(sections, beats if beats is not None and beats[0] >= LEARN_AFTER else None)


def _seen(value: object) -> Seen:
    if not (isinstance(value, list) and len(value) == 2):
        raise ValueError(f"{value!r:.40} is not [observations, longest]")
    count, longest = value
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count < 1 << 62:
        raise ValueError(f"{count!r:.40} is not a number of observations")
    if isinstance(longest, bool) or not isinstance(longest, (int, float)):
        raise ValueError(f"{longest!r:.40} is not a duration")
    if not 0 <= longest <= MAX_LONGEST:  # also refuses nan
        raise ValueError(f"{longest!r:.40} is not a duration")
    return count, float(longest)
