"""How the agent lays out its workers' console output: what is tee'd, whether relaunch may draw
on the console, and torchrun's per-rank line prefixes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from relaunch.core.streams import Std, per_rank

#: torchrun's variable for the console prefix of worker lines.
LOG_LINE_PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"


def agent_tee(
    tee: Std | Mapping[int, Std],
    redirects: Std | Mapping[int, Std],
    nprocs: int,
    hang_detection: bool,
) -> Std | Mapping[int, Std]:
    """The tee to start workers with: ``tee`` as given, or with hang detection on, every stream
    left on the console tee'd too, so that its output counts as a sign of life and a hung
    worker's stack is on file."""
    if not hang_detection:
        return tee
    redirected = per_rank(redirects, nprocs)
    return {
        rank: Std(std | (Std.ALL & ~redirected[rank]))
        for rank, std in per_rank(tee, nprocs).items()
    }


def relayed(
    redirects: Std | Mapping[int, Std],
    tee: Std | Mapping[int, Std],
    nprocs: int,
    terminals: Std,
) -> dict[int, Std]:
    """The streams relaunch copies to its console itself, by local rank: those neither logged
    nor bound for a terminal (``terminals``: the launcher's streams that are one).

    Off a terminal (a CI log, a pipe) a worker writing straight to the console would put every
    progress-bar refresh in it; through relaunch, lines stay whole and refreshes are collapsed.
    On a terminal the worker keeps it, as under torchrun (its bars draw, its prompts read).
    """
    redirected = per_rank(redirects, nprocs)
    teed = per_rank(tee, nprocs)
    return {rank: Std(Std.ALL & ~(redirected[rank] | teed[rank] | terminals)) for rank in teed}


def console_is_relaunchs(
    redirects: Std | Mapping[int, Std],
    tee: Std | Mapping[int, Std],
    nprocs: int,
    relay: Std | Mapping[int, Std] = Std.NONE,
) -> bool:
    """Whether no worker writes to the console itself: only then can relaunch draw on it (a bar
    drawn where workers write straight to the terminal would collide with them). ``tee`` is the
    one workers start with (``agent_tee``), ``relay`` what ``relayed`` gives."""
    redirected = per_rank(redirects, nprocs)
    teed = per_rank(tee, nprocs)
    relay_by_rank = per_rank(relay, nprocs)
    return all(
        redirected[rank] | teed[rank] | relay_by_rank[rank] == Std.ALL for rank in redirected
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
