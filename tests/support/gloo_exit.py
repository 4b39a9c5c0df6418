"""The check of tests/hostile/test_gloo_exit.py (issue 24): a gloo example run as __main__ by a
driver that wraps ``destroy_process_group`` to fail the rank if a DDP wrapper is still alive, or
if the group outlives it (its gloo threads still run). Shared with tests/integration/
test_libraries.py, whose failure-free run of each library is made through the driver."""

from __future__ import annotations

import pathlib

# Runs the example as __main__, with destroy_process_group checked first.
DRIVER = """\
import gc, os, runpy, sys
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

destroy = dist.destroy_process_group

def checked_destroy(*args, **kwargs):
    gc.collect()
    alive = sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
    if alive:
        raise SystemExit(f"DDP wrapper alive at destroy_process_group: {alive}")
    print("no DDP wrapper at destroy_process_group", flush=True)
    destroy(*args, **kwargs)
    left = []
    for thread in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{thread}/comm") as comm:
            name = comm.read().strip()
        if "gloo" in name:
            left.append(name)
    if left:
        raise SystemExit(f"the group outlived destroy_process_group: {sorted(left)} still run")
    print("the group freed by destroy_process_group", flush=True)

dist.destroy_process_group = checked_destroy
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def write_driver(directory: pathlib.Path) -> pathlib.Path:
    """The driver, written in ``directory``: ``python DRIVER SCRIPT ARGS...`` runs SCRIPT."""
    driver = directory / "gloo_exit_driver.py"
    driver.write_text(DRIVER)
    return driver


def check_freed(console: str, ranks: int = 2) -> None:
    """Every one of ``ranks`` ranks let its DDP wrapper go and freed its group at
    ``destroy_process_group``, as ``console`` (the run's stdout and stderr) says."""
    assert "DDP wrapper alive" not in console, console
    assert console.count("no DDP wrapper at destroy_process_group") == ranks, console
    assert console.count("the group freed by destroy_process_group") == ranks, console
