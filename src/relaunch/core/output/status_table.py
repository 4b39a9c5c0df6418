"""The job's status as ``relaunch status`` shows it: how each node's post stands (``health``),
the table (``format_table``) and the same for scripts (``as_json``). Pure: the records of
``core.output.status`` and the time in, text and data out. Only ``relaunch status`` loads it:
the launcher posts and judges the records and never shows them this way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from relaunch.core.durations import seconds
from relaunch.core.output.status import JobView, NodeStatus, Standing, job_bar

#: Seconds after which a post that does not say when it goes stale is: the keep-alive detection
#: time of the default rendezvous settings (5 s beats, 3 missed, checked once a beat).
STALE_AFTER = 20.0


def health(node: NodeStatus, standing: Standing, now: float) -> str:
    """How ``node`` stands, as ``relaunch status`` says it: ``lost`` (its round's change removed
    it), ``past`` (its round is over), ``stale`` (no post within its ``stale_after``) or
    ``posted`` (its post is fresh: its own state stands)."""
    if standing.lost == node.group_rank:
        return "lost"
    if standing.over:
        return "past"
    limit = STALE_AFTER if node.stale_after is None else node.stale_after
    return "stale" if now - node.posted_at > limit else "posted"


def node_words(node: NodeStatus, standing: Standing, now: float) -> str:
    """The node's cell: its name, and its state unless that is not known to hold any more."""
    verdict = health(node, standing, now)
    ago = f"posted {_ago(node.posted_at, now)}"
    if verdict == "lost":
        return f"{node.node} (LOST, last {ago})"
    if verdict == "past":
        return f"{node.node} (was {node.state}, {ago})"
    if verdict == "stale":
        return f"{node.node} (STALE: no post for {seconds(now - node.posted_at)}, was {node.state})"
    return f"{node.node} ({node.state}, {ago})"


def missing_words(group_rank: int, standing: Standing, now: float) -> str:
    """The cell of a member that posted nothing: what is coming in the first interval after
    its round formed, and that nothing came after it."""
    if standing.lost == group_rank:
        return "(LOST before its first post)"
    if standing.over or standing.formed_at is None:
        return "(no status posted yet)"
    elapsed = max(0.0, now - standing.formed_at)
    if elapsed <= standing.every:
        return f"(starting: its first post is due within {seconds(standing.every)})"
    return f"(STALE: no post {seconds(elapsed)} after the round formed)"


def _ago(then: float | None, now: float) -> str:
    return "-" if then is None else f"{max(0.0, now - then):.1f}s ago"


def format_table(
    run_id: str,
    nodes: Sequence[NodeStatus],
    view: JobView | None,
    restarts: int,
    now: float,
    note: str = "",
    members: int | None = None,
    standing: Standing | None = None,
) -> str:
    """The job as ``relaunch status`` prints it: one line per rank, under its node, which says
    its group's state and when it last posted (every few seconds: its heartbeat here).
    ``members``: how many nodes the round has; those that posted nothing get a line saying so.
    ``standing``: what the round says of its posts: a node lost, or silent past its detection
    time, or of a round that is over, is never shown in its posted state."""
    standing = standing or Standing()
    lost = max((node.lost_seconds for node in nodes), default=0.0)
    lines = [
        f"job {run_id}: {len(nodes)} node(s), {sum(len(n.ranks) for n in nodes)} rank(s), "
        f"{restarts} restart(s) used"
        + (f", {lost:.1f}s lost to them" if lost else "")
        + (f"; {note}" if note else "")
    ]
    bar = None if view is None else job_bar(view)
    if bar is not None:
        lines.append(f"  {bar}")
    header = ("node", "group", "rank", "local", "state", "step", "rate", "last sign", "flag")
    rows: list[tuple[str, ...]] = []
    slow = set() if view is None else view.slow_ranks()
    for node in sorted(nodes, key=lambda n: n.group_rank):
        beat = node_words(node, standing, now)
        verdict = health(node, standing, now)
        for r in sorted(node.ranks, key=lambda r: r.rank):
            step = "-" if r.step is None else (f"{r.step}/{r.total}" if r.total else str(r.step))
            rate = "-" if r.rate is None else f"{r.rate:.3g}/s"
            flag = "straggler" if r.rank in slow else ""
            rows.append(
                (
                    beat,
                    str(node.group_rank),
                    str(r.rank),
                    str(r.local_rank),
                    _RANK_STATE.get(verdict, r.state),
                    step,
                    rate,
                    _ago(r.last_sign, now),
                    flag,
                )
            )
            beat = ""
    for missing in missing_nodes(nodes, members):
        words = missing_words(missing, standing, now)
        rows.append((words, str(missing), "", "", "", "", "", "", ""))
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(header)]
    for row in (header, *rows):
        lines.append(
            "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        )
    for slow_node in [] if view is None else view.slow_nodes:
        lines.append(f"  straggler: {slow_node.describe()}")
    for number, reason in enumerate(restart_reasons(nodes), 1):
        lines.append(f"  restart {number}: {reason}")
    return "\n".join(lines)


#: A rank's state in the table where its node's post no longer holds.
_RANK_STATE = {"lost": "lost", "stale": "unknown"}


def restart_reasons(nodes: Sequence[NodeStatus]) -> list[str]:
    """Why the group restarted, restart by restart, as the nodes tell it: the node whose
    workers failed says what failed, the others the same prefixed with its name, which is kept.
    A restart told differently by different nodes lists each telling, joined by " | "."""
    told: list[str] = []
    for index in range(max((len(node.restart_reasons) for node in nodes), default=0)):
        seen = dict.fromkeys(
            node.restart_reasons[index] for node in nodes if index < len(node.restart_reasons)
        )
        named = [r for r in seen if not any(o != r and o.endswith(f": {r}") for o in seen)]
        told.append(" | ".join(named))
    return told


def missing_nodes(nodes: Sequence[NodeStatus], members: int | None) -> list[int]:
    """The group ranks below ``members`` that posted no status."""
    posted = {node.group_rank for node in nodes}
    return [rank for rank in range(members or 0) if rank not in posted]


def as_json(
    run_id: str,
    nodes: Sequence[NodeStatus],
    view: JobView | None,
    restarts: int,
    members: int | None = None,
    standing: Standing | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """The same, for scripts (``relaunch status --json``); each node's ``health`` as of ``now``
    (``health``; None: as of its own post)."""
    standing = standing or Standing()
    return {
        "run_id": run_id,
        "restarts": restarts,
        "restart_reasons": restart_reasons(nodes),
        "nodes": [
            {
                **node.as_dict(),
                "health": health(node, standing, node.posted_at if now is None else now),
            }
            for node in sorted(nodes, key=lambda n: n.group_rank)
        ],
        "missing": missing_nodes(nodes, members),
        "job": None if view is None else view.as_dict(),
    }
