"""How ``launch_agent`` ends, through relaunch beside torch 2.13, for a rendezvous backend the
user registered torch's way (a creator in the handler registry): the same program, imports
changed, run as a process of its own (``compat_launch_agent_fns.py``).

Stopped by a signal, torch's ``launch_agent`` does not call the handler's ``shutdown()``: that
would close the rendezvous for good and stop any later scaling. On success, and on any other
error, it does. ``TORCHELASTIC_SIGNALS_TO_HANDLE`` stays in ``os.environ`` after it returns.

relaunch's own backends are shut down on a signal too (their ``shutdown()`` leaves the round,
which the other nodes hear at once, and closes nothing for good): docs/python-api.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import pytest
from conftest import LeakCheck, wait_until

pytestmark = pytest.mark.xdist_group("torch")

pytest.importorskip("torch.distributed.launcher.api")

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, "compat_launch_agent_fns.py")


def launch(side: str, outcome: str, tmp_path: Any, leaks: LeakCheck) -> dict[str, Any]:
    """Run the program on ``side``; for ``outcome`` "wait", SIGTERM it once its worker runs.
    Its JSON line."""
    mark = tmp_path / f"{side}-{outcome}.started"
    env = leaks.process_env(
        PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]), TMPDIR=str(tmp_path)
    )
    env.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
    proc = subprocess.Popen(
        [sys.executable, PROGRAM, side, outcome, str(mark)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        if outcome == "wait":
            wait_until(lambda: mark.exists() or proc.poll() is not None, 60, "the worker")
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()  # ours, by pid; its worker carries the leak mark
            proc.wait()
    lines = out.strip().splitlines()
    assert lines, f"{side} printed nothing (exit {proc.returncode}): {err[-2000:]}"
    result: dict[str, Any] = json.loads(lines[-1])
    print(f"{side}, {outcome}: {result}")
    return result


#: ``launch``'s answers by side and outcome: each test below reads the same four runs (each a
#: process that imports torch), made once by whichever test asks first.
_LAUNCHED: dict[tuple[str, str], dict[str, Any]] = {}


def launched(side: str, outcome: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``launch(side, outcome)``'s answer, run once a session; its processes checked gone."""
    if (side, outcome) not in _LAUNCHED:
        leaks = LeakCheck()
        result = launch(side, outcome, tmp_path_factory.mktemp(f"{side}-{outcome}"), leaks)
        left = leaks.collect(5.0)
        assert not left, "processes left behind (killed): " + "; ".join(left)
        _LAUNCHED[(side, outcome)] = result
    return _LAUNCHED[(side, outcome)]


@pytest.mark.timeout(150)
def test_a_signal_does_not_shut_a_registered_handler_down_as_in_torch(tmp_path_factory) -> None:
    theirs = launched("torch", "wait", tmp_path_factory)
    mine = launched("relaunch", "wait", tmp_path_factory)
    assert theirs["ended"] == mine["ended"] == "SignalException(SIGTERM)"
    assert mine["shutdowns"] == theirs["shutdowns"] == 0


@pytest.mark.timeout(90)
def test_a_signal_still_shuts_relaunchs_own_handler_down(tmp_path, leaks) -> None:
    mine = launch("relaunch-c10d", "wait", tmp_path, leaks)
    assert mine["ended"] == "SignalException(SIGTERM)"
    assert mine["shutdowns"] == 1


@pytest.mark.timeout(150)
def test_a_run_that_ends_shuts_the_handler_down_once_as_in_torch(tmp_path_factory) -> None:
    theirs = launched("torch", "succeed", tmp_path_factory)
    mine = launched("relaunch", "succeed", tmp_path_factory)
    assert theirs["ended"] == mine["ended"] == "returned"
    assert mine["shutdowns"] == theirs["shutdowns"] == 1


@pytest.mark.timeout(150)
def test_signals_to_handle_stays_in_the_environment_as_in_torch(tmp_path_factory) -> None:
    """What torch leaves after ``launch_agent`` returns, and after a signal stopped it."""
    for outcome in ("succeed", "wait"):
        theirs = launched("torch", outcome, tmp_path_factory)
        mine = launched("relaunch", outcome, tmp_path_factory)
        key = "TORCHELASTIC_SIGNALS_TO_HANDLE"
        assert mine[key] == theirs[key] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT", outcome
