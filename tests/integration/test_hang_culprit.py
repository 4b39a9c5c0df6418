"""A hang's culprit named from every rank's stack (``core.run.culprit``, ``agent.culprit``): the
rank the others wait for is the report's root cause, on every node, with its frame; the summary
and a ``CULPRIT`` status event carry it. Workers: ``culprit_worker.py`` (torch's gloo, plain
Python) and a binary, which gives no Python stack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LeakCheck, relaunch_cli

from relaunch.endpoints import find_free_port

WORKER = str(Path(__file__).parent / "culprit_worker.py")
LOADER = "it is in load_next_batch (culprit_worker.py:20)"


def root_cause(stderr: str) -> str:
    """The report's root-cause line."""
    (line,) = [line for line in stderr.splitlines() if line.startswith("Root cause")]
    return line


@pytest.mark.xdist_group("torch")
@pytest.mark.timeout(90)
def test_the_rank_the_gloo_ranks_wait_for_is_the_root_cause(tmp_path, leaks: LeakCheck) -> None:
    pytest.importorskip("torch")
    events = tmp_path / "events.jsonl"
    done = relaunch_cli(
        leaks,
        *("--standalone", "--nproc-per-node", "4", "--hang-timeout", "3"),
        # torch loaded once, before the workers start (seconds on a loaded machine, holding the
        # GIL: no sign of life meanwhile), by the zygote they fork from
        *("--preload", "torch.distributed", "--event-log-handler", f"file:{events}"),
        *(WORKER, "all_reduce", "2"),
        timeout=80,
    )
    assert done.returncode == 1, done.stderr
    said = "rank 2 did not reach the collective that ranks 0, 1, 3 wait in (all_reduce): " + LOADER
    assert root_cause(done.stderr) == f"Root cause (a hang, from every rank's stack): {said}"
    after = done.stderr[done.stderr.index("Root cause") :].splitlines()
    assert after[1].startswith("  rank 2 (local_rank 2,"), "the culprit's own failure, its stack"
    assert f"  hang: {said}" in done.stderr  # the run summary
    lines = [json.loads(line)["metadata"] for line in events.read_text().splitlines()]
    (culprit,) = [metadata for metadata in lines if metadata["state"] == "CULPRIT"]
    assert culprit["raw_error"] == said
    details = json.loads(culprit["metadata"])
    assert details["culprit"] == {"ranks": [2], "kind": "culprit"}


@pytest.mark.timeout(60)
def test_every_node_names_the_culprit_on_the_other_node(tmp_path, leaks: LeakCheck) -> None:
    """Two nodes of two plain-Python ranks on the built-in store: rank 2, on the second node,
    is in its loader while the others wait on a socket; both reports name it."""
    port = find_free_port()
    argv = [
        *(sys.executable, "-m", "relaunch", "--nnodes", "2", "--nproc-per-node", "2"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"),
        *("--rdzv-id", f"culprit-{port}", "--hang-timeout", "2"),
        *(WORKER, "socket", "2"),
    ]
    nodes = [
        subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=leaks.process_env()
        )
        for _ in range(2)
    ]
    try:
        errors = [node.communicate(timeout=50)[1] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.communicate()
    assert [node.returncode for node in nodes] == [1, 1], errors
    said = (
        "Root cause (a hang, from every rank's stack): rank 2 is not where ranks 0, 1, 3 wait, "
        f"in wait_on_socket (culprit_worker.py:57): {LOADER}"
    )
    assert [root_cause(stderr) for stderr in errors] == [said, said]
    elsewhere = [e for e in errors if "  not on this node: its report there shows the stack" in e]
    assert len(elsewhere) == 1, errors  # the node of ranks 0 and 1
    (here,) = [e for e in errors if e not in elsewhere]
    assert "\n  rank 2 (local_rank 0," in here


@pytest.mark.timeout(30)
def test_binary_workers_give_no_stack_and_the_report_says_so(tmp_path, leaks: LeakCheck) -> None:
    done = relaunch_cli(
        leaks,
        *("--standalone", "--nproc-per-node", "2", "--hang-timeout", "1"),
        *("--no-python", "sleep", "60"),
        timeout=25,
    )
    assert done.returncode == 1, done.stderr
    assert root_cause(done.stderr) == (
        "Root cause (a hang, from every rank's stack): no rank gave a Python stack "
        "(binary workers, or ranks that died before they could): relaunch cannot tell which "
        "rank the others wait for"
    )
