"""What a scheduler's environment tells relaunch: the flags it infers, and from which variables
(``core.schedulers.detect`` asks each scheduler module for one)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Inference:
    """What ``scheduler`` tells: ``values`` by flag (argparse's dest, in parsed form: ``nnodes``
    is ``(min, max)``), and for each the variables it came from (``sources``)."""

    scheduler: str
    values: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

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
