"""How the agent lays out its workers' console output: what is tee'd, whether relaunch may draw
on the console, and torchrun's per-rank line prefixes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from relaunch.core.workers.streams import Std, per_rank

#: torchrun's variable for the console prefix of worker lines.
LOG_LINE_PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"


def agent_tee(
    tee: Std | Mapping[int, Std],
    redirects: Std | Mapping[int, Std],
    nprocs: int,
    hang_detection: bool,
    terminals: Std = Std.ALL,
) -> Std | Mapping[int, Std]:
    """The tee to start workers with: ``tee`` as given, or with hang detection on, every stream
    left on a terminal (``terminals``: the launcher's streams that are one) tee'd too, so that
    its output counts as a sign of life and a hung worker's stack is on file.

    A stream left on a file or a pipe is not tee'd (a tee prefixes lines and collapses bars,
    which would alter the bytes): hang detection copies it byte for byte instead (``relayed``).
    """
    if not hang_detection:
        return tee
    redirected = per_rank(redirects, nprocs)
    return {
        rank: Std(std | (terminals & ~redirected[rank]))
        for rank, std in per_rank(tee, nprocs).items()
    }


def relayed(
    redirects: Std | Mapping[int, Std],
    tee: Std | Mapping[int, Std],
    nprocs: int,
    terminals: Std,
    hang_detection: bool = False,
    shared: bool = False,
) -> dict[int, Std]:
    """The streams relaunch reads and copies to its console byte for byte, by local rank: those
    neither redirected, tee'd nor bound for a terminal.

    With one worker, no hang detection and a console of its own (not ``shared`` with another
    launcher's workers: ``console_shared``), none: its streams are its own to write straight to
    the launcher's file or pipe, as under torchrun, and every byte arrives as written whatever
    relaunch does. With several workers, relaunch copies them (each rank's bytes exactly, in
    order, whole lines at a time: ``procs.rank_streams``), so that two ranks' lines never mix
    within a line, as they can when unbuffered workers share one pipe. With hang detection,
    relaunch must see their output anyway (a sign of life, and the log a hung worker's stack
    goes to). No prefix, no collapsed bars: those are for tee'd streams only.
    """
    redirected = per_rank(redirects, nprocs)
    teed = per_rank(tee, nprocs)
    if nprocs == 1 and not hang_detection and not shared:
        return {rank: Std.NONE for rank in teed}
    return {rank: Std(Std.ALL & ~(redirected[rank] | teed[rank] | terminals)) for rank in teed}


def console_shared(environ: Mapping[str, str]) -> bool:
    """Whether a launcher of environment ``environ`` shares its console with other launchers'
    workers: it runs one of several replica groups (``NUM_REPLICA_GROUPS``), whose agents on
    one node write to their supervisor's console."""
    return environ.get("NUM_REPLICA_GROUPS", "1").strip() not in ("", "1")


def console_is_relaunchs(
    redirects: Std | Mapping[int, Std],
    tee: Std | Mapping[int, Std],
    nprocs: int,
    relay: Std | Mapping[int, Std] = Std.NONE,
) -> bool:
    """Whether no worker writes to the console itself: only then can relaunch draw on it (a bar
    drawn where workers write straight to the terminal would collide with them). ``tee`` is the
    one workers start with (``agent_tee``), ``relay`` what ``relayed`` gives. A relayed stdout
    is relaunch's to write; a relayed stderr is not: relaunch's bars go to stderr, and a bar
    line among bytes passed on unchanged would alter them."""
    redirected = per_rank(redirects, nprocs)
    teed = per_rank(tee, nprocs)
    relay_by_rank = per_rank(relay, nprocs)
    return all(
        redirected[rank] | teed[rank] | (relay_by_rank[rank] & Std.OUT) == Std.ALL
        for rank in redirected
    )


def log_line_prefixes(
    template: str | None, role: str, ranks: Iterable[tuple[int, int]]
) -> dict[int, str]:
    """Prefixes by local rank from torchrun's template (``${role_name}``, ``${rank}``,
    ``${local_rank}``) for ``ranks`` given as (local rank, global rank); none without a
    template (the default ``[{role}{local_rank}]:`` then applies)."""
    if not template:
        return {}
    return {
        local: template.replace("${role_name}", role)
        .replace("${rank}", str(global_rank))
        .replace("${local_rank}", str(local))
        for local, global_rank in ranks
    }
