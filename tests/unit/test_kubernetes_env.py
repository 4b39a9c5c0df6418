"""Kubernetes: the manifests under deploy/kubernetes are well formed, and every pod they make
gets, from the environment its controller gives it, the rendezvous relaunch should run.

There is no cluster here: each pod's environment is built as the controllers document it. The
Job controller sets ``JOB_COMPLETION_INDEX`` and names the pod (``HOSTNAME``, set by the
kubelet) ``<job>-<index>`` (kubernetes.io/docs/tasks/job/job-with-pod-to-pod-communication);
the Downward API resolves ``fieldRef``s; Kubeflow's training-operator sets torchrun's ``PET_*``
variables, ``MASTER_ADDR``/``MASTER_PORT`` and ``WORLD_SIZE``/``RANK``
(pkg/controller.v1/pytorch: envvar.go, master.go, elastic.go); a JobSet's Jobs are Indexed
Jobs whose pods are named ``<jobset>-<replicatedjob>-<jobindex>-<index>``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from relaunch.core.schedulers import detect as schedulers
from relaunch.core.schedulers import kubernetes, mpi
from tests.support.launching import in_job_dir, launch

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
UID = "6a1f4a1e-2b7c-4d4e-9f2a-0c5d1e3b7a90"
RENDEZVOUS_FLAGS = re.compile(r"^--(nnodes|node[-_]rank|master[-_]|rdzv[-_]|standalone)")


def load(name: str) -> dict[str, dict[str, Any]]:
    """The manifest's objects by kind (each kind appears once, the Services aside)."""
    docs = list(yaml.safe_load_all((DEPLOY / name).read_text()))
    assert all(isinstance(doc, dict) for doc in docs), name
    return {f"{doc['kind']}/{doc['metadata']['name']}": doc for doc in docs}


def pod_env(job: dict[str, Any], index: int) -> dict[str, str]:
    """What the container of pod ``index`` of the Indexed Job ``job`` sees in its environment."""
    name = job["metadata"]["name"]
    labels = {"batch.kubernetes.io/controller-uid": UID, "batch.kubernetes.io/job-name": name}
    annotations = {"batch.kubernetes.io/job-completion-index": str(index)}
    env = {"HOSTNAME": f"{name}-{index}", "JOB_COMPLETION_INDEX": str(index), "PATH": "/usr/bin"}
    (container,) = job["spec"]["template"]["spec"]["containers"]
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
            continue
        path = item["valueFrom"]["fieldRef"]["fieldPath"]
        found = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        assert found, f"a fieldRef the Downward API does not give as env: {path}"
        source = labels if found.group(1) == "labels" else annotations
        env[item["name"]] = source[found.group(2)]
    return env


@pytest.fixture(autouse=True)
def _script(tmp_path: Path) -> Iterator[None]:
    with in_job_dir(tmp_path):
        yield


def check_indexed_job(objects: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """The Job and its headless Service fit together; returns the Job and the Service's name."""
    (job,) = (doc for key, doc in objects.items() if key.startswith("Job/"))
    assert job["apiVersion"] == "batch/v1"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]
    pod = spec["template"]["spec"]
    service = objects[f"Service/{pod['subdomain']}"]  # the pods' subdomain is this Service
    assert service["apiVersion"] == "v1"
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    (container,) = pod["containers"]
    assert container["command"][0] == "relaunch"
    assert not [arg for arg in container["command"] if RENDEZVOUS_FLAGS.match(arg)]
    names = {item["name"]: item for item in container["env"]}
    assert names["RELAUNCH_SUBDOMAIN"]["value"] == pod["subdomain"]
    assert names["PET_NNODES"]["value"] == str(spec["completions"])
    return job, pod["subdomain"]


def test_the_indexed_job_rendezvous_on_the_store_pod_0_hosts() -> None:
    job, service = check_indexed_job(load("indexed-job.yaml"))
    assert job["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] == 29400
    for index in range(job["spec"]["completions"]):
        env = pod_env(job, index)
        found = schedulers.infer(env)
        assert found is not None and found.scheduler == "a Kubernetes Indexed Job"
        got = launch(job["spec"]["template"]["spec"]["containers"][0]["command"][1:], env)
        assert (got.min_nodes, got.max_nodes) == (2, 2)
        assert got.rdzv_backend == "c10d"
        assert got.rdzv_endpoint == f"relaunch-train-0.{service}:29400"
        assert got.run_id == UID
        assert got.max_restarts == 3


def test_the_etcd_job_rendezvous_on_the_etcd_service(capsys: pytest.CaptureFixture[str]) -> None:
    objects = load("indexed-job-etcd.yaml")
    job, _ = check_indexed_job(objects)
    etcd = objects["Deployment/relaunch-etcd"]
    assert etcd["apiVersion"] == "apps/v1"
    labels = etcd["spec"]["template"]["metadata"]["labels"]
    assert etcd["spec"]["selector"]["matchLabels"] == labels
    assert objects["Service/relaunch-etcd"]["spec"]["selector"] == labels
    assert (
        "--listen-client-urls=http://0.0.0.0:2379"
        in etcd["spec"]["template"]["spec"]["containers"][0]["command"]
    )
    for index in range(job["spec"]["completions"]):
        got = launch(["train.py"], pod_env(job, index))
        assert (got.min_nodes, got.max_nodes) == (2, 2)
        assert (got.rdzv_backend, got.rdzv_endpoint) == ("etcd", "relaunch-etcd:2379")
        assert got.run_id == UID  # each run of the Job apart in etcd
        assert got.rendezvous_settings.rank == index, "group ranks follow the pods' indexes"
    # The line says what was inferred: the id and the node rank, the manifest set the rest as
    # PET_*.
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"relaunch: running under a Kubernetes Indexed Job: --rdzv-id {UID} (RELAUNCH_JOB_UID), "
        "--node-rank 1 (JOB_COMPLETION_INDEX)"
    )


