"""The goodput ledger: for every restart, the seconds lost by cause, and the share of the run
that went to training.

A restart costs, in order, one stretch of time after the other (so that they add up to the
whole): *detection* (the failure -> the agent knows; a hang's failure is its rank's last
progress), *teardown* (-> the last worker of the old group gone, any just-in-time save
included), *health_check* (-> the join begins: a crash loop's backoff, an exclusion, a health
check), *rendezvous* (the join), *worker_start* (-> the new workers call ``load_state``, or
report progress when they keep no state), *state_restore* (``load_state``), and then
*recomputation*: the steps reached before the failure that the restored state does not hold,
at the measured step time. The agent marks each moment (``agent.goodput``); this module adds
them up.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import pairwise

from relaunch.core.value import Value

CAUSES = (
    "detection",
    "teardown",
    "health_check",
    "rendezvous",
    "worker_start",
    "state_restore",
    "recomputation",
)


class RestartMarks:
    """The moments of one restart, as the agent saw them (``time.time()``; 0: not seen); a plain
    class, filled in as the restart goes (a dataclass costs the launcher its ``exec``)."""

    __slots__ = (
        "failed_at",
        "join_began_at",
        "join_ended_at",
        "last_step",
        "noticed_at",
        "restart",
        "step_seconds",
        "stopped_at",
    )

    def __init__(
        self,
        restart: int,
        failed_at: float = 0.0,
        noticed_at: float = 0.0,
        stopped_at: float = 0.0,
        join_began_at: float = 0.0,
        join_ended_at: float = 0.0,
        last_step: int | None = None,
        step_seconds: float = 0.0,
    ) -> None:
        self.restart = restart
        self.failed_at = failed_at
        self.noticed_at = noticed_at
        self.stopped_at = stopped_at
        self.join_began_at = join_began_at
        self.join_ended_at = join_ended_at
        #: The furthest step any rank reported before the failure, and a step's seconds then.
        self.last_step = last_step
        self.step_seconds = step_seconds


class Restored(Value):
    """How the restarted workers came back: when ``load_state`` began and ended on the last
    rank, and the step it restored (None: nothing to restore); or, for workers that keep no
    state, when they first reported progress (``began == ended``)."""

    __slots__ = ("began", "ended", "step")

    began: float
    ended: float
    step: int | None

    def __init__(self, began: float, ended: float, step: int | None) -> None:
        self._set(began=began, ended=ended, step=step)


class RestartCost(Value):
    """The seconds one restart cost, by cause (``CAUSES``), and the steps it redoes;
    ``steps_known``: the workers had reported the step they reached (``report_progress``, or
    a step given to ``save_state``), so its recomputation could be counted."""

    __slots__ = ("restart", "seconds", "steps_known", "steps_redone")

    restart: int
    seconds: Mapping[str, float]
    steps_redone: int
    steps_known: bool

    def __init__(
        self,
        restart: int,
        seconds: Mapping[str, float],
        steps_redone: int,
        steps_known: bool = True,
    ) -> None:
        self._set(restart=restart, seconds=seconds, steps_redone=steps_redone)
        self._set(steps_known=steps_known)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


def cost_of(marks: RestartMarks, restored: Restored | None, ended_at: float) -> RestartCost:
    """What ``marks`` cost once the workers came back as ``restored`` (None: they never did
    before ``ended_at``, the end of the run: the rest is worker start). A moment not seen
    takes the one before it: its stretch costs 0."""
    moments = [marks.failed_at]
    for moment in (marks.noticed_at, marks.stopped_at, marks.join_began_at, marks.join_ended_at):
        moments.append(max(moment, moments[-1]) if moment else moments[-1])
    back = ended_at if restored is None else restored.began
    done = ended_at if restored is None else restored.ended
    moments += [max(back, moments[-1]), max(done, back, moments[-1])]
    stretches = [later - earlier for earlier, later in pairwise(moments)]
    redone = 0
    if restored is not None and marks.last_step is not None:
        resumed_at = -1 if restored.step is None else restored.step
        redone = max(0, marks.last_step - resumed_at)
    seconds = dict(zip(CAUSES, [*stretches, redone * max(0.0, marks.step_seconds)], strict=True))
    return RestartCost(marks.restart, seconds, redone, marks.last_step is not None)


class Ledger:
    """Every restart's cost in a run (a plain class: it grows as the run goes)."""

    __slots__ = ("costs",)

    def __init__(self, costs: list[RestartCost] | None = None) -> None:
        self.costs: list[RestartCost] = [] if costs is None else costs

    def totals(self) -> dict[str, float]:
        return {cause: sum(cost.seconds[cause] for cost in self.costs) for cause in CAUSES}

    def lost(self) -> float:
        return sum(cost.total for cost in self.costs)

    def effective_ratio(self, elapsed: float) -> float:
        """The share of ``elapsed`` seconds that was not lost to restarts (1.0 without any)."""
        if elapsed <= 0:
            return 1.0
        return max(0.0, min(1.0, (elapsed - self.lost()) / elapsed))

    def line(self, elapsed: float) -> str | None:
        """The run summary's line (None without a restart, or where the workers reported no
        steps: there is no telling what share of the run trained)."""
        if not any(cost.steps_known for cost in self.costs):
            return None
        totals = self.totals()
        steps = sum(cost.steps_redone for cost in self.costs)
        parts = [f"{cause.replace('_', ' ')} {totals[cause]:.2f}s" for cause in CAUSES]
        parts[-1] += f" ({steps} step{'s' if steps != 1 else ''})"
        return (
            f"goodput: {100 * self.effective_ratio(elapsed):.1f}% of {elapsed:.1f}s trained; "
            f"{self.lost():.2f}s lost over {len(self.costs)} restart"
            f"{'s' if len(self.costs) != 1 else ''}: " + ", ".join(parts)
        )
