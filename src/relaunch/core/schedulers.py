"""Where a job runs, from what its scheduler put in the environment: the flags relaunch infers.

Under ``srun``, a Kubernetes Indexed Job or ``mpirun``, every node's relaunch can find the
number of nodes, its own rank, the rendezvous endpoint and the job's id in the environment; users
should not have to turn those variables into flags by hand (and a silent fallback to localhost
gives each node a world of its own, which hangs). Each scheduler module (``core.slurm``,
``core.kubernetes``, ``core.mpi``) has a ``detect(environ)`` that returns an ``Inference`` or
None; ``infer`` asks them in order and keeps the first. The CLI applies the values of the flags
the user did not give (explicit flags always win) and prints ``Inference.describe``.

Pure: an environment in, data out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
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
            flag = "--" + dest.replace("_", "-")
            parts.append(f"{flag} {value} ({self.sources.get(dest, '?')})")
        if not parts:
            return f"running under {self.scheduler}: every setting it gives was given as a flag"
        return f"running under {self.scheduler}: " + ", ".join(parts)


Detector = Callable[[Mapping[str, str]], "Inference | None"]


def detectors() -> list[Detector]:
    """The schedulers' detectors, in the order they are asked: the most specific first."""
    from relaunch.core import kubernetes, mpi, slurm

    return [slurm.detect, kubernetes.detect, mpi.detect]


def infer(environ: Mapping[str, str]) -> Inference | None:
    """What the first scheduler that recognises ``environ`` tells, or None (none does)."""
    for detect in detectors():
        found = detect(environ)
        if found is not None:
            return found
    return None
