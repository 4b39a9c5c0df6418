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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relaunch.core.schedulers.inference import Inference

Detector = Callable[[Mapping[str, str]], "Inference | None"]


# Each scheduler's module loads only where a variable its ``detect`` cannot do without is set: a
# launch outside a scheduler loads none of them.


def _slurm(environ: Mapping[str, str]) -> Inference | None:
    if "SLURM_JOB_ID" not in environ and "SLURM_JOBID" not in environ:
        return None
    from relaunch.core.schedulers import slurm

    return slurm.detect(environ)


def _kubernetes(environ: Mapping[str, str]) -> Inference | None:
    if "JOB_COMPLETION_INDEX" not in environ:
        return None
    from relaunch.core.schedulers import kubernetes

    return kubernetes.detect(environ)


def _mpi(environ: Mapping[str, str]) -> Inference | None:
    if "OMPI_COMM_WORLD_SIZE" not in environ and "PMI_SIZE" not in environ:
        return None
    from relaunch.core.schedulers import mpi

    return mpi.detect(environ)


#: The schedulers' detectors, in the order they are asked: the most specific first.
DETECTORS: list[Detector] = [_slurm, _kubernetes, _mpi]


def infer(environ: Mapping[str, str]) -> Inference | None:
    """What the first scheduler that recognises ``environ`` tells, or None (none does)."""
    for detect in DETECTORS:
        found = detect(environ)
        if found is not None:
            return found
    return None
