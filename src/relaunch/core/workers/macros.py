"""Substitution of ``${local_rank}`` in worker arguments."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

LOCAL_RANK_MACRO = "${local_rank}"


def substitute_local_rank(args: Iterable[Any], local_rank: int) -> tuple[Any, ...]:
    """Replace ``${local_rank}`` inside every string argument; other arguments pass unchanged."""
    rank = str(local_rank)
    return tuple(
        arg.replace(LOCAL_RANK_MACRO, rank) if isinstance(arg, str) else arg for arg in args
    )
