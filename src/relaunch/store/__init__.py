"""Stores: the small key-value service rendezvous runs on (built-in TCP, in-memory, etcd).

The TCP client and server and the etcd client load on first use, so a single-node launch never
imports sockets, hmac, hashlib, http or ssl.
"""

from typing import TYPE_CHECKING

from relaunch.runtime import lazy_attributes
from relaunch.store.api import (
    CasResult,
    Store,
    StoreAuthError,
    StoreConnectionError,
    StoreError,
    StoreProtocolError,
    StoreTimeout,
    Versioned,
)
from relaunch.store.memory import MemoryStore

if TYPE_CHECKING:
    from relaunch.store.client import TcpStore
    from relaunch.store.etcd import EtcdStore
    from relaunch.store.server import TcpStoreServer

__all__ = [
    "CasResult",
    "EtcdStore",
    "MemoryStore",
    "Store",
    "StoreAuthError",
    "StoreConnectionError",
    "StoreError",
    "StoreProtocolError",
    "StoreTimeout",
    "TcpStore",
    "TcpStoreServer",
    "Versioned",
]


#: The names that load on first use, by the module that defines each.
_LAZY = {
    "EtcdStore": "relaunch.store.etcd",
    "TcpStore": "relaunch.store.client",
    "TcpStoreServer": "relaunch.store.server",
}


__getattr__ = lazy_attributes(__name__, _LAZY)
