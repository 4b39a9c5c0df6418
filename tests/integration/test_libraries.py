"""Real training libraries under relaunch: PyTorch Lightning, transformers' Trainer, accelerate.

The jobs are the examples ``examples/lightning_ddp.py``, ``examples/transformers_trainer.py``
and ``examples/accelerate_loop.py``: two CPU workers over gloo, seeded synthetic data, a
checkpoint after every epoch by the library's own mechanism, and a resume from it at start-up.
Each prints ``rank R/W local L`` from the library's own view of its ranks and, on rank 0, the
SHA-256 of its final weights, so that two runs compare bit for bit without loading them here.

The failure-free run of each library under relaunch is done once (``clean``) and reused: the
run under torchrun (Lightning only, to keep CI time down) and the run with a SIGKILLed worker
must both end with its weights. It is tee'd to a pipe (``--tee 3``, as a CI log is), whose
console is checked for bar refreshes, and made through tests/hostile/test_gloo_exit.py's driver,
which checks that each rank frees its gloo group at ``destroy_process_group``: one run of each
library for all three checks.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from conftest import LeakCheck

from tests.support.gloo_exit import check_freed, write_driver

# Two workers importing a training library keep both cores busy: one job at a time.
pytestmark = pytest.mark.xdist_group("torch")

EXAMPLES = pathlib.Path(__file__).parents[2] / "examples"
RUN_TIMEOUT = 180  # seconds for one job; each takes 10-25 s on an idle 2-core machine
ONE_JOB = RUN_TIMEOUT + 60
TWO_JOBS = 2 * RUN_TIMEOUT + 60


@dataclass(frozen=True)
class Example:
    script: str
    # the checkpoint a run killed at the start of epoch 2 resumes from, relative to its OUTDIR
    resumes_from: str


LIBRARIES = {
    "lightning": Example("lightning_ddp.py", "checkpoints/last.ckpt"),
    # 128 samples, 2 ranks, 8 a batch: 8 steps an epoch
    "transformers": Example("transformers_trainer.py", "checkpoint-16"),
    "accelerate": Example("accelerate_loop.py", "checkpoints/epoch_2"),
}
# Compared with torchrun too. The other two are compared with relaunch's failure-free run only:
# torchrun takes some 3 s more to start and the job as long again, for each library.
WITH_TORCHRUN = ["lightning"]
KILL_AT = "1:2"  # rank 1 SIGKILLs itself at the start of epoch 2, after 2 checkpoints
# A piped console tee'd by relaunch (a CI log, `--tee 3`) should get the examples' own lines, the
# libraries' start-up notices and relaunch's summary: no bar refreshes, at most a bar line a
# second. Without --tee the workers' bytes reach the pipe exactly as written, refreshes included
# (tests/hostile/test_output_bytes.py), as under torchrun.
MAX_PIPED_LINES = 50

RANK_LINE = re.compile(r"rank (\d+)/(\d+) local (\d+)")
DIGEST_LINE = re.compile(r"final weights sha256 ([0-9a-f]{64})")
RESUMED_LINE = re.compile(r"resumed from (\S+)")


def require(library: str) -> None:
    """Skip when ``library`` is not installed. Unlike pytest.importorskip this does not import
    it here, which would cost this process seconds (Lightning: 6 s) for nothing."""
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed: `pip install -e '.[test]'` installs it")


@dataclass
class Run:
    """A finished job, its console captured through pipes, as bytes (``\\r`` kept)."""

    returncode: int
    stdout: bytes
    stderr: bytes
    outdir: pathlib.Path
    seconds: float

    @property
    def out(self) -> str:
        return self.stdout.decode(errors="replace")

    @property
    def err(self) -> str:
        return self.stderr.decode(errors="replace")

    def ranks(self) -> list[tuple[int, int, int]]:
        """(rank, world size, local rank) of every ``rank R/W local L`` line, in order."""
        return [(int(r), int(w), int(local)) for r, w, local in RANK_LINE.findall(self.out)]

    def digest(self) -> str:
        digests = DIGEST_LINE.findall(self.out)
        assert len(digests) == 1, f"one digest expected:\n{self.out}\n{self.err}"
        return str(digests[0])

    def describe(self) -> str:
        return f"exit {self.returncode} after {self.seconds:.1f}s\n{self.out}\n{self.err}"


def console_counts(run: Run) -> tuple[int, int]:
    """How many lines and how many carriage returns the piped console got (stdout + stderr)."""
    console = run.stdout + run.stderr
    return console.count(b"\n"), console.count(b"\r")


def run_job(
    launcher: list[str], library: str, outdir: pathlib.Path, leaks: LeakCheck, **env: str
) -> Run:
    """``launcher`` (relaunch or torchrun and their flags) running ``library``'s example."""
    outdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    done = subprocess.run(
        [*launcher, str(EXAMPLES / LIBRARIES[library].script), str(outdir)],
        capture_output=True,
        cwd=outdir,
        env=leaks.process_env(OMP_NUM_THREADS="1", **env),
        timeout=RUN_TIMEOUT,
    )
    return Run(done.returncode, done.stdout, done.stderr, outdir, time.monotonic() - started)


