"""Stores: the small key-value service rendezvous runs on (built-in TCP, in-memory, etcd later)."""

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
from relaunch.store.client import TcpStore
from relaunch.store.memory import MemoryStore
from relaunch.store.server import TcpStoreServer

__all__ = [
    "CasResult",
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
