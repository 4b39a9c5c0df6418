"""The data and the semantics of a store, without I/O: shared by the in-memory and TCP stores."""

from __future__ import annotations

from collections.abc import Sequence

from relaunch.store.api import CasResult, StoreError, Versioned

ABSENT = Versioned(None, 0)


class KeyValueData:
    """Keys, values and versions; every change bumps the store-wide revision."""

    def __init__(self) -> None:
        self._data: dict[str, Versioned] = {}
        self.revision = 0

    def get(self, key: str) -> Versioned:
        return self._data.get(key, ABSENT)

    def set(self, key: str, value: bytes) -> int:
        self.revision += 1
        self._data[key] = Versioned(value, self.revision)
        return self.revision

    def compare_set(self, key: str, expected_version: int, value: bytes) -> CasResult:
        current = self.get(key)
        if current.version != expected_version:
            return CasResult(False, current)
        self.set(key, value)
        return CasResult(True, self.get(key))

    def add(self, key: str, amount: int) -> int:
        current = self.get(key).value
        try:
            total = int(current or b"0") + amount
        except ValueError:
            raise StoreError(f"key {key!r} does not hold an integer") from None
        self.set(key, str(total).encode())
        return total

    def delete(self, key: str) -> bool:
        if key not in self._data:
            return False
        self.revision += 1
        del self._data[key]
        return True

    def all_exist(self, keys: Sequence[str]) -> bool:
        return all(key in self._data for key in keys)

    def items(self) -> list[tuple[str, bytes, int]]:
        """Every key with its value and version (a snapshot for a standby)."""
        return [(key, value, version) for key, (value, version) in self._data.items() if value]

    def apply(self, key: str, value: bytes | None, version: int) -> None:
        """Take a change as another store made it: ``key`` holds ``value`` at ``version``
        (None: deleted at revision ``version``); the versions stay the other store's."""
        if value is None:
            self._data.pop(key, None)
        else:
            self._data[key] = Versioned(value, version)
        self.revision = max(self.revision, version)
