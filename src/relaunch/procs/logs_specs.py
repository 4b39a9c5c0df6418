"""``DefaultLogsSpecs`` (torch's): each attempt's logs in ``{log_dir}/{run_id}_XXXX/attempt_N/``,
and the directories every run and attempt of relaunch logs to.

The paths are ``core.workers.rank_io.plan_rank_io``'s plan, the one the agent and
``start_processes`` make from a ``log_dir``, ``redirects`` and ``tee``: ``reify`` makes the
directories, gives each worker its error file and returns the plan as torch's ``LogsDest``
(``core.workers.logs_specs``).
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import TYPE_CHECKING

from relaunch.core.value import Value
from relaunch.core.workers.logs_specs import (
    LogsSpecs,
    console_ranks_of,
    is_logs_specs,
    rank_io_of,
)
from relaunch.core.workers.rank_io import plan_rank_io
from relaunch.core.workers.streams import Std
from relaunch.procs.errors import ERROR_FILE_ENV
from relaunch.runtime import lazy_attributes

if TYPE_CHECKING:
    from relaunch.core.workers.logs_dest import LogsDest

__all__ = [
    "DefaultLogsSpecs",
    "LogsDest",
    "LogsSpecs",
    "OwnPlan",
    "is_logs_specs",
    "make_log_dir",
    "new_attempt_dir",
    "own_plan",
    "rank_io_of",
]

log = logging.getLogger(__name__)

#: torch's ``LogsDest`` loads when used: a launch without ``logs_specs`` makes none.
__getattr__ = lazy_attributes(__name__, {"LogsDest": "relaunch.core.workers.logs_dest"})

#: The prefix of the temporary directory logs go to when no ``log_dir`` is given.
TEMP_PREFIX = "relaunch_"


def make_log_dir(log_dir: str | None, run_id: str) -> str:
    """A new directory for this run's logs, ``{run_id}_XXXX`` under ``log_dir`` (made if need
    be; default: a new temporary one)."""
    base = log_dir or tempfile.mkdtemp(prefix=TEMP_PREFIX)
    os.makedirs(base, exist_ok=True)
    path = tempfile.mkdtemp(prefix=f"{run_id}_", dir=base)
    log.info("log directory: %s", path)
    return path


def new_attempt_dir(log_dir: str, restart_count: int | str) -> str:
    """``attempt_{n}`` for restart ``n``; a group re-formed after a membership change (which
    uses no restart) gets ``attempt_{n}.1``, ``.2``, ...: no log is ever replaced."""
    base = os.path.join(log_dir, f"attempt_{restart_count}")
    path, reformed = base, 0
    while True:
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            reformed += 1
            path = f"{base}.{reformed}"


class DefaultLogsSpecs(LogsSpecs):
    """torch's default ``LogsSpecs``: ``log_dir`` is made if it does not exist (a new temporary
    directory when None; ``os.devnull``: no files at all, every stream on the console); each
    run gets ``{log_dir}/{run_id}_XXXX/`` and each attempt ``attempt_{restart_count}/`` in it,
    with ``{local_rank}/stdout.log``, ``stderr.log`` and ``error.json`` as ``redirects`` and
    ``tee`` say; ``local_ranks_filter`` names the ranks shown on the console.

    A second ``reify`` for the same restart count (a group re-formed without a restart) makes
    ``attempt_N.1`` rather than deleting ``attempt_N``, as the agent does: relaunch never
    deletes a log.
    """

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | dict[int, Std] = Std.NONE,
        tee: Std | dict[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
    ) -> None:
        if log_dir != os.devnull:
            if not log_dir:
                log_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX)
            elif os.path.isfile(log_dir):
                raise NotADirectoryError(
                    f"log_dir: {log_dir} is a file: name a directory (it is made if need be)"
                )
            else:
                os.makedirs(log_dir, exist_ok=True)
        super().__init__(log_dir, redirects, tee, local_ranks_filter)
        self._run_log_dir: str | None = None

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """The paths of this attempt's logs: ``TORCHELASTIC_RUN_ID`` and
        ``TORCHELASTIC_RESTART_COUNT`` of ``envs[0]`` name its directory; each worker's
        ``TORCHELASTIC_ERROR_FILE`` is set in ``envs``."""
        from relaunch.core.workers.logs_dest import devnull_dest, logs_dest_of

        nprocs = len(envs)
        first = envs[0] if nprocs else {}
        if not nprocs:
            log.warning("DefaultLogsSpecs.reify: no workers' environments, no logs")
        if self._root_log_dir == os.devnull:
            for env in envs.values():
                env[ERROR_FILE_ENV] = ""
            return devnull_dest(nprocs)
        if self._run_log_dir is None:
            self._run_log_dir = make_log_dir(
                self._root_log_dir, first.get("TORCHELASTIC_RUN_ID", "test_run_id")
            )
        attempt_dir = new_attempt_dir(
            self._run_log_dir, first.get("TORCHELASTIC_RESTART_COUNT", "0")
        )
        plan = plan_rank_io(
            "",
            attempt_dir,
            nprocs,
            self._redirects,
            self._tee,
            local_ranks_filter=self._local_ranks_filter,
        )
        for rank, io in plan.items():
            os.mkdir(io.log_dir)
            envs[rank][ERROR_FILE_ENV] = io.error_file
        return logs_dest_of(plan, attempt_dir)

    def __repr__(self) -> str:
        return (
            f"DefaultLogsSpecs(root_log_dir={self._root_log_dir}, redirects={self._redirects}, "
            f"tee={self._tee}, local_ranks_filter={self._local_ranks_filter})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DefaultLogsSpecs):
            return False
        return (
            self._root_log_dir == other._root_log_dir
            and self._redirects == other._redirects
            and self._tee == other._tee
            and self._local_ranks_filter == other._local_ranks_filter
        )

    __hash__ = None  # type: ignore[assignment]


class OwnPlan(Value):
    """A ``DefaultLogsSpecs``'s fields, from which relaunch plans each attempt itself."""

    __slots__ = ("local_ranks_filter", "redirects", "root", "tee")

    root: str
    redirects: Std | dict[int, Std]
    tee: Std | dict[int, Std]
    local_ranks_filter: frozenset[int] | None

    def __init__(
        self,
        root: str,
        redirects: Std | dict[int, Std],
        tee: Std | dict[int, Std],
        local_ranks_filter: frozenset[int] | None,
    ) -> None:
        self._set(root=root, redirects=redirects, tee=tee, local_ranks_filter=local_ranks_filter)


def own_plan(logs_specs: object) -> OwnPlan | None:
    """What relaunch plans its attempts from when ``logs_specs`` lets it: a
    ``DefaultLogsSpecs`` whose ``reify`` is its own, writing files. Its plan gives the paths
    ``reify`` gives, and the agent may add what it needs (a tee for hang detection). Else
    None: ``reify`` decides."""
    if (
        isinstance(logs_specs, DefaultLogsSpecs)
        and type(logs_specs).reify is DefaultLogsSpecs.reify
        and logs_specs._root_log_dir != os.devnull
    ):
        return OwnPlan(
            logs_specs.root_log_dir,
            logs_specs._redirects,
            logs_specs._tee,
            console_ranks_of(logs_specs._local_ranks_filter),
        )
    return None
