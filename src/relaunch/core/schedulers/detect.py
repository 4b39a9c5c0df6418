"""Where a job runs, from what its scheduler put in the environment: the flags relaunch infers.

Under ``srun``, a Kubernetes Indexed Job or ``mpirun``, every node's relaunch can find the
number of nodes, its own rank, the rendezvous endpoint and the job's id in the environment; users
should not have to turn those variables into flags by hand (and a silent fallback to localhost
gives each node a world of its own, which hangs). Each scheduler module (``core.schedulers.slurm``,
``core.schedulers.kubernetes``, ``core.schedulers.mpi``) has a ``detect(environ)`` that returns an
``Inference`` or None; ``infer`` asks them in order and keeps the first. The CLI applies the values
of the flags the user did not give (explicit flags always win) and prints ``Inference.describe``.

Pure: an environment in, data out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from relaunch.core.schedulers import kubernetes, mpi, slurm
from relaunch.core.schedulers.inference import Inference

Detector = Callable[[Mapping[str, str]], "Inference | None"]

#: The schedulers' detectors, in the order they are asked: the most specific first.
DETECTORS: list[Detector] = [slurm.detect, kubernetes.detect, mpi.detect]


def infer(environ: Mapping[str, str]) -> Inference | None:
    """What the first scheduler that recognises ``environ`` tells, or None (none does)."""
    for detect in DETECTORS:
        found = detect(environ)
        if found is not None:
            return found
    return None
