"""torch's ``LogsDest``: the paths a ``LogsSpecs`` decided for one attempt (per-rank maps),
and the two that relaunch's own ``DefaultLogsSpecs`` makes. Loaded when one is made (a
``reify``): a launch without ``logs_specs`` plans its ranks' logs as ``RankIO``s and makes none.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field

from relaunch.core.workers.rank_io import (
    DEVNULL,
    FILTERED_STDERR_LOG,
    FILTERED_STDOUT_LOG,
    RankIO,
)


@dataclass
class LogsDest:
    """For each kind of log, the file path of each local rank (torch's ``LogsDest``).

    ``stdouts``/``stderrs``: "" where the stream goes to the console, ``os.devnull`` where it is
    dropped; ``tee_stdouts``/``tee_stderrs``: the ranks whose log is also shown on the console,
    with that log's path; ``error_files``: where each rank reports its failure;
    ``filtered_stdout``/``filtered_stderr``: the files the duplicate filters write.
    """

    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    tee_stdouts: dict[int, str] = field(default_factory=dict)
    tee_stderrs: dict[int, str] = field(default_factory=dict)
    error_files: dict[int, str] = field(default_factory=dict)
    filtered_stdout: str = field(default_factory=str)
    filtered_stderr: str = field(default_factory=str)


def logs_dest_of(plan: Mapping[int, RankIO], attempt_dir: str) -> LogsDest:
    """The ``LogsDest`` of ``plan`` (``plan_rank_io``'s), an attempt whose files are under
    ``attempt_dir``: torch's layout, the filtered files beside the ranks' directories."""
    return LogsDest(
        stdouts={rank: io.stdout for rank, io in plan.items()},
        stderrs={rank: io.stderr for rank, io in plan.items()},
        tee_stdouts={rank: io.stdout for rank, io in plan.items() if io.tee_stdout},
        tee_stderrs={rank: io.stderr for rank, io in plan.items() if io.tee_stderr},
        error_files={rank: io.error_file for rank, io in plan.items()},
        filtered_stdout=posixpath.join(attempt_dir, FILTERED_STDOUT_LOG),
        filtered_stderr=posixpath.join(attempt_dir, FILTERED_STDERR_LOG),
    )


def devnull_dest(nprocs: int) -> LogsDest:
    """torch's ``LogsDest`` for ``log_dir=os.devnull``: every stream on the console (redirects
    and tees ignored), no error file."""
    ranks = range(nprocs)
    return LogsDest(
        stdouts=dict.fromkeys(ranks, ""),
        stderrs=dict.fromkeys(ranks, ""),
        tee_stdouts=dict.fromkeys(ranks, DEVNULL),
        tee_stderrs=dict.fromkeys(ranks, DEVNULL),
        error_files=dict.fromkeys(ranks, DEVNULL),
        filtered_stdout=posixpath.join(DEVNULL, FILTERED_STDOUT_LOG),
        filtered_stderr=posixpath.join(DEVNULL, FILTERED_STDERR_LOG),
    )
