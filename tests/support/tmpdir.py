"""The test session's temporary directory: ``TMPDIR`` under pytest's basetemp, for this process
and every process it starts, so a test run leaves its launchers' output (log directories, timer
FIFOs, torch's and multiprocessing's files) under pytest's tmp and nothing in ``/tmp``.

tests/conftest.py calls ``use`` from ``pytest_configure``, before any test is collected; under
pytest-xdist each worker does so with its own basetemp. Standard library only.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

#: The names of what relaunch (and torch, which it stands in for) makes in a temporary
#: directory: a new one of these in the original ``/tmp`` during a test is a leak.
MADE_BY_LAUNCHERS = ("relaunch_", "relaunch-", "torchelastic_", "compat-")

_original: dict[str, str | None] = {}


def use(basetemp: Path) -> Path:
    """Make ``basetemp/tmp`` the temporary directory of this process and its children."""
    path = basetemp / "tmp"
    path.mkdir(exist_ok=True)
    if not _original:
        _original.update(env=os.environ.get("TMPDIR"), gettempdir=tempfile.gettempdir())
    os.environ["TMPDIR"] = str(path)
    tempfile.tempdir = str(path)  # gettempdir() caches its first answer
    return path


def restore() -> None:
    """Give back the temporary directory this process had before ``use``."""
    if not _original:
        return
    if _original["env"] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = _original["env"]
    tempfile.tempdir = None
    _original.clear()


def original() -> str:
    """The temporary directory the session would have used (``/tmp`` as a rule)."""
    return _original.get("gettempdir") or tempfile.gettempdir()


def launcher_names(directory: str) -> set[str]:
    """The entries of ``directory`` named as launchers name what they make."""
    try:
        names = os.listdir(directory)
    except OSError:
        return set()
    return {name for name in names if name.startswith(MADE_BY_LAUNCHERS)}
