"""Expiry timers: ``with relaunch.timer.expires(after=60):`` reaps a worker stuck in the block.

Under ``relaunch --timers`` (or ``TORCHELASTIC_ENABLE_FILE_TIMER=1``) the agent runs a
``FileTimerServer`` and ``expires`` finds it through ``TORCHELASTIC_TIMER_FILE``; elsewhere,
start a server and ``configure`` its client yourself. A reaped worker is a failure whose
report names the expired scope, and the group restarts under the usual policy.
"""

from relaunch.timer.api import (
    RequestQueue,
    TimerClient,
    TimerRequest,
    TimerServer,
    configure,
    expires,
)
from relaunch.timer.debug_info_logging import log_debug_info_for_expired_timers
from relaunch.timer.file_based_local_timer import (
    FileTimerClient,
    FileTimerRequest,
    FileTimerServer,
)
from relaunch.timer.local_timer import LocalTimerClient, LocalTimerServer

__all__ = [
    "FileTimerClient",
    "FileTimerRequest",
    "FileTimerServer",
    "LocalTimerClient",
    "LocalTimerServer",
    "RequestQueue",
    "TimerClient",
    "TimerRequest",
    "TimerServer",
    "configure",
    "expires",
    "log_debug_info_for_expired_timers",
]
