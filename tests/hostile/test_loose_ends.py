"""Loose ends of issue 24 that the other fixes found: each one line, never a traceback or a hang.

- The static rendezvous with a ``--master-addr`` this node cannot resolve (or, with port 0, bind).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import LeakCheck, pid_alive, relaunch_cli, wait_until

from relaunch.core.durations import seconds
from relaunch.endpoints import find_free_port
from relaunch.store.api import StoreError
from relaunch.store.client import TcpStore

pytestmark = pytest.mark.timeout(60)

#: A name that can never resolve (RFC 6761 reserves .invalid).
NOWHERE = "nonexistent.invalid"


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("relaunch: error:")]


def test_an_unresolvable_master_addr_of_one_node_is_one_line_at_once(
    tmp_path, leaks: LeakCheck
) -> None:
    job = tmp_path / "job.py"
    job.write_text("print('ran')\n")
    began = time.monotonic()
    done = relaunch_cli(leaks, "--nnodes", "1", "--master-addr", NOWHERE, str(job), timeout=30)
    took = time.monotonic() - began
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "ran" not in done.stdout
    (line,) = _error_lines(done.stderr)
    assert NOWHERE in line and "cannot be resolved" in line, line
    assert took < 15, took


def test_an_unresolvable_master_addr_of_several_nodes_is_said_at_once_then_waited_for(
    tmp_path, leaks: LeakCheck
) -> None:
    """A cluster's DNS may publish the master's name after this node starts: said in one line
    at once, waited for up to join_timeout, then one error line. The workers never start."""
    job = tmp_path / "job.py"
    job.write_text("print('ran')\n")
    began = time.monotonic()
    done = relaunch_cli(
        leaks,
        *("--nnodes", "2", "--node-rank", "0", "--master-port", "29500"),
        *("--master-addr", NOWHERE, "--rdzv-conf", "join_timeout=2", str(job)),
        timeout=30,
    )
    took = time.monotonic() - began
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "ran" not in done.stdout
    waiting = [line for line in done.stderr.splitlines() if "waiting up to 2s" in line]
    assert len(waiting) == 1 and NOWHERE in waiting[0], done.stderr
    (line,) = _error_lines(done.stderr)
    assert NOWHERE in line and "cannot be resolved" in line and "within 2s" in line, line
    assert 1.5 < took < 15, took


def test_a_master_addr_not_of_this_machine_with_port_0_is_one_line(
    tmp_path, leaks: LeakCheck
) -> None:
    job = tmp_path / "job.py"
    job.write_text("print('ran')\n")
    # TEST-NET-1 (RFC 5737): resolvable, and never an address of this machine.
    done = relaunch_cli(leaks, "--nnodes", "1", "--master-addr", "192.0.2.1", str(job), timeout=30)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = _error_lines(done.stderr)
    assert "192.0.2.1" in line and "free port" in line, line


def test_a_c10d_endpoint_that_cannot_be_resolved_is_said_at_once_then_waited_for(
    tmp_path, leaks: LeakCheck
) -> None:
    job = tmp_path / "job.py"
    job.write_text("print('ran')\n")
    began = time.monotonic()
    done = relaunch_cli(
        leaks,
        *("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-id", "j"),
        *("--rdzv-endpoint", f"{NOWHERE}:29400", "--rdzv-conf", "join_timeout=2,token=t"),
        str(job),
        timeout=30,
    )
    took = time.monotonic() - began
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    waiting = [line for line in lines if "waiting" in line]
    assert len(waiting) == 1 and "cannot be resolved yet" in waiting[0], done.stderr
    (error,) = _error_lines(done.stderr)
    assert NOWHERE in error and "cannot resolve" in error and "within 2s" in error, error
    assert lines == [*waiting, error], done.stderr
    assert 1.5 < took < 15, took


def test_a_c10d_store_that_does_not_answer_is_waited_for_once_then_one_line(
    tmp_path, leaks: LeakCheck
) -> None:
    job = tmp_path / "job.py"
    job.write_text("print('ran')\n")
    port = find_free_port("127.0.0.1")  # nothing listens there, and this node does not host
    began = time.monotonic()
    done = relaunch_cli(
        leaks,
        *("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-id", "j"),
        *("--rdzv-endpoint", f"127.0.0.1:{port}"),
        *("--rdzv-conf", "is_host=false,join_timeout=3,token=t", str(job)),
        timeout=30,
    )
    took = time.monotonic() - began
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    waiting = [line for line in lines if "waiting" in line]
    assert len(waiting) == 1 and f"127.0.0.1:{port}" in waiting[0], done.stderr
    assert "up to 3s" in waiting[0], waiting
    (error,) = _error_lines(done.stderr)
    assert f"127.0.0.1:{port}" in error and "within 3s" in error, error
    assert lines == [*waiting, error], done.stderr
    assert 2.5 < took < 15, took


@pytest.mark.parametrize(
    "value, shown",
    [(1.49274, "1.5s"), (0.2, "0.2s"), (0.0123, "0.012s"), (600.0, "600s"), (1e6, "1000000s")],
)
def test_durations_are_shown_rounded(value: float, shown: str) -> None:
    assert seconds(value) == shown


def test_the_store_clients_timeouts_are_shown_rounded() -> None:
    port = find_free_port("127.0.0.1")  # nothing listens there
    with pytest.raises(StoreError) as caught:
        TcpStore("127.0.0.1", port, connect_timeout=0.3 + 1 / 7)
    assert "within 0.44s" in str(caught.value), caught.value


@pytest.mark.parametrize("stderr", ["/dev/full", "closed pipe"])
@pytest.mark.parametrize("code", [0, 3])
def test_a_stderr_that_takes_nothing_changes_nothing(
    tmp_path, leaks: LeakCheck, stderr: str, code: int
) -> None:
    """The console event handler and the run summary write to stderr: a full device or a
    closed pipe there must not crash the agent nor change its exit status."""
    job = tmp_path / "job.py"
    pids = tmp_path / "pids"
    pids.mkdir()
    job.write_text(
        "import os, sys\n"
        f"open(os.path.join({str(pids)!r}, str(os.getpid())), 'w').close()\n"
        "print('to stderr', file=sys.stderr)\n"
        f"sys.exit({code})\n"
    )
    argv = [sys.executable, "-m", "relaunch", "--event-log-handler", "console"]
    argv += ["--nproc-per-node", "2", "--tee", "3", str(job)]
    if stderr == "/dev/full":
        with open("/dev/full", "w") as full:
            done = subprocess.run(
                argv, stdout=subprocess.DEVNULL, stderr=full, env=leaks.process_env(), timeout=30
            )
        returncode = done.returncode
    else:
        agent = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=leaks.process_env()
        )
        assert agent.stderr is not None
        agent.stderr.close()
        returncode = agent.wait(30)
    assert returncode == (0 if code == 0 else 1)
    # Both ran; when one fails first, the other may be stopped before it wrote its pid.
    ran = os.listdir(pids)
    assert len(ran) == 2 if code == 0 else ran
    for pid in os.listdir(pids):
        wait_until(lambda pid=pid: not pid_alive(int(pid)), 5, f"worker {pid} to be gone")


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    "name",
    sorted(
        path.name
        for path in EXAMPLES.glob("*.py")
        if any(word in path.read_text() for word in ("gloo", "DDP", "ddp"))
    ),
)
def test_every_gloo_example_leaves_its_process_group_before_it_exits(name: str) -> None:
    """A gloo group left up is torn down at interpreter exit, where its threads may abort the
    rank with "terminate called without an active exception" (issue 24): each example's
    worker ends by destroying it (accelerate's end_training does)."""
    tree = ast.parse((EXAMPLES / name).read_text())
    called = {
        node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
    }
    assert called & {"destroy_process_group", "end_training"}, name
