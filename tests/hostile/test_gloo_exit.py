"""A gloo example's rank must end once its training has (issue 24, "Also investigate").

Under load, ``examples/transformers_trainer.py`` sometimes never exited after training, under
torchrun as under relaunch (py-spy: the main thread in ``~ProcessGroupGloo`` joining gloo's
threads, called from the DDP ``Reducer``'s deallocation at the end of ``main()``, holding the
GIL; a gloo thread in ``~AsyncAllgatherWork`` waiting for the GIL to free a tensor). The
``Reducer`` holds the process group, and pybind frees it holding the GIL: when it outlives
``destroy_process_group`` it is the group's last holder, and the group's destructor deadlocks
with any gloo thread that still has a Python tensor to free. torch's own handles release the GIL
while they destroy the group, so an example must let its DDP wrapper go before it destroys the
group. The race needs a starved gloo thread, so it is not reproduced here; what makes it
possible is checked instead, deterministically: each example is run as relaunch runs it, with
``destroy_process_group`` wrapped to fail the rank if a DDP wrapper is still alive, or if the
group outlives it (its gloo threads still run: in torch 2.13, ``torch.distributed.nn`` binds the
default group into its functions' default arguments when imported after the group was made,
as building an optimizer does; those threads then run into the interpreter's exit).
"""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest
from conftest import LeakCheck

from tests.support.gloo_exit import check_freed, write_driver

pytestmark = pytest.mark.xdist_group("torch")

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
RUN_TIMEOUT = 180


@pytest.mark.timeout(RUN_TIMEOUT + 30)
# Only the transformers example was seen hanging: Lightning's own teardown drops its DDP wrapper
# (its example has the same shape, for consistency); one run of it would cost CI 20 s.
# train_ddp.py and accelerate_loop.py build their optimizers before their groups, which would
# otherwise outlive them; accelerate_loop.py lets its DDP wrapper go before end_training.
# The transformers and accelerate examples are checked by tests/integration/test_libraries.py,
# on the failure-free run it makes of each through the same driver (one run each, not two).
@pytest.mark.parametrize(
    ("library", "script", "args"),
    [("torch", "train_ddp.py", ["--steps", "3"])],
)
def test_a_gloo_example_frees_its_group_at_destroy_process_group(
    library: str, script: str, args: list[str], leaks: LeakCheck, tmp_path: pathlib.Path
) -> None:
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed")
    driver = write_driver(tmp_path)
    outdir = tmp_path / "out"
    outdir.mkdir()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "relaunch",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "0",
            "--tee",
            "3",
            str(driver),
            str(EXAMPLES / script),
            *(arg.format(out=outdir) for arg in args),
        ],
        capture_output=True,
        cwd=outdir,
        env=leaks.process_env(OMP_NUM_THREADS="1"),
        timeout=RUN_TIMEOUT,
    )
    console = (done.stdout + done.stderr).decode(errors="replace")
    assert "DDP wrapper alive" not in console, console
    assert done.returncode == 0, console
    check_freed(console)
