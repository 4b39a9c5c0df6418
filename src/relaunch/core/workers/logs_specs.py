"""torch's logging API as values: ``LogsSpecs`` (where a group's logs go, decided per attempt by
``reify``), and the one conversion between the ``LogsDest`` it decides
(``core.workers.logs_dest``) and the per-rank plan (``core.workers.rank_io.RankIO``) that the
process layer runs.

A ``LogsDest`` is torch's shape (per-rank maps of paths); relaunch's processes read a
``RankIO`` per rank. ``DefaultLogsSpecs`` (``procs.logs_specs``, which makes directories)
makes its ``LogsDest`` from ``plan_rank_io``'s plan (``logs_dest_of``); any ``LogsDest``, a
user's own ``LogsSpecs`` subclass's included (or torch's, by duck typing), becomes the plan
through ``rank_io_of``.
"""

from __future__ import annotations

import posixpath
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from relaunch.core.workers.rank_io import DEVNULL, RankIO, default_prefix
from relaunch.core.workers.streams import Std, per_rank

if TYPE_CHECKING:
    from relaunch.core.workers.logs_dest import LogsDest


class LogsSpecs(ABC):
    """Where the logs of each worker go (torch's ``LogsSpecs``): ``reify(envs)`` decides it
    for one attempt, given the workers' environments (``TORCHELASTIC_RUN_ID``,
    ``TORCHELASTIC_RESTART_COUNT``, ...), and may add to them.

    ``log_dir``, ``redirects``, ``tee`` and ``local_ranks_filter`` are kept as torch keeps them
    (``self._root_log_dir``, ``self._redirects``, ``self._tee``, ``self._local_ranks_filter``),
    so a subclass written for torch reads them where it expects them.
    """

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | dict[int, Std] = Std.NONE,
        tee: Std | dict[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
    ) -> None:
        self._root_log_dir = log_dir
        self._redirects = redirects
        self._tee = tee
        self._local_ranks_filter = local_ranks_filter

    @abstractmethod
    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """The log paths of each local rank of ``envs`` (one environment per local rank)."""

    @property
    @abstractmethod
    def root_log_dir(self) -> str:
        """The directory under which the logs go."""


def is_logs_specs(value: object) -> bool:
    """Whether ``value`` is a ``LogsSpecs``: relaunch's, or any object with torch's ``reify``
    (torch's own ``LogsSpecs`` subclasses, which relaunch takes without importing torch)."""
    return isinstance(value, LogsSpecs) or callable(getattr(type(value), "reify", None))


def rank_io_of(
    dest: Any,
    name: str,
    nprocs: int,
    prefixes: Mapping[int, str] | None = None,
    relay: Std | Mapping[int, Std] = Std.NONE,
) -> dict[int, RankIO]:
    """The plan of ``nprocs`` local ranks whose logs go where ``dest`` (a ``LogsDest``, or
    torch's) says; ``prefixes`` and ``relay`` as ``plan_rank_io`` takes them.

    A tee is the logged stream shown on the console, so a tee's path must be its stream's log
    (torch tails that file): a tee of ``os.devnull`` shows nothing. An error file of
    ``os.devnull`` is none. RuntimeError (torch's) when ``stdouts`` or ``stderrs`` misses a
    rank; ValueError, in one line, for a tee of another file.
    """
    for label in ("stdouts", "stderrs"):
        given = getattr(dest, label)
        missing = sorted(set(range(nprocs)) - set(given))
        if missing:
            raise RuntimeError(
                f"the LogsDest's {label} has no path for local ranks {missing}: give one per "
                f"local rank 0..{nprocs - 1} ('' for the console)"
            )
    relay_by_rank = per_rank(relay, nprocs)
    chosen = prefixes or {}
    plan: dict[int, RankIO] = {}
    for rank in range(nprocs):
        paths = (dest.stdouts[rank] or "", dest.stderrs[rank] or "")
        tee = Std.NONE
        for std, path, tees, label in (
            (Std.OUT, paths[0], dest.tee_stdouts, "stdout"),
            (Std.ERR, paths[1], dest.tee_stderrs, "stderr"),
        ):
            teed = tees.get(rank) or ""
            if not teed or teed == DEVNULL:
                continue
            if teed != path:
                raise ValueError(
                    f"the LogsDest tees local rank {rank}'s {label} from {teed!r} but logs it "
                    f"to {path!r}: relaunch shows the log it writes, so make them the same path"
                )
            tee |= std
        logged = (Std.OUT if paths[0] else Std.NONE) | (Std.ERR if paths[1] else Std.NONE)
        error_file = dest.error_files.get(rank) or ""
        error_file = "" if error_file == DEVNULL else error_file
        plan[rank] = RankIO(
            local_rank=rank,
            log_dir=posixpath.dirname(error_file),
            stdout=paths[0],
            stderr=paths[1],
            tee=tee,
            error_file=error_file,
            prefix=chosen.get(rank, default_prefix(name, rank)),
            relay=Std(relay_by_rank[rank] & ~logged),
        )
    return plan


def console_ranks_of(local_ranks_filter: Collection[int] | None) -> frozenset[int] | None:
    """torch's ``local_ranks_filter`` as the ranks shown on the console (None or empty: all)."""
    return frozenset(local_ranks_filter) if local_ranks_filter else None
