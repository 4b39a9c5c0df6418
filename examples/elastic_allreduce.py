"""``elastic_launch`` from Python: four workers, each a function that does an all-reduce.

    python examples/elastic_allreduce.py

Each worker adds its rank into one tensor with ``torch.distributed.all_reduce`` over gloo and
returns the sum; ``elastic_launch`` returns every worker's return value by global rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from relaunch import LaunchConfig, elastic_launch


def all_reduce_ranks() -> int:
    dist.init_process_group("gloo")  # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE from relaunch
    value = torch.tensor([dist.get_rank()])
    dist.all_reduce(value)
    dist.destroy_process_group()
    return int(value.item())


if __name__ == "__main__":
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=4, rdzv_endpoint="127.0.0.1:0", max_restarts=0
    )
    results = elastic_launch(config, all_reduce_ranks)()
    print(results)  # {0: 6, 1: 6, 2: 6, 3: 6}
    assert results == dict.fromkeys(range(4), 6)
