"""torch's ``torch.distributed.elastic.events.api``, at relaunch's path: the event shapes (their
one home is ``relaunch.core.output.status_events``)."""

from __future__ import annotations

from relaunch.core.output.status_events import (
    Event,
    EventMetadataValue,
    EventSource,
    NodeState,
    RdzvEvent,
)

__all__ = ["Event", "EventMetadataValue", "EventSource", "NodeState", "RdzvEvent"]
