"""A worker that only reports progress loads the channel, not the launcher: which modules load."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import relaunch
from relaunch.core import channel
from relaunch.core.workers.progress import read_progress

#: Run without site (-S), so nothing a site hook imports hides what relaunch imports; relaunch is
#: found on PYTHONPATH, the same copy this test imported.
SRC = str(pathlib.Path(relaunch.__file__).resolve().parents[1])

#: What ``import relaunch`` must not load for a worker (the agent side and its imports).
AGENT_SIDE = (
    "relaunch.procs",
    "relaunch.agent",
    "relaunch.rendezvous",
    "relaunch.store",
    "relaunch.cli",
    "relaunch.launcher",
)
#: Standard modules that cost a worker milliseconds and that the channel does not need.
COSTLY = ("dataclasses", "enum", "logging", "json", "typing", "inspect", "tempfile")


def _modules_after(code: str, **env: str) -> list[str]:
    """The modules a fresh interpreter (no site) holds after running ``code``."""
    probe = (
        f"{code}\nimport sys\nloaded = sorted(sys.modules)\nimport json\nprint(json.dumps(loaded))"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": SRC, **env},
    )
    return list(json.loads(out.stdout.splitlines()[-1]))


def _loaded(modules: list[str], names: tuple[str, ...]) -> list[str]:
    return [m for m in modules if any(m == n or m.startswith(n + ".") for n in names)]


def test_the_worker_calls_load_only_the_channel(tmp_path) -> None:
    # A channel file as the agent makes it, so the worker maps it and writes its slot.
    path = tmp_path / "channel"
    buffer = bytearray(channel.size(1))
    channel.HEADER_STRUCT.pack_into(buffer, 0, channel.MAGIC, 0, 1)
    path.write_bytes(buffer)
    modules = _modules_after(
        "import relaunch\nrelaunch.report_progress(7, 10, 'x')\nrelaunch.stop_requested()\n"
        "relaunch.heartbeat()\nwith relaunch.section('step', timeout=3):\n    pass",
        **{channel.CHANNEL_ENV: str(path), "LOCAL_RANK": "0"},
    )
    progress = read_progress(path.read_bytes(), 0)
    assert progress is not None and (progress.step, progress.total) == (7, 10)
    assert _loaded(modules, AGENT_SIDE) == []
    assert _loaded(modules, COSTLY) == []
    assert [m for m in modules if m.startswith("relaunch")] == [
        "relaunch",
        "relaunch.core",
        "relaunch.core.channel",
        "relaunch.core.sections",
        "relaunch.worker",
    ]


def test_from_import_of_the_worker_names_loads_no_agent_side() -> None:
    modules = _modules_after("from relaunch import report_progress, stop_requested")
    assert _loaded(modules, AGENT_SIDE) == []


def test_every_public_name_still_imports() -> None:
    code = f"from relaunch import {', '.join(relaunch.__all__)}"
    modules = _modules_after(code)
    assert "relaunch.agent" in modules and "relaunch.procs" in modules


def test_names_load_on_first_use_and_dir_lists_them() -> None:
    assert set(relaunch.__all__) <= set(dir(relaunch))
    assert relaunch.procs.record is relaunch.record
    assert relaunch.report_progress is relaunch.worker.report_progress
    try:
        relaunch.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("an unknown name must raise AttributeError")
