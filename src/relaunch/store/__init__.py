"""Stores: the small key-value service rendezvous runs on (built-in TCP, in-memory, etcd).

The TCP client and server and the etcd client load on first use, so a single-node launch never
imports sockets, hmac, hashlib, http or ssl.
"""

from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    if name == "EtcdStore":
        from relaunch.store.etcd import EtcdStore

        return EtcdStore
    if name == "TcpStore":
        from relaunch.store.client import TcpStore

        return TcpStore
    if name == "TcpStoreServer":
        from relaunch.store.server import TcpStoreServer

        return TcpStoreServer
    raise AttributeError(f"module 'relaunch.store' has no attribute {name!r}")
