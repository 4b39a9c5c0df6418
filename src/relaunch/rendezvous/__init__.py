"""Rendezvous: how the agents of a job agree on membership and ranks.

Backends: ``static`` (fixed node rank, fixed number of nodes), ``c10d``/``tcp`` (elastic, on the
built-in store one agent hosts) and ``etcd`` (elastic, on an etcd v3 cluster: no single point of
failure). ``--standalone`` is one node on an in-process store.
"""

from typing import TYPE_CHECKING

from relaunch.core.rendezvous.membership import ChangeKind, MembershipChange
from relaunch.core.rendezvous.rdzv_conf import BACKENDS
from relaunch.endpoints import parse_endpoint
from relaunch.rendezvous.api import (
    JobFailedError,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousHandlerCreator,
    RendezvousHandlerRegistry,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)
from relaunch.rendezvous.backends import get_rendezvous_handler
from relaunch.runtime import lazy_attributes

if TYPE_CHECKING:
    from relaunch.rendezvous.static import StaticRendezvousHandler

__all__ = [
    "BACKENDS",
    "ChangeKind",
    "JobFailedError",
    "MembershipChange",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousHandler",
    "RendezvousHandlerCreator",
    "RendezvousHandlerRegistry",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousStateError",
    "RendezvousStoreInfo",
    "RendezvousTimeoutError",
    "StaticRendezvousHandler",
    "get_rendezvous_handler",
    "parse_endpoint",
    "rendezvous_handler_registry",
]

#: The names loaded on first use (a launch that is not static needs none), and their modules.
_LAZY = {"StaticRendezvousHandler": "relaunch.rendezvous.static"}

__getattr__ = lazy_attributes(__name__, _LAZY)
