"""A test run leaves nothing in /tmp: the session's ``TMPDIR`` is under pytest's basetemp
(tests/conftest.py), and a launcher a test starts puts its output there."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from conftest import relaunch_cli

from tests.support import tmpdir
from tests.support.procs import LeakCheck


def test_the_session_temporary_directory_is_under_pytests_basetemp(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    here = Path(tempfile.gettempdir())
    assert os.environ["TMPDIR"] == str(here)
    assert here.is_relative_to(tmp_path_factory.getbasetemp())


def _holds(directory: str, run_id: str) -> bool:
    """Whether ``directory`` has an entry made for the run ``run_id`` (``{run_id}_XXXXXXXX``)."""
    try:
        return any(name.startswith(run_id) for name in os.listdir(directory))
    except OSError:
        return False


def test_a_launcher_run_leaves_nothing_in_the_original_tmp(
    tmp_path: Path, leaks: LeakCheck
) -> None:
    job = tmp_path / "job.py"
    job.write_text("pass\n")
    session, original = tempfile.gettempdir(), tmpdir.original()
    assert session != original
    session_before = tmpdir.launcher_names(session)
    original_before = tmpdir.launcher_names(original)

    done = relaunch_cli(leaks, "--standalone", "--nproc-per-node", "2", str(job))

    assert done.returncode == 0, done.stderr
    made = tmpdir.launcher_names(session) - session_before
    log_dirs = [name for name in made if name.startswith("relaunch_")]
    assert len(log_dirs) == 1, f"the run's log directory is not in {session}: {sorted(made)}"
    runs = os.listdir(os.path.join(session, log_dirs[0]))
    assert len(runs) == 1, runs
    run_id = runs[0].rsplit("_", 1)[0]
    # Other processes on the machine may add to /tmp meanwhile: only this run's names count.
    new = tmpdir.launcher_names(original) - original_before
    ours = [name for name in new if _holds(os.path.join(original, name), run_id)]
    assert not ours, f"the run left {ours} in {original}"
