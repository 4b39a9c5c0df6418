"""How long a section (or the gap between heartbeats) may last when no timeout was given.

A worker learns it from what it has seen: after ``LEARN_AFTER`` completed observations of a
section name, the bound is ``LEARN_FACTOR`` times the longest one seen so far, and never less
than ``LEARN_FLOOR`` seconds. The longest observation keeps rising with the run, so a slow but
healthy step widens the bound rather than tripping it; a fivefold margin over the worst step
seen is what a hang detector needs to stay quiet through garbage collection, a slow batch or a
stalled file system, and still catch a collective that waits forever within a few steps' time.

Imported by the worker side (``relaunch.worker``): plain functions and numbers only.
"""

from __future__ import annotations

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
