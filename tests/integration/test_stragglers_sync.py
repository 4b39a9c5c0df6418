"""Stragglers of synchronous training (docs/resilience.md): two agents on loopback (c10d) of two
gloo ranks each, an ``all_reduce`` every step, node 1 computing five times slower inside
``relaunch.section("compute")``. Every rank steps at the same pace (no rank is below the median
rate), yet node 1 is flagged with its ranks: on both consoles, in ``relaunch status``, in the
status events, in the metrics and in the run summary. The workers are forked from a zygote
that imported torch once a node (``--preload torch``): half the imports of four. (A slow rank
of asynchronous work, flagged by its rate, is test_resilience.py's
``test_a_slow_rank_among_four_over_two_nodes``.)
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import urllib.request

import pytest
from conftest import LeakCheck, LinesRead, wait_until

from relaunch.endpoints import find_free_port

WORKER = str(pathlib.Path(__file__).parents[2] / "benchmarks" / "workers" / "sync_slow_node.py")
FLAG = "(node 1, ranks 2-3) is a straggler: 'compute' takes "


def _scrape(port: int) -> dict[str, float]:
    """``relaunch_rank_straggler`` of each rank an agent serves."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    flags = {}
    for line in text.splitlines():
        if line.startswith("relaunch_rank_straggler{"):
            labels, value = line.rsplit(" ", 1)
            rank = labels.split(',rank="', 1)[1].split('"', 1)[0]
            flags[rank] = float(value)
    return flags


@pytest.mark.xdist_group("torch")
@pytest.mark.timeout(90)
def test_a_node_computing_slower_in_synchronous_training_is_flagged_with_its_ranks(
    tmp_path: pathlib.Path, leaks: LeakCheck
) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "out"
    out.mkdir()
    endpoint = f"127.0.0.1:{find_free_port()}"
    rendezvous = ("--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "sync-slow")
    ports = [find_free_port() for _ in range(2)]
    agents: list[subprocess.Popen[str]] = []
    stderrs: list[LinesRead] = []
    for node in range(2):
        agent = leaks.start_relaunch(
            *("--nnodes", "2", "--nproc-per-node", "2", *rendezvous),
            *("--metrics-port", f"127.0.0.1:{ports[node]}", "--preload", "torch"),
            *("--event-log-handler", f"file:{tmp_path}/events{node}.jsonl"),
            *(WORKER, str(out), "1", "1"),
        )
        agents.append(agent)
        assert agent.stderr is not None
        stderrs.append(LinesRead(agent.stderr))

    try:
        wait_until(lambda: all(seen.first(FLAG) for seen in stderrs), timeout=60, what="the flags")
        shown = subprocess.run(
            [sys.executable, "-m", "relaunch", "status", *rendezvous, "--json"],
            capture_output=True,
            text=True,
            env=leaks.process_env(),
            timeout=30,
        )
        scraped = {}
        for port in ports:
            scraped.update(_scrape(port))
    finally:
        (out / "stop").touch()
        for agent in agents:
            try:
                agent.wait(timeout=30)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
    for seen in stderrs:
        seen.join()
    assert [agent.returncode for agent in agents] == [0, 0]
    onset = min(float(p.read_text()) for p in out.glob("onset.*"))
    delays = sorted(seen.first(FLAG) - onset for seen in stderrs)  # type: ignore[operator]
    print(f"slow node flagged {delays[0]:.1f}s and {delays[1]:.1f}s after its slow computing began")

    # relaunch status: node 1 flagged with both its ranks, no rank below the median rate (its
    # table's lines: test_stragglers.py).
    doc = json.loads(shown.stdout)
    (slow,) = doc["job"]["slow_nodes"]
    assert (slow["node_rank"], slow["ranks"], slow["section"]) == (1, [2, 3], "compute")
    assert slow["value"] > 1.5 * slow["median"]
    assert doc["job"]["stragglers"] == {}  # one pace: the rate path sees nothing
    # The metric, on the slow node's agent: its ranks at 1, the fast node's at 0.
    assert scraped == {"0": 0.0, "1": 0.0, "2": 1.0, "3": 1.0}
    for node, seen in enumerate(stderrs):
        text = seen.text()
        assert "  straggler: node " in text and FLAG in text.split("run summary")[-1]
        events = [json.loads(line) for line in (tmp_path / f"events{node}.jsonl").open()]
        (event,) = [e for e in events if e["name"] == "torchelastic.worker.status.STRAGGLER"]
        straggler = json.loads(event["metadata"]["metadata"])["straggler"]
        assert (straggler["node_rank"], straggler["ranks"]) == (1, [2, 3])
        assert event["metadata"]["global_rank"] == 2
