"""The Kubernetes environment, for ``core.schedulers.detect``: detect(environ) -> Inference | None.

An Indexed Job (and a JobSet, whose Jobs are Indexed) names its pods ``<job>-<index>``: the
control plane puts the index in ``JOB_COMPLETION_INDEX`` and the kubelet the pod's hostname in
``HOSTNAME``. With a headless Service as the pods' ``subdomain``, pod 0 is reachable at
``<job>-0.<service>``: the built-in store (``c10d``) is hosted there, by the agent that can bind
that address. Kubernetes exposes neither the Service name nor the number of completions to the
pod, so the manifest opts in by saying them in its ``env``:

- ``RELAUNCH_SUBDOMAIN``: the headless Service, as in ``spec.template.spec.subdomain``;
- ``PET_NNODES``: the number of nodes (``completions``), read as the ``--nnodes`` flag;
- ``RELAUNCH_JOB_UID`` (optional): the Job's uid, from the Downward API
  (``metadata.labels['batch.kubernetes.io/controller-uid']``), the rendezvous id; the Job's name
  when it is not set.

Without ``RELAUNCH_SUBDOMAIN`` nothing is inferred: an Indexed Job that runs one single-node
relaunch per pod stays what it is, and Kubeflow's PyTorchJob and TrainJob, which set torchrun's
own ``PET_*`` variables, need nothing from here. The index is the pod's ``--node-rank``: group
ranks follow it among the pods present, but a replacement pod takes the place of the one it
replaces (``core.rendezvous.node_order``), not necessarily its index.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from relaunch.core.schedulers.inference import Inference

#: The port of the built-in store on pod 0 (torchrun's default for ``c10d``).
STORE_PORT = 29400


def detect(environ: Mapping[str, str]) -> Inference | None:
    """What an Indexed Job's pod tells of the job (None: not one, or the manifest did not opt in
    with ``RELAUNCH_SUBDOMAIN``)."""
    index = environ.get("JOB_COMPLETION_INDEX", "").strip()
    subdomain = environ.get("RELAUNCH_SUBDOMAIN", "").strip().strip(".")
    hostname = environ.get("HOSTNAME", "").strip()
    if not index.isdigit() or not subdomain:
        return None
    suffix = f"-{int(index)}"
    if not hostname.endswith(suffix) or len(hostname) == len(suffix):
        return None  # not the pod hostname an Indexed Job gives (hostNetwork, say)
    job = hostname[: -len(suffix)]
    where = "HOSTNAME, JOB_COMPLETION_INDEX, RELAUNCH_SUBDOMAIN"
    uid = environ.get("RELAUNCH_JOB_UID", "").strip()
    values: dict[str, Any] = {
        "rdzv_backend": "c10d",
        "rdzv_endpoint": f"{job}-0.{subdomain}:{STORE_PORT}",
        "rdzv_id": uid or job,
        "node_rank": int(index),
    }
    sources = {
        "rdzv_backend": where,
        "rdzv_endpoint": where,
        "rdzv_id": "RELAUNCH_JOB_UID" if uid else "HOSTNAME, JOB_COMPLETION_INDEX",
        "node_rank": "JOB_COMPLETION_INDEX",
    }
    return Inference("a Kubernetes Indexed Job", values, sources)
