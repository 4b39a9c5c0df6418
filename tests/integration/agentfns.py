"""Function entrypoints for the agent tests (importable by spawned children)."""

from __future__ import annotations

import os

#: The variables torchrun 2.13 adds to a worker's environment (its LocalElasticAgent, plus
#: OMP_NUM_THREADS and TORCHELASTIC_SIGNALS_TO_HANDLE, which torchrun puts in its own
#: environment), as dumped by a worker under ``torchrun --nproc-per-node 2``.
CONTRACT = (
    "LOCAL_RANK",
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
)


def environment(tag: str) -> dict[str, str]:
    return {"tag": tag, **{name: os.environ.get(name, "<unset>") for name in CONTRACT}}


def fail_first_attempt() -> str:
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    if attempt == "0" and os.environ["RANK"] == "1":
        raise RuntimeError("first attempt fails")
    return f"rank {os.environ['RANK']} attempt {attempt}"


def always_fail() -> None:
    raise KeyError(f"rank {os.environ['RANK']}")
