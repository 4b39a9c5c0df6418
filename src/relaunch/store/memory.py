"""An in-process store: the same semantics as the TCP store, for tests and single-process use."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from relaunch.runtime import SYSTEM_CLOCK, Clock
from relaunch.store.api import CasResult, StoreTimeout, Versioned
from relaunch.store.data import KeyValueData


class MemoryStore:
    """A thread-safe ``Store`` held in memory; waits block on a condition, not a poll, and keep
    their deadlines on ``clock``."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock
        self._state = KeyValueData()
        self._changed = threading.Condition()

    def get(self, key: str) -> Versioned:
        with self._changed:
            return self._state.get(key)

    def get_many(self, keys: Sequence[str]) -> list[Versioned]:
        with self._changed:
            return [self._state.get(key) for key in keys]

    def set(self, key: str, value: bytes) -> int:
        with self._changed:
            version = self._state.set(key, value)
            self._changed.notify_all()
            return version

    def compare_set(self, key: str, expected_version: int, value: bytes) -> CasResult:
        with self._changed:
            result = self._state.compare_set(key, expected_version, value)
            self._changed.notify_all()
            return result

    def add(self, key: str, amount: int) -> int:
        with self._changed:
            total = self._state.add(key, amount)
            self._changed.notify_all()
            return total

    def delete(self, key: str) -> bool:
        with self._changed:
            existed = self._state.delete(key)
            self._changed.notify_all()
            return existed

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        deadline = self._clock.monotonic() + timeout
        with self._changed:
            while not self._state.all_exist(keys):
                left = deadline - self._clock.monotonic()
                if left <= 0:
                    missing = [k for k in keys if not self._state.all_exist([k])]
                    raise StoreTimeout(f"timed out after {timeout}s waiting for keys {missing}")
                self._changed.wait(left)

    def watch(self, key: str, version: int, timeout: float) -> Versioned:
        deadline = self._clock.monotonic() + timeout
        with self._changed:
            while self._state.get(key).version == version:
                left = deadline - self._clock.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return self._state.get(key)

    def close(self) -> None:
        pass