def test_a_jobset_pod_finds_pod_0_of_its_job() -> None:
    # JobSet: Jobs <jobset>-<replicatedjob>-<jobindex>, subdomain <jobset> by default; no uid
    # passed: the Job's name is the id.
    env = {
        "HOSTNAME": "train-workers-0-3",
        "JOB_COMPLETION_INDEX": "3",
        "RELAUNCH_SUBDOMAIN": "train",
        "PET_NNODES": "4",
    }
    got = launch(["train.py"], env)
    assert (got.rdzv_backend, got.rdzv_endpoint) == ("c10d", "train-workers-0-0.train:29400")
    assert (got.run_id, got.max_nodes) == ("train-workers-0", 4)


def test_pytorchjob_pods_run_on_the_pet_variables_the_operator_sets() -> None:
    job = load("pytorchjob.yaml")["PyTorchJob/relaunch-train"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    total = sum(spec["replicas"] for spec in replicas.values())
    port = replicas["Master"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    # The master is rank 0, worker i rank i + 1 (envvar.go).
    pods = [("Master", 0)] + [("Worker", i + 1) for i in range(replicas["Worker"]["replicas"])]
    for kind, rank in pods:
        (container,) = replicas[kind]["template"]["spec"]["containers"]
        assert container["name"] == "pytorch" and container["ports"][0]["name"] == "pytorchjob-port"
        env = {
            "PYTHONUNBUFFERED": "0",
            "MASTER_ADDR": "relaunch-train-master-0",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(total),
            "RANK": str(rank),
            "PET_MASTER_ADDR": "relaunch-train-master-0",
            "PET_MASTER_PORT": str(port),
            "PET_NNODES": str(total),
            "PET_NODE_RANK": str(rank),
            "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"],
        }
        assert schedulers.infer(env) is None  # plain pods: nothing to infer, the flags say it
        got = launch(container["command"][1:], env)
        assert (got.min_nodes, got.max_nodes, got.rdzv_backend) == (2, 2, "static")
        assert got.rdzv_endpoint == f"relaunch-train-master-0:{port}"
        assert got.rdzv_configs["rank"] == rank
        assert got.nproc_per_node == 4  # auto, on 4 CPUs and no GPU


def test_an_elastic_pytorchjob_runs_on_its_rendezvous_variables() -> None:
    env = {  # elasticPolicy with minReplicas 1, maxReplicas 3, no Master
        "PET_RDZV_ENDPOINT": "relaunch-train-worker-0:29400",
        "PET_RDZV_BACKEND": "c10d",
        "PET_NNODES": "1:3",
        "PET_MAX_RESTARTS": "5",
        "PET_NPROC_PER_NODE": "2",
        "PET_RDZV_ID": "relaunch-train",
    }
    got = launch(["train.py"], env)
    assert (got.min_nodes, got.max_nodes, got.rdzv_backend) == (1, 3, "c10d")
    assert (got.rdzv_endpoint, got.run_id, got.max_restarts) == (
        "relaunch-train-worker-0:29400",
        "relaunch-train",
        5,
    )


def test_a_trainjob_pod_keeps_the_pet_variables_of_kubeflow_trainer() -> None:
    # Kubeflow Trainer's TrainJob runs a JobSet whose pods get PET_* from the torch plugin: with
    # no RELAUNCH_SUBDOMAIN nothing is inferred, the static rendezvous they describe runs.
    env = {
        "HOSTNAME": "tj-node-0-1",
        "JOB_COMPLETION_INDEX": "1",
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "1",
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "tj-node-0-0.tj",
        "PET_MASTER_PORT": "29400",
    }
    assert schedulers.infer(env) is None
    got = launch(["train.py"], env)
    assert (got.rdzv_backend, got.rdzv_endpoint) == ("static", "tj-node-0-0.tj:29400")
    assert got.rdzv_configs["rank"] == 1


@pytest.mark.parametrize(
    "env",
    [
        {},  # not in a pod
        {"JOB_COMPLETION_INDEX": "1", "HOSTNAME": "job-1"},  # no opt-in: one node per pod
        {"JOB_COMPLETION_INDEX": "1", "HOSTNAME": "node-a", "RELAUNCH_SUBDOMAIN": "svc"},
        {"JOB_COMPLETION_INDEX": "x", "HOSTNAME": "job-x", "RELAUNCH_SUBDOMAIN": "svc"},
        {"JOB_COMPLETION_INDEX": "1", "HOSTNAME": "-1", "RELAUNCH_SUBDOMAIN": "svc"},
    ],
)
def test_nothing_is_inferred_outside_an_opted_in_indexed_job(env: dict[str, str]) -> None:
    assert kubernetes.detect(env) is None
    assert mpi.detect(env) is None


def test_the_line_names_the_variables() -> None:
    env = {"JOB_COMPLETION_INDEX": "0", "HOSTNAME": "j-0", "RELAUNCH_SUBDOMAIN": "s."}
    found = kubernetes.detect(env)
    assert found is not None
    assert found.describe(list(found.values)) == (
        "running under a Kubernetes Indexed Job: "
        "--rdzv-backend c10d (HOSTNAME, JOB_COMPLETION_INDEX, RELAUNCH_SUBDOMAIN), "
        "--rdzv-endpoint j-0.s:29400 (HOSTNAME, JOB_COMPLETION_INDEX, RELAUNCH_SUBDOMAIN), "
        "--rdzv-id j (HOSTNAME, JOB_COMPLETION_INDEX), --node-rank 0 (JOB_COMPLETION_INDEX)"
    )
