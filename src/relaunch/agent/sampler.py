"""The one reader of the workers' channel and processes: each tick's ``NodeSnapshot``.

Its readers run at their own cadence: the agent loop when it wakes (hang detection, the
crash-loop count, the summary), the status thread every few seconds, the console at its redraw
rate, Prometheus when it scrapes. The loop, which decides, takes a fresh snapshot (``take``) and
publishes it; the others, which show, share the published one while it is younger than
``TICK`` (``latest``), and take the next one themselves when it is older. So nothing polls
and no thread is added: an idle agent samples exactly when it did before, and readers that
come within a tick of each other show the same numbers.

The attempt's end (``PContext.wait(0)``: how each rank ended) is the loop's to read: it reads
it when the end wakes it, and hands it over (``observed``). The sampler never asks for it, so a
reader adds no look at the group; until the loop has looked, a rank whose process exited is
``exited`` (``RankSample.outcome``).
"""

from __future__ import annotations

import threading
from typing import Protocol

from relaunch.core.run.run_events import NodeSnapshot, RankSample
from relaunch.core.workers.liveness import Liveness
from relaunch.core.workers.progress import Progress
from relaunch.procs.context import PContext, RunProcsResult
from relaunch.runtime import SYSTEM_CLOCK, Clock

#: Seconds a published snapshot is shared. The console's redraw period (its fastest reader):
#: no reader is shown data older than its own period, and a console redraw, a status post and
#: a scrape that come together agree.
TICK = 0.1


class ChannelReads(Protocol):
    """What the sampler reads of the channel (``agent.channel.Channel``)."""

    slots: int

    def progress(self, rank: int) -> Progress | None: ...

    def liveness(self, rank: int) -> Liveness | None: ...

    def section_times(self, rank: int) -> dict[str, tuple[float, int]]: ...


class Sampler:
    """Reads the channel and the processes of the current attempt into one ``NodeSnapshot``
    per tick (see the module docstring); safe to call from any thread."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK, tick: float = TICK) -> None:
        self._clock = clock
        self._tick = tick
        self._lock = threading.Lock()
        self._channel: ChannelReads | None = None
        self._pcontext: PContext | None = None
        self._ended: RunProcsResult | None = None  # the attempt's result, once known
        self._last = NodeSnapshot(clock.time())
        self._taken_at: float | None = None  # ``clock.monotonic()`` when ``_last`` was taken

    def watch(self, channel: ChannelReads, pcontext: PContext) -> None:
        """A new attempt: its workers report through ``channel`` and run in ``pcontext``."""
        with self._lock:
            self._channel, self._pcontext = channel, pcontext
            self._ended, self._taken_at = None, None

    def observed(self, ended: RunProcsResult | None) -> None:
        """The loop read how the attempt stands (``PContext.wait(0)``): None while it runs."""
        if ended is not None:
            with self._lock:
                self._ended = ended

    def take(self) -> NodeSnapshot:
        """A snapshot read now, published for the readers of this tick (for decisions)."""
        with self._lock:
            return self._take()

    def latest(self) -> NodeSnapshot:
        """The snapshot of this tick: the published one while younger than ``TICK``, else one
        read now (for what is shown)."""
        with self._lock:
            taken_at = self._taken_at
            if taken_at is not None and self._clock.monotonic() - taken_at < self._tick:
                return self._last
            return self._take()

    def _take(self) -> NodeSnapshot:
        channel = self._channel
        if channel is None:
            return self._last
        pcontext, now = self._pcontext, self._clock.time()
        try:
            if pcontext is None:
                snapshot = sample(channel, now)
            else:
                snapshot = sample(channel, now, pcontext.running(), pcontext.pids(), self._ended)
        except ValueError:  # the channel was closed: the run is over, its last view stands
            return self._last
        self._last, self._taken_at = snapshot, self._clock.monotonic()
        return snapshot


def sample(
    channel: ChannelReads,
    now: float,
    running: set[int] | None = None,
    pids: dict[int, int] | None = None,
    ended: RunProcsResult | None = None,
) -> NodeSnapshot:
    """Every rank of ``channel`` at ``now``, and how its process stands: ``running`` the local
    ranks whose process has not exited (None: no process known), ``pids`` every process by
    local rank, ``ended`` the attempt's result once it ended."""
    pids = pids or {}
    ranks = {}
    for rank in range(channel.slots):
        outcome, exitcode = _process(rank, running, pids, ended)
        ranks[rank] = RankSample(
            channel.progress(rank),
            channel.liveness(rank),
            outcome,
            exitcode,
            channel.section_times(rank),
        )
    return NodeSnapshot(now, ranks)


def _process(
    rank: int, running: set[int] | None, pids: dict[int, int], ended: RunProcsResult | None
) -> tuple[str, int | None]:
    """How ``rank``'s process stands (``RankSample.outcome``) and its exit code, if known."""
    if running is None or rank in running or rank not in pids:
        return "running", None  # no process known: it has not ended either
    if ended is None:
        return "exited", None
    exitcode = ended.exitcodes.get(rank)
    if rank in ended.failures:
        return "failed", exitcode
    if rank in ended.stopped:
        return "stopped", exitcode
    return "succeeded", exitcode
