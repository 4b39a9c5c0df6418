"""The status of a group of processes that runs, and fails, as one unit."""

from __future__ import annotations

import enum
from collections.abc import Mapping


class GroupStatus(str, enum.Enum):
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


def group_status(exitcodes: Mapping[int, int | None]) -> GroupStatus:
    """FAILED as soon as any process exited non-zero; SUCCEEDED once all exited with 0.

    ``exitcodes`` maps every local rank to its exit code, or None while it still runs.
    """
    codes = exitcodes.values()
    if any(code is not None and code != 0 for code in codes):
        return GroupStatus.FAILED
    if all(code == 0 for code in codes):
        return GroupStatus.SUCCEEDED
    return GroupStatus.RUNNING
