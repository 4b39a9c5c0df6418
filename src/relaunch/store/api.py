"""The ``Store`` protocol rendezvous needs, and the errors every backend raises.

Exceptions::

    StoreError                  base class
      StoreTimeout              a deadline passed (a wait, a connect, a reply)
      StoreConnectionError      the store cannot be reached, or the connection broke
        StoreAuthError          the token was refused (or the server did not ask for one)
      StoreProtocolError        a malformed frame or reply

Every key carries a *version*: the store-wide revision of its last change (like etcd's
mod_revision). ``compare_set`` is the fencing primitive: it writes only when the key's version is
still the one the caller read (0 meaning "absent"), so two writers can never both win.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol


class StoreError(Exception):
    """Something went wrong talking to the store."""


class StoreTimeout(StoreError):
    """A deadline passed."""


class StoreConnectionError(StoreError):
    """The store cannot be reached, or the connection broke."""


class StoreRefused(StoreConnectionError):
    """The store's host answered, but nothing listens at the store's address any more: the
    store is gone, not merely out of reach (a cut cable or a host that is down answer nothing)."""


class StoreAuthError(StoreConnectionError):
    """Authentication failed: wrong or missing token."""


class StoreRedirect(StoreError):
    """The store is a standby: ``primary`` (``host:port``) serves the job."""

    def __init__(self, message: str, primary: str) -> None:
        super().__init__(message)
        self.primary = primary


class StoreFenced(StoreError):
    """The store lost the job's majority and serves nobody: another may run the job."""


class StoreProtocolError(StoreError):
    """A malformed frame or an unexpected reply."""


class Versioned(NamedTuple):
    """A value with the version of its last change; ``value`` is None (and version 0) if absent."""

    value: bytes | None
    version: int


class CasResult(NamedTuple):
    """The outcome of ``compare_set``: whether it wrote, and the key's value and version now."""

    succeeded: bool
    current: Versioned


class Watchable(Protocol):
    """What waiting on keys takes: a ``Store``, or etcd's feed of a prefix (``etcd_feed``)."""

    def get(self, key: str) -> Versioned:
        """The value and version of ``key`` (``Versioned(None, 0)`` when absent)."""

    def watch(self, key: str, version: int, timeout: float) -> Versioned:
        """Return ``key`` once its version differs from ``version``, or as it is at the timeout."""


class Store(Protocol):
    """A small key-value store with versions, counters and waits, shared by a job's agents."""

    def get(self, key: str) -> Versioned:
        """The value and version of ``key`` (``Versioned(None, 0)`` when absent)."""

    def set(self, key: str, value: bytes) -> int:
        """Write ``value``; return the key's new version."""

    def compare_set(self, key: str, expected_version: int, value: bytes) -> CasResult:
        """Write only if ``key``'s version is ``expected_version`` (0: only if absent)."""

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (absent counts as 0); return the sum."""

    def delete(self, key: str) -> bool:
        """Remove ``key``; whether it existed."""

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        """Return once every key exists; ``StoreTimeout`` after ``timeout`` seconds."""

    def watch(self, key: str, version: int, timeout: float) -> Versioned:
        """Return ``key`` once its version differs from ``version``, or as it is at the timeout."""

    def close(self) -> None:
        """Release the connection (a no-op for in-process stores)."""
