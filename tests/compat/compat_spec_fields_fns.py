"""Function workers for tests/compat/test_compat_spec_fields.py (importable by spawned children)."""

from __future__ import annotations

import os


def device_env() -> tuple[str | None, str | None, str | None]:
    """What a worker sees of its place: RANK, LOCAL_RANK and CUDA_VISIBLE_DEVICES."""
    return (
        os.environ.get("RANK"),
        os.environ.get("LOCAL_RANK"),
        os.environ.get("CUDA_VISIBLE_DEVICES"),
    )


def rank_squared() -> int:
    rank = int(os.environ["RANK"])
    return rank * rank
