"""A store handed over by a rendezvous handler, whichever API it speaks.

A handler written for torch returns torch's ``Store`` in its ``RendezvousInfo``: ``set(key,
value)``, a ``get(key)`` that blocks until the key is there (up to the store's own timeout), and
``multi_get``/``multi_set`` where it has them. relaunch's stores (``store.api.Store``) have a
``get`` that returns at once and a ``wait``. ``AnyStore`` speaks both, for the few keys the agent
shares through such a store (torch's way of assigning worker ranks, ``agent.ranks``, and
``RendezvousStoreInfo.build``). relaunch's own handlers never need it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from relaunch.store.api import StoreError

#: Seconds a key awaited in a relaunch store may take to appear (torch's stores keep their own).
DEFAULT_TIMEOUT = 300.0


class AnyStore:
    """``store`` (torch's or relaunch's), for setting and awaiting a few keys. A store with a
    ``watch`` method is taken for relaunch's; any other for torch's. Every failure, torch's
    store's own included, is a ``StoreError`` saying which keys."""

    def __init__(self, store: Any, timeout: float = DEFAULT_TIMEOUT) -> None:
        self._store = store
        self._relaunchs = callable(getattr(store, "watch", None))
        self._timeout = timeout

    def set_many(self, pairs: Iterable[tuple[str, bytes]]) -> None:
        """Set each key to its value (torch's ``multi_set`` where the store has it)."""
        items = list(pairs)
        multi_set = None if self._relaunchs else getattr(self._store, "multi_set", None)
        try:
            if multi_set is not None:
                multi_set([key for key, _ in items], [value for _, value in items])
                return
            for key, value in items:
                self._store.set(key, value)
        except Exception as exc:
            raise _failed("write", [key for key, _ in items], exc) from exc

    def get_many(self, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys``, once all are there (torch's ``multi_get`` where the store has
        it); ``StoreError`` when one does not come within the store's timeout."""
        try:
            if self._relaunchs:
                self._store.wait(list(keys), self._timeout)
                values = [self._store.get(key).value for key in keys]
                if any(value is None for value in values):
                    raise StoreError("a key was deleted as it was read")
                return [bytes(value) for value in values]
            multi_get = getattr(self._store, "multi_get", None)
            if multi_get is not None:
                return [bytes(value) for value in multi_get(list(keys))]
            return [bytes(self._store.get(key)) for key in keys]
        except Exception as exc:  # torch's store raises its own errors (a timeout, a lost peer)
            raise _failed("read", keys, exc) from exc


def _failed(what: str, keys: Sequence[str], exc: Exception) -> StoreError:
    shown = ", ".join(keys[:3]) + ("..." if len(keys) > 3 else "")
    why = " ".join(str(exc).split()) or type(exc).__name__
    return StoreError(f"could not {what} {shown} in the rendezvous handler's store: {why}")
