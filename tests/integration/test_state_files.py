"""The slot files of kept state under a real SIGKILL: a save cut short never damages the save
before it (``relaunch.state``)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import LeakCheck, wait_until

import relaunch
from relaunch.core import state as layout
from relaunch.state import api as state_api

SAVER = textwrap.dedent(
    """
    import os, sys
    import relaunch
    step = 0
    while True:
        # 8 MiB of the step's byte: a save torn anywhere would mix two steps' bytes.
        relaunch.save_state({"step": step, "data": bytes([step % 251]) * (8 << 20)}, step)
        if step == 3:
            open(sys.argv[1], "w").close()
        step += 1
    """
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("delay", [0.0, 0.003, 0.011, 0.023, 0.037])
def test_a_save_killed_midway_leaves_the_previous_state_whole(
    tmp_path: pathlib.Path, leaks: LeakCheck, delay: float
) -> None:
    directory = tmp_path / "state"
    directory.mkdir()
    os.mkfifo(directory / layout.SAVED_FIFO)
    reader = os.open(directory / layout.SAVED_FIFO, os.O_RDWR | os.O_NONBLOCK)
    ready = tmp_path / "ready"
    env = {
        **leaks.process_env(),
        layout.STATE_DIR_ENV: str(directory),
        "RANK": "0",
        "LOCAL_RANK": "0",
    }
    saver = subprocess.Popen([sys.executable, "-c", SAVER, str(ready)], env=env)
    try:
        wait_until(ready.exists, 30)
        time.sleep(delay)  # the kill's moment, varied: not a wait for a condition
        saver.send_signal(signal.SIGKILL)
        saver.wait(10)
    finally:
        os.close(reader)
    heads = {
        slot: layout.read_header((directory / layout.slot_name(0, slot)).read_bytes()[:64])
        for slot in layout.SLOTS
    }
    steps = sorted(head.step for head in heads.values() if head is not None)
    assert steps and steps[-1] >= 3
    for step in steps:  # every committed slot loads whole, with its own step's bytes
        os.environ.update({k: v for k, v in env.items() if k != "PATH"})
        os.environ[layout.STATE_STEP_ENV] = str(step)
        try:
            loaded = relaunch.load_state()
        finally:
            for name in (layout.STATE_DIR_ENV, layout.STATE_STEP_ENV, "RANK", "LOCAL_RANK"):
                os.environ.pop(name, None)
        assert loaded is not None
        assert loaded[0] == step and loaded[1]["step"] == step
        assert loaded[1]["data"] == bytes([step % 251]) * (8 << 20)


@pytest.mark.timeout(60)
def test_a_loaded_state_is_the_workers_own_memory(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor ``load_state`` gives is in memory of the worker's own, filled when loaded:
    saving over both slots afterwards does not change it, and writing it does not change the
    kept state."""
    torch = pytest.importorskip("torch")
    directory = tmp_path / "state"
    directory.mkdir()
    for name, value in {
        layout.STATE_DIR_ENV: str(directory),
        "RANK": "0",
        "LOCAL_RANK": "0",
        layout.STATE_STEP_ENV: "1",
    }.items():
        monkeypatch.setenv(name, value)
    large = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: a part mapped of its own
    try:
        relaunch.save_state({"weight": large, "small": torch.ones(4)}, 1)
        loaded = relaunch.load_state()
        assert loaded is not None
        weight = loaded[1]["weight"]
        assert torch.equal(weight, large) and torch.equal(loaded[1]["small"], torch.ones(4))
        for step in (2, 3):  # both slots written again, one of them the one just loaded
            relaunch.save_state({"weight": torch.full((1 << 20,), float(step))}, step)
        assert torch.equal(weight, large)
        weight.add_(1)  # writable, and the worker's alone
        monkeypatch.setenv(layout.STATE_STEP_ENV, "3")
        again = relaunch.load_state()
        assert again is not None and bool((again[1]["weight"] == 3).all())
    finally:  # this test process is the worker: its slot files closed, as at a worker's exit
        for writer in state_api._slots.values():
            writer.close()
            os.close(writer.fd)
        state_api._forget()
