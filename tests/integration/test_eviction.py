"""``--evict-stragglers`` (docs/resilience.md) in synchronous gloo training: an ``all_reduce``
every step, one node computing five times slower inside ``relaunch.section("compute")``, so
every rank steps at its pace. The slow node is only flagged while no spare waits (and that is
said), then evicted to the spare that comes, on c10d and etcd; the spare goes on from where it
left, and the job finishes at the fast pace. The workers are forked from a zygote that imported
torch once a node (``--preload torch``)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import time
from typing import Any

import pytest
from conftest import LeakCheck, LinesRead, wait_until
from test_resilience import endpoint_of

#: The worker, shared with ``python -m benchmarks eviction``.
WORKER = str(pathlib.Path(__file__).parents[2] / "benchmarks" / "workers" / "sync_slow_node.py")
#: Steps of the job: 8 s at the fast pace (20 ms of compute a step), 30 s at the slow one.
TOTAL = 300
#: Seconds a step at most at the fast pace (25 ms here), on a loaded machine; the slow pace is 0.1 s
#: and more.
FAST_STEP = 0.075


class Agent:
    """One agent of 2 workers of a ``--nnodes 2:2`` job, its stderr read as it comes."""

    def __init__(
        self, leaks: LeakCheck, argv: list[str], name: str, slow: bool, tmp: pathlib.Path
    ) -> None:
        conf = ("--rdzv-conf", f"node_name={name}")
        events = ("--event-log-handler", f"file:{tmp}/events.{name}.jsonl")
        job = (WORKER, str(tmp / "out"), "env", "1", "0.02", str(TOTAL))
        self.process = leaks.start_relaunch(
            *argv, *conf, *events, *job, SLOW_NODE="1" if slow else "0"
        )
        assert self.process.stderr is not None
        self.stderr = LinesRead(self.process.stderr)

    def text(self) -> str:
        return self.stderr.text()

    def end(self, timeout: float) -> int:
        code = self.process.wait(timeout=timeout)
        self.stderr.join()
        return code


def job_argv(backend: str, endpoint: str, run_id: str, tmp: pathlib.Path) -> list[str]:
    return [
        *("--nnodes", "2:2", "--nproc-per-node", "2", "--redirects", "3"),
        *("--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", run_id),
        *("--evict-stragglers", "1", "--log-dir", str(tmp / "logs"), "--preload", "torch"),
    ]


def workers(out: pathlib.Path, name: str) -> list[tuple[int, float, int, int]]:
    """(rank, when, step, slow) of every worker started (``start.<rank>.<pid>``); for ``end``,
    (rank, when, step, 0) of every worker that stopped."""
    found = []
    for path in out.glob(f"{name}.*"):
        rank = int(path.name.split(".")[1])
        fields = path.read_text().split()
        found.append((rank, float(fields[0]), int(fields[1]), int(fields[2:3] == ["1"])))
    return found


def ended(agents: list[Agent]) -> dict[str, Any]:
    """Every agent's exit status and stderr, each ended (killed by pid past the test's bound)."""
    try:
        return {"codes": [agent.end(60) for agent in agents]}
    finally:
        for agent in agents:
            if agent.process.poll() is None:
                agent.process.kill()
                agent.process.wait()


@pytest.mark.xdist_group("torch")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["c10d", "etcd"])
def test_a_slow_node_of_synchronous_training_is_flagged_until_a_spare_comes_then_evicted(
    tmp_path: pathlib.Path, leaks: LeakCheck, request: pytest.FixtureRequest, backend: str
) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "out"
    out.mkdir()
    run_id = f"evict-{backend}-{os.getpid()}-{time.monotonic_ns()}"
    argv = job_argv(backend, endpoint_of(backend, request), run_id, tmp_path)
    began = time.monotonic()
    agents = [Agent(leaks, argv, "a", False, tmp_path), Agent(leaks, argv, "b", True, tmp_path)]
    alone = "has been a straggler"
    try:
        # Without a spare, the slow node is only flagged, and that is said (once: the table).
        wait_until(lambda: any(alone in a.text() for a in agents), timeout=60, what="the notice")
        assert len(workers(out, "start")) == 4 and not any("evicted" in a.text() for a in agents)
        agents.append(Agent(leaks, argv, "c", False, tmp_path))  # the job is full: a spare
    finally:
        codes = ended(agents)["codes"]
    took = time.monotonic() - began
    texts = [agent.text() for agent in agents]
    told = "\n".join(f"--- {n} ---\n{text[-3000:]}" for n, text in zip("abc", texts, strict=True))
    assert codes == [0, 0, 0], told
    assert sum(text.count(alone) for text in texts) == 1, told
    assert "no spare is waiting to take its place, so it stays" in texts[0] + texts[1], told
    # Flagged by its section's time, though every rank stepped at one pace.
    assert "is a straggler: 'compute' takes " in texts[0] + texts[1], told
    # Said on both nodes of the round; the slow node's group rank is either.
    evicted = re.compile(r"/b \(node [01], ranks [02]-[13]\) evicted as a straggler \(")
    assert all(evicted.search(text) for text in texts[:2]), told
    assert "waiting as a spare" in texts[2], told
    assert "this node is excluded from the job until" in texts[1], told
    assert "(evicted as a straggler)" in texts[1], told
    assert "finished while this node was out of it, evicted as a straggler" in texts[1], told
    # No restart spent, and said so: not a count of the restarts left, nor a "restart 1".
    assert all("as a straggler" not in line for line in texts[0].splitlines() if "left" in line)
    assert "; a spare takes its place; no restart spent" in texts[0], told
    assert "after 1 eviction\n" in texts[0] and "  eviction 1: node " in texts[0], told
    assert "  restart 1: " not in texts[0], told
    # Its own status event on each node of the round, the cause in the restart's.
    for name in "ab":
        events = [json.loads(line) for line in (tmp_path / f"events.{name}.jsonl").open()]
        (evicted,) = [e for e in events if e["name"].endswith(".EVICTED")]
        assert re.search(
            r"/b \(node [01], ranks [02]-[13]\) evicted", evicted["metadata"]["raw_error"]
        )
        causes = [json.loads(e["metadata"]["metadata"]).get("cause") for e in events]
        assert "member_evicted" in causes
    # The spare's workers went on from where the slow node's left, to the end, at the fast pace.
    starts, ends = workers(out, "start"), workers(out, "end")
    slow_ranks = {rank for rank, _, _, slow in starts if slow}
    assert len(slow_ranks) == 2, starts
    resumed = [s for s in starts if s[0] in slow_ranks and not s[3] and s[2] > 0]
    assert {s[0] for s in resumed} == slow_ranks, starts
    assert {e[0] for e in ends} == {0, 1, 2, 3} and all(e[2] >= TOTAL for e in ends), ends
    last = max(resumed, key=lambda s: s[1])
    (end,) = [e for e in ends if e[0] == last[0]]
    pace = (end[1] - last[1]) / (end[2] - last[2])
    assert pace < FAST_STEP, (pace, starts, ends)
    print(
        f"{backend}: evicted at step {last[2]}, the spare's {end[2] - last[2]} steps at "
        f"{1000 * pace:.0f} ms a step, the job in {took:.1f}s ({TOTAL} steps)"
    )