def relaunch(max_restarts: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "relaunch",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(max_restarts),
    ]


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Run]:
    """The failure-free run of a library's example under relaunch, done once and shared."""
    runs: dict[str, Run] = {}

    def get(library: str) -> Run:
        if library not in runs:
            check = LeakCheck()
            outdir = tmp_path_factory.mktemp(f"clean-{library}")
            driver = write_driver(tmp_path_factory.mktemp(f"driver-{library}"))
            runs[library] = run_job(
                [*relaunch(0), "--tee", "3", str(driver)], library, outdir, check
            )
            left = check.collect(5.0)
            assert not left, "processes left behind (killed): " + "; ".join(left)
        return runs[library]

    return get


@pytest.mark.timeout(ONE_JOB)
@pytest.mark.parametrize("library", LIBRARIES)
def test_both_ranks_train_to_the_end_under_relaunch(
    library: str, clean: Callable[[str], Run]
) -> None:
    require(library)
    run = clean(library)
    print(f"{library} under relaunch: {run.seconds:.1f}s")
    assert run.returncode == 0, run.describe()
    assert sorted(run.ranks()) == [(0, 2, 0), (1, 2, 1)], run.describe()
    assert "[default0]:finished" in run.out.splitlines(), run.describe()  # tee'd: prefixed
    assert re.search(r"succeeded in \S+s\n", run.err), "relaunch's summary says it succeeded"
    assert (run.outdir / "weights.pt").is_file()
    assert (run.outdir / LIBRARIES[library].resumes_from).exists(), "it checkpointed"
    assert not RESUMED_LINE.search(run.out), "a fresh run starts from scratch"
    run.digest()


@pytest.mark.timeout(TWO_JOBS)
@pytest.mark.parametrize("library", WITH_TORCHRUN)
def test_torchrun_ends_with_the_same_weights(
    library: str, clean: Callable[[str], Run], leaks: LeakCheck, tmp_path: pathlib.Path
) -> None:
    require(library)
    reference = run_job(TORCHRUN, library, tmp_path / "torchrun", leaks)
    lines, returns = console_counts(reference)
    print(
        f"{library} under torchrun: {reference.seconds:.1f}s, piped: {lines} lines, {returns} \\r"
    )
    assert reference.returncode == 0, reference.describe()
    assert sorted(reference.ranks()) == [(0, 2, 0), (1, 2, 1)], reference.describe()
    run = clean(library)
    assert run.returncode == 0, run.describe()
    assert run.digest() == reference.digest(), "relaunch and torchrun end with the same weights"


@pytest.mark.timeout(TWO_JOBS)
@pytest.mark.parametrize("library", LIBRARIES)
def test_a_killed_worker_restarts_the_group_which_resumes_to_the_same_weights(
    library: str, clean: Callable[[str], Run], leaks: LeakCheck, tmp_path: pathlib.Path
) -> None:
    require(library)
    # Both attempts' workers fork from a zygote that imported torch once (--preload): two
    # imports of it fewer than four; each worker imports its library as a cold one does.
    launcher = [*relaunch(1), "--preload", "torch"]
    run = run_job(launcher, library, tmp_path / "killed", leaks, KILL_RANK_AT=KILL_AT)
    print(f"{library} under relaunch with a killed worker: {run.seconds:.1f}s")
    assert run.returncode == 0, run.describe()
    assert "rank 1: killing myself at epoch 2" in run.out, run.describe()
    assert "restart 1: rank 1 killed by SIGKILL" in run.err, run.describe()
    assert sorted(run.ranks()) == [(0, 2, 0), (0, 2, 0), (1, 2, 1), (1, 2, 1)], "two attempts"
    resumed = RESUMED_LINE.findall(run.out)
    assert resumed == [str(run.outdir / LIBRARIES[library].resumes_from)], run.describe()
    assert "finished" in run.out.splitlines(), run.describe()
    reference = clean(library)
    assert reference.returncode == 0, reference.describe()
    assert run.digest() == reference.digest(), "the resumed run ends with the same weights"


@pytest.mark.timeout(ONE_JOB)
@pytest.mark.parametrize("library", LIBRARIES)
def test_the_piped_teed_console_gets_no_bar_refresh(
    library: str, clean: Callable[[str], Run]
) -> None:
    require(library)
    run = clean(library)
    lines, returns = console_counts(run)
    print(f"{library} under relaunch, piped: {lines} lines, {returns} \\r")
    assert run.returncode == 0, run.describe()
    assert returns == 0, f"{returns} carriage returns reached the piped console"
    assert lines <= MAX_PIPED_LINES, f"{lines} lines reached the piped console"


# tests/hostile/test_gloo_exit.py checks train_ddp.py; Lightning's own teardown drops its DDP
# wrapper (the check holds for its example too, at no cost: the run is made anyway).
@pytest.mark.timeout(ONE_JOB)
@pytest.mark.parametrize("library", LIBRARIES)
def test_a_gloo_example_frees_its_group_at_destroy_process_group(
    library: str, clean: Callable[[str], Run]
) -> None:
    require(library)
    run = clean(library)
    assert run.returncode == 0, run.describe()
    check_freed(run.out + run.err)
