"""What to log when timers expire."""

from __future__ import annotations

import logging

#: torch's names; the module's other names are relaunch's own.
__all__ = ["log_debug_info_for_expired_timers"]

log = logging.getLogger(__name__)


def log_debug_info_for_expired_timers(run_id: str, expired_timers: dict[int, list[str]]) -> None:
    """Log which scopes (``expired_timers``: pid -> scope ids) of job ``run_id`` expired."""
    if expired_timers:
        log.info("timers expired for run %s: %s", run_id, expired_timers)
