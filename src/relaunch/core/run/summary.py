"""The few lines printed at the end of every run: how each rank ended, restarts, where logs are."""

from __future__ import annotations

from relaunch.core.run.failures import describe_exit
from relaunch.core.value import Value


class RankEnd(Value):
    """How one worker of the last attempt ended."""

    __slots__ = ("duration", "exitcode", "local_rank", "note", "rank")

    rank: int  # -1: it was given no rank, so it never started (the rendezvous did not complete)
    local_rank: int
    exitcode: int | None  # None: it never ran to an end (the run stopped before)
    duration: float
    #: "" when it ended on its own; "stopped" when relaunch stopped it because of another.
    note: str

    def __init__(
        self, rank: int, local_rank: int, exitcode: int | None, duration: float, note: str = ""
    ) -> None:
        self._set(rank=rank, local_rank=local_rank, exitcode=exitcode, duration=duration)
        self._set(note=note)


class RunSummary(Value):
    """What ``format_summary`` prints (``launch_agent``'s ``on_summary`` gets it)."""

    __slots__ = (
        "elapsed",
        "evictions",
        "goodput",
        "hang",
        "log_dir",
        "outcome",
        "ranks",
        "restarts",
        "stop",
        "stragglers",
    )

    outcome: str  # "succeeded", "failed", "stopped by SIGTERM", ...
    elapsed: float
    ranks: list[RankEnd]
    restarts: list[str]
    log_dir: str
    #: For a run stopped by a signal: what became of the stop request.
    stop: str
    #: The ranks flagged as stragglers during the run, one line each.
    stragglers: list[str]
    #: The goodput ledger's line: the time lost to restarts, by cause (``core.run.goodput``).
    goodput: str
    #: The last hang's verdict: who the other ranks waited for (``core.run.culprit``), or "".
    hang: str
    #: The nodes evicted as stragglers to a spare, one line each: re-forms that spent no restart.
    evictions: list[str]

    def __init__(
        self,
        outcome: str,
        elapsed: float,
        ranks: list[RankEnd] | None = None,
        restarts: list[str] | None = None,
        log_dir: str = "",
        stop: str = "",
        stragglers: list[str] | None = None,
        goodput: str = "",
        hang: str = "",
        evictions: list[str] | None = None,
    ) -> None:
        self._set(outcome=outcome, elapsed=elapsed, log_dir=log_dir, stop=stop, goodput=goodput)
        self._set(hang=hang)
        self._set(ranks=[] if ranks is None else ranks)
        self._set(restarts=[] if restarts is None else restarts)
        self._set(stragglers=[] if stragglers is None else stragglers)
        self._set(evictions=[] if evictions is None else evictions)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _never_started(end: RankEnd) -> bool:
    """Ranks come from the rendezvous, before any worker starts: one without never started."""
    return end.exitcode is None and end.rank < 0


def _restart(reason: str) -> str:
    """``reason`` without its why when that is a heading (``...: last lines of stderr (...):``)
    with nothing under it: a one-line reason has no room for the lines it announces."""
    head, sep, why = reason.partition(": ")
    return head if sep and why.endswith(":") else reason


def format_summary(summary: RunSummary) -> str:
    """The summary as lines, the first one naming the outcome."""
    restarts = len(summary.restarts)
    head = f"run summary: {summary.outcome} in {_duration(summary.elapsed)}"
    after = [f"{restarts} restart{'s' if restarts != 1 else ''}"] if restarts else []
    if summary.evictions:
        evictions = len(summary.evictions)
        after.append(f"{evictions} eviction{'s' if evictions != 1 else ''}")
    if after:
        head += f" after {' and '.join(after)}"
    lines = [head]
    if summary.stop:
        lines.append(f"  {summary.stop}")
    never = sorted(end.local_rank for end in summary.ranks if _never_started(end))
    if never:
        which = "local rank" if len(never) == 1 else "local ranks"
        count = f"{len(never)} worker{'s' if len(never) != 1 else ''}"
        lines.append(f"  {count} never started ({which} {', '.join(map(str, never))})")
    for end in sorted(summary.ranks, key=lambda e: e.rank):
        if _never_started(end):
            continue
        how = "did not end" if end.exitcode is None else describe_exit(end.exitcode)
        note = f" ({end.note})" if end.note else ""
        lines.append(
            f"  rank {end.rank} (local {end.local_rank}): {how}{note} after "
            f"{_duration(end.duration)}"
        )
    for number, reason in enumerate(summary.restarts, 1):
        lines.append(f"  restart {number}: {_restart(reason)}")
    for number, reason in enumerate(summary.evictions, 1):
        lines.append(f"  eviction {number}: {reason} (no restart spent)")
    lines.extend(f"  straggler: {line}" for line in summary.stragglers)
    if summary.hang:
        lines.append(f"  hang: {summary.hang}")
    if summary.goodput:
        lines.append(f"  {summary.goodput}")
    if summary.log_dir:
        lines.append(f"  logs: {summary.log_dir}")
    return "\n".join(lines)
