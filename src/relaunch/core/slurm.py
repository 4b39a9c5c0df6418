"""The slurm environment, for ``core.schedulers``: detect(environ) -> Inference | None."""

from __future__ import annotations

from collections.abc import Mapping

from relaunch.core.inference import Inference


def detect(environ: Mapping[str, str]) -> Inference | None:
    """What slurm tells of this node's place in the job (None: not running under it)."""
    return None
