"""Replica groups (``--replica-groups R``): which group a node serves, each group's run id, nodes,
environment and console prefix, and the lines that tell how each group ended.

Each group is its own world and failure domain: its own rendezvous (its own run id on the job's
store), its own ranks from 0, its own ``MASTER_PORT`` and its own restarts. Its workers get
``REPLICA_GROUP_ID`` and ``NUM_REPLICA_GROUPS``, the variables torchft's examples read.
"""

from __future__ import annotations

from collections.abc import Iterable

#: The variables each group's workers get (only when ``--replica-groups`` is given).
REPLICA_GROUP_ID_ENV = "REPLICA_GROUP_ID"
NUM_REPLICA_GROUPS_ENV = "NUM_REPLICA_GROUPS"
#: The most replica groups read from one job's store (``relaunch status``, the store's
#: failover): groups are numbered from 0, and the first one missing ends the list.
MAX_GROUPS = 1024


def group_run_id(run_id: str, group: int) -> str:
    """The run id of ``group``'s rendezvous: the job's with the group's number."""
    return f"{run_id}-group{group}"


def job_of_group(run_id: str) -> str | None:
    """The job's run id when ``run_id`` is one of its groups' (``group_run_id``); None
    otherwise."""
    job, marker, group = run_id.rpartition("-group")
    return job if marker and job and group.isdigit() and str(int(group)) == group else None


def group_env(group: int, count: int) -> dict[str, str]:
    """The variables every worker of ``group`` (of ``count``) gets."""
    return {REPLICA_GROUP_ID_ENV: str(group), NUM_REPLICA_GROUPS_ENV: str(count)}


def group_prefix_template(group: int) -> str:
    """The console prefix of a group's worker lines, as torchrun's template: ``[g1 default0]:``."""
    return f"[g{group} ${{role_name}}${{local_rank}}]:"


def group_nodes(min_nodes: int, max_nodes: int, count: int) -> tuple[int, int]:
    """Each group's ``MIN:MAX`` nodes when ``count`` groups share ``min_nodes:max_nodes``;
    ValueError when either does not divide evenly."""
    if min_nodes % count or max_nodes % count:
        span = str(max_nodes) if min_nodes == max_nodes else f"{min_nodes}:{max_nodes}"
        raise ValueError(
            f"--nnodes {span} cannot be split into {count} replica groups: give a node count "
            f"that {count} divides (each group gets nnodes / {count})"
        )
    return min_nodes // count, max_nodes // count


def group_of_node(node_rank: int, max_nodes: int, count: int) -> int:
    """The group of the node of rank ``node_rank``: nodes in order, ``max_nodes / count`` a
    group. ValueError when the rank is not one of the job's."""
    if node_rank >= max_nodes:
        raise ValueError(
            f"--node-rank {node_rank} is not a node of --nnodes {max_nodes}: give a rank below "
            f"{max_nodes}, or this node's group with --replica-group"
        )
    return node_rank // (max_nodes // count)


def check_group(group: int, count: int) -> None:
    """``--replica-group`` names one of the ``count`` groups; ValueError otherwise."""
    if count == 1:
        raise ValueError("--replica-group needs --replica-groups R with R > 1")
    if group >= count:
        raise ValueError(
            f"--replica-group {group} is not one of --replica-groups {count}: give 0..{count - 1}"
        )


def metrics_port(port: int | None, group: int) -> int | None:
    """Group ``group``'s metrics port: ``--metrics-port P`` serves group g at P + g (0: each a
    free port; None: not served)."""
    return port + group if port else port


def exit_status(returncode: int) -> int:
    """A group agent's ``waitpid`` return code as an exit status (killed by signal n: 128 + n)."""
    return 128 - returncode if returncode < 0 else returncode


def worst_status(statuses: Iterable[int]) -> int:
    """The job's exit status: the worst of its groups' (the highest: failures above success,
    93 (do not requeue) above 1, a signal's 128 + n above both)."""
    return max(statuses, default=0)


def format_group_end(
    group: int, status: int, restarts: int | None, signal_name: str | None = None
) -> str:
    """The line that tells how ``group`` ended: its outcome and the restarts it used (None: not
    known); ``signal_name`` when its agent was killed by that signal."""
    used = "" if restarts is None else f", {restarts} restart{'s' * (restarts != 1)}"
    if signal_name is not None:
        outcome = f"its agent was killed by {signal_name} (exit status {status})"
    elif status == 0:
        outcome = "succeeded"
    elif status > 128:
        outcome = f"stopped (exit status {status})"
    else:
        outcome = f"failed (exit status {status})"
    return f"replica group {group}: {outcome}{used}"
