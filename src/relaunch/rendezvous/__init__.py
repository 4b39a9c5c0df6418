"""Rendezvous: how the agents of a job agree on membership and ranks.

This release has the ``static`` backend (fixed node rank, fixed number of nodes) and the
single-node ``--standalone`` case; the dynamic backends plug in behind the same handler.
"""

from relaunch.rendezvous.api import (
    BACKENDS,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    get_rendezvous_handler,
    parse_endpoint,
)
from relaunch.rendezvous.static import StaticRendezvousHandler

__all__ = [
    "BACKENDS",
    "RendezvousError",
    "RendezvousHandler",
    "RendezvousInfo",
    "RendezvousParameters",
    "StaticRendezvousHandler",
    "get_rendezvous_handler",
    "parse_endpoint",
]
