"""torch's ``torch.distributed.elastic.agent.server.local_elastic_agent``, at relaunch's path:
the agent (its home is ``agent.loop``) and the environment variables that turn on its file
timer server for ``relaunch.timer.expires``."""

from __future__ import annotations

from relaunch.agent.loop import LocalElasticAgent
from relaunch.core.workers.timers import ENABLE_FILE_TIMER_ENV as TORCHELASTIC_ENABLE_FILE_TIMER
from relaunch.core.workers.timers import TIMER_FILE_ENV as TORCHELASTIC_TIMER_FILE

__all__ = ["TORCHELASTIC_ENABLE_FILE_TIMER", "TORCHELASTIC_TIMER_FILE", "LocalElasticAgent"]
