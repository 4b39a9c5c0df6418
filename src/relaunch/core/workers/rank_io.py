"""Where each worker's output goes, planned once per group: a value per local rank.

``start_processes`` turns its ``log_dir``, ``redirects``, ``tee`` and console prefixes into one
``RankIO`` per local rank; the context that runs the group, and its result, read them from there.
"""

from __future__ import annotations

import posixpath
from collections.abc import Collection, Mapping

from relaunch.core.value import Value
from relaunch.core.workers.streams import Std, per_rank

STDOUT_LOG = "stdout.log"
STDERR_LOG = "stderr.log"
ERROR_FILE = "error.json"
#: Where a dropped stream goes (``os.devnull``; core does not import ``os``).
DEVNULL = "/dev/null"
#: The files torch's duplicate filters write, in an attempt's directory.
FILTERED_STDOUT_LOG = "filtered_stdout.log"
FILTERED_STDERR_LOG = "filtered_stderr.log"


class RankIO(Value):
    """The I/O of one local rank.

    ``stdout``/``stderr`` are log file paths, "" where the stream is not logged (the worker
    writes to the launcher's console) and ``DEVNULL`` where it is dropped;
    ``tee`` names the logged streams that are also echoed to the console, each line prefixed
    ``prefix`` (bar refreshes collapsed there); ``relay`` the logged streams, not tee'd, that
    relaunch copies to the console byte for byte (hang detection reads them) rather than letting
    the worker inherit it. Every logged stream goes through relaunch, which writes the log file
    (a full disk then never fails the worker, and its stderr tail is kept in memory).
    ``error_file`` is where the worker reports its failure; all its files live in ``log_dir``.
    """

    __slots__ = (
        "error_file",
        "local_rank",
        "log_dir",
        "prefix",
        "relay",
        "stderr",
        "stdout",
        "tee",
    )

    local_rank: int
    log_dir: str
    stdout: str
    stderr: str
    tee: Std
    error_file: str
    prefix: str
    relay: Std

    def __init__(
        self,
        local_rank: int,
        log_dir: str,
        stdout: str,
        stderr: str,
        tee: Std,
        error_file: str,
        prefix: str,
        relay: Std = Std.NONE,
    ) -> None:
        self._set(
            local_rank=local_rank,
            log_dir=log_dir,
            stdout=stdout,
            stderr=stderr,
            tee=tee,
            error_file=error_file,
            prefix=prefix,
            relay=relay,
        )

    @property
    def tee_stdout(self) -> bool:
        return bool(self.tee & Std.OUT)

    @property
    def tee_stderr(self) -> bool:
        return bool(self.tee & Std.ERR)

    @property
    def relay_stdout(self) -> bool:
        return bool(self.relay & Std.OUT)

    @property
    def relay_stderr(self) -> bool:
        return bool(self.relay & Std.ERR)


def default_prefix(name: str, local_rank: int) -> str:
    """The console prefix of a rank's lines when none is given: ``[{name}{local_rank}]:``."""
    return f"[{name}{local_rank}]:"


def plan_rank_io(
    name: str,
    log_dir: str,
    nprocs: int,
    redirects: Std | Mapping[int, Std] = Std.NONE,
    tee: Std | Mapping[int, Std] = Std.NONE,
    prefixes: Mapping[int, str] | None = None,
    relay: Std | Mapping[int, Std] = Std.NONE,
    local_ranks_filter: Collection[int] | None = None,
) -> dict[int, RankIO]:
    """One ``RankIO`` per local rank ``0..nprocs-1``, its files in ``{log_dir}/{rank}/``.

    A stream is logged when redirected, tee'd (a tee is a redirect echoed to the console,
    prefixed) or relayed (one copied to the console unchanged). ``prefixes`` replaces the
    console prefix of some ranks. ``local_ranks_filter`` (torch's; None or empty: every rank)
    names the ranks shown on the console: the others keep their log files but show nothing,
    their tees dropped and their streams neither redirected nor tee'd sent to ``os.devnull``.
    """
    redirect_by_rank = per_rank(redirects, nprocs)
    tee_by_rank = per_rank(tee, nprocs)
    relay_by_rank = per_rank(relay, nprocs)
    chosen = prefixes or {}
    plan: dict[int, RankIO] = {}
    for rank in range(nprocs):
        rank_dir = posixpath.join(log_dir, str(rank))
        filtered = bool(local_ranks_filter) and rank not in (local_ranks_filter or ())
        logs = redirect_by_rank[rank] | tee_by_rank[rank]
        relay = Std.NONE if filtered else relay_by_rank[rank] & ~logs
        logged = logs | relay
        dropped = Std.ALL & ~logged if filtered else Std.NONE
        plan[rank] = RankIO(
            local_rank=rank,
            log_dir=rank_dir,
            stdout=_path(rank_dir, STDOUT_LOG, Std.OUT, logged, dropped),
            stderr=_path(rank_dir, STDERR_LOG, Std.ERR, logged, dropped),
            tee=Std.NONE if filtered else tee_by_rank[rank],
            error_file=posixpath.join(rank_dir, ERROR_FILE),
            prefix=chosen.get(rank, default_prefix(name, rank)),
            relay=Std(relay),
        )
    return plan


def _path(rank_dir: str, name: str, std: Std, logged: Std, dropped: Std) -> str:
    """Where stream ``std`` of a rank goes: its log file, ``DEVNULL`` or "" (the console)."""
    if logged & std:
        return posixpath.join(rank_dir, name)
    return DEVNULL if dropped & std else ""
