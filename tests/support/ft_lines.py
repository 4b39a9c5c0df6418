"""The lines of benchmarks/workers/torchft_train.py (``ft-KIND key=value ...``), read back: shared
by the replicas benchmark and the replica-group tests. Standard library only."""

from __future__ import annotations

import re
from dataclasses import dataclass

#: A worker's line, anywhere in a line of output (a launcher may prefix its workers' lines).
LINE_RE = re.compile(r"\bft-(start|step|kill|done)((?: \w+=\S+)+)")


@dataclass
class Line:
    """One line: its kind (start, step, kill, done), its replica group, its fields."""

    kind: str
    group: int
    fields: dict[str, str]

    @property
    def at(self) -> float:
        """When the worker printed it (its ``time.time()``)."""
        return float(self.fields["time"])

    @property
    def step(self) -> int:
        return int(self.fields["step"])


def parse(text: str) -> list[Line]:
    """Every worker line in ``text``, in order."""
    lines: list[Line] = []
    for match in LINE_RE.finditer(text):
        fields = dict(item.split("=", 1) for item in match.group(2).split())
        lines.append(Line(match.group(1), int(fields["group"]), fields))
    return lines
