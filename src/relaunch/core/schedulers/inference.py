"""What a scheduler's environment tells relaunch: the flags it infers, and from which variables
(``core.schedulers.detect`` asks each scheduler module for one)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from relaunch.core.value import Value


class Inference(Value):
    """What ``scheduler`` tells: ``values`` by flag (argparse's dest, in parsed form: ``nnodes``
    is ``(min, max)``), and for each the variables it came from (``sources``)."""

    __slots__ = ("scheduler", "sources", "values")

    scheduler: str
    values: dict[str, Any]
    sources: dict[str, str]

    def __init__(
        self,
        scheduler: str,
        values: dict[str, Any] | None = None,
        sources: dict[str, str] | None = None,
    ) -> None:
        self._set(
            scheduler=scheduler,
            values={} if values is None else values,
            sources={} if sources is None else sources,
        )

    def describe(self, applied: Iterable[str]) -> str:
        """The one line saying what was inferred, and from which variables."""
        parts = []
        for dest in applied:
            value = self.values[dest]
            if dest == "nnodes":
                low, high = value
                value = low if low == high else f"{low}:{high}"
            elif isinstance(value, list):  # signals, as --signals-to-handle spells them
                value = ",".join(getattr(item, "name", str(item)) for item in value)
            flag = "--" + dest.replace("_", "-")
            parts.append(f"{flag} {value} ({self.sources.get(dest, '?')})")
        if not parts:
            return f"running under {self.scheduler}: every setting it gives was given as a flag"
        return f"running under {self.scheduler}: " + ", ".join(parts)
