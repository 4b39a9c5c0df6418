"""A full disk under the event log (a tiny tmpfs this test mounts, as root): no thread dies, the
agent does not crash, the file and the cause are said once, and the job goes on."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from conftest import LeakCheck, tmpfs

from relaunch.events import Event, EventSource, JsonLinesEventHandler

pytestmark = pytest.mark.timeout(60)


@contextlib.contextmanager
def full_tmpfs(path: str) -> Iterator[str]:
    """A 16 KiB tmpfs at ``path``, filled up by ``path/filler``; unmounted after."""
    with tmpfs(path, "size=16k"):
        filler = os.open(os.path.join(path, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            with contextlib.suppress(OSError):
                while os.write(filler, b"\0" * 4096):
                    pass
        finally:
            os.close(filler)
        yield path


def test_a_full_disk_under_the_event_log_is_said_once_and_the_log_resumes(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    with full_tmpfs(str(tmp_path / "disk")) as disk:
        path = os.path.join(disk, "events.jsonl")
        handler = JsonLinesEventHandler(path)
        with caplog.at_level(logging.WARNING, logger="relaunch.events"):
            for i in range(50):
                handler.record(Event(name=f"lost{i}", source=EventSource.AGENT))  # never raises
            os.truncate(os.path.join(disk, "filler"), 0)  # room again
            handler.record(Event(name="back", source=EventSource.AGENT))
            handler.close()
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 2, said
        assert said[0].startswith(f"cannot write {path} (No space left on device)")
        assert said[1] == f"{path}: writing again (50 lines lost)"
        with open(path) as log:
            lines = log.read().splitlines()
    assert json.loads(lines[-1])["name"] == "back"  # whole, on a line of its own


def test_the_agent_runs_on_when_its_event_log_disk_is_full(tmp_path, leaks: LeakCheck) -> None:
    job = tmp_path / "job.py"
    job.write_text("print('done')\n")
    with full_tmpfs(str(tmp_path / "disk")) as disk:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "relaunch",
                "--nproc-per-node",
                "2",
                "--tee",
                "1",
                "--event-log-handler",
                f"file:{disk}/events.jsonl",
                str(job),
            ],
            capture_output=True,
            text=True,
            env=leaks.process_env(),
            timeout=30,
        )
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["[default0]:done", "[default1]:done"]
    assert "Traceback" not in done.stderr
    said = [line for line in done.stderr.splitlines() if "events.jsonl" in line]
    assert said == [
        f"relaunch: cannot write {disk}/events.jsonl (No space left on device): its lines are "
        "dropped until it can be written again; the job goes on"
    ]
