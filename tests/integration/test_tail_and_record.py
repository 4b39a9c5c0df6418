"""TailLog on real files and threads; @record writing real error files in real processes."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time

import pytest
from conftest import wait_until

from relaunch import TailLog

pytestmark = pytest.mark.timeout(30)


class Console(io.StringIO):
    """A text console the test can read while a tailer writes to it."""

    def lines(self) -> list[str]:
        return self.getvalue().splitlines()


def test_taillog_follows_files_created_after_start(tmp_path) -> None:
    paths = {0: str(tmp_path / "a.log"), 1: str(tmp_path / "b.log")}
    console = Console()
    tail = TailLog("trainer", paths, console, interval_sec=0.01).start()
    with open(paths[0], "w") as a:
        a.write("first\n")
        a.flush()
        wait_until(lambda: console.lines() == ["[trainer0]:first"], what="the first line")
        with open(paths[1], "w") as b:
            b.write("from b\npartial")
        a.write("second\n")
    wait_until(lambda: "[trainer1]:from b" in console.lines(), what="the second file")
    tail.stop()
    assert tail.stopped()
    lines = console.lines()
    assert lines.index("[trainer0]:first") < lines.index("[trainer0]:second")
    assert "[trainer1]:partial" in lines


def test_taillog_stop_returns_when_files_never_appear(tmp_path) -> None:
    tail = TailLog("w", {0: str(tmp_path / "never.log")}, Console(), interval_sec=10).start()
    stopper = threading.Thread(target=tail.stop)
    stopper.start()
    stopper.join(timeout=5)
    assert not stopper.is_alive() and tail.stopped()


def test_taillog_clears_the_progress_bar_before_each_line(tmp_path) -> None:
    path = tmp_path / "a.log"
    path.write_text("one\ntwo\n")
    events = {"trigger_clear": threading.Event(), "cleared": threading.Event()}
    seen_trigger = []

    def progress_bar() -> None:
        while events["trigger_clear"].wait(5):
            seen_trigger.append(True)
            events["cleared"].set()
            while events["trigger_clear"].is_set():
                time.sleep(0.001)
            events["cleared"].clear()
            return

    bar = threading.Thread(target=progress_bar)
    bar.start()
    console = Console()
    tail = TailLog("w", {0: str(path)}, console, interval_sec=0.01, progbar_events=events).start()
    wait_until(lambda: "two" in console.getvalue(), what="the lines")
    tail.stop()
    bar.join(5)
    assert seen_trigger
    assert console.getvalue() == "\r[w0]:one\033[K\n\r[w0]:two\033[K\n"
    assert not events["trigger_clear"].is_set()


def run_recorded(tmp_path, body: str) -> tuple[subprocess.CompletedProcess[str], str]:
    error_file = str(tmp_path / "error.json")
    code = f"import relaunch, sys\n@relaunch.record\ndef main():\n    {body}\nmain()\n"
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": error_file}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    return done, error_file


def test_record_writes_the_exception_and_reraises(tmp_path) -> None:
    done, error_file = run_recorded(tmp_path, "raise KeyError('missing-key')")
    assert done.returncode == 1
    assert "KeyError: 'missing-key'" in done.stderr
    with open(error_file) as file:
        data = json.load(file)
    assert data["message"]["message"] == "KeyError: 'missing-key'"
    assert "Traceback (most recent call last)" in data["message"]["extraInfo"]["py_callstack"]
    assert int(data["message"]["extraInfo"]["timestamp"]) > 0


def test_record_treats_exit_zero_as_success(tmp_path) -> None:
    done, error_file = run_recorded(tmp_path, "sys.exit(0)")
    assert done.returncode == 0 and not os.path.exists(error_file)
    done, error_file = run_recorded(tmp_path, "sys.exit(3)")
    assert done.returncode == 3 and not os.path.exists(error_file)
