"""``--evict-stragglers`` (docs/resilience.md): a node flagged as a straggler is only flagged
while no spare waits (and that is said), then evicted to the spare that comes, on c10d and
etcd; the spare goes on from where it left, and the job finishes at the fast pace."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from conftest import LeakCheck, wait_until
from test_resilience import endpoint_of

#: The worker, shared with ``python -m benchmarks resilience``.
SLOW_NODE_JOB = str(pathlib.Path(__file__).parents[2] / "benchmarks" / "workers" / "slow_node.py")
#: Steps every rank makes: 6 s at the fast pace, 30 s at the slow one.
TOTAL = 300


class Agent:
    """One agent of 2 workers of a ``--nnodes 2:2`` job, its stderr read as it comes."""

    def __init__(
        self, leaks: LeakCheck, argv: list[str], name: str, slow: bool, out: pathlib.Path
    ) -> None:
        conf = ("--rdzv-conf", f"node_name={name}")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "relaunch", *argv, *conf, SLOW_NODE_JOB, str(out), str(TOTAL)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=leaks.process_env(SLOW_NODE="1" if slow else "0"),
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)

    def end(self, timeout: float) -> int:
        code = self.process.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code


def job_argv(backend: str, endpoint: str, run_id: str, tmp: pathlib.Path) -> list[str]:
    return [
        *("--nnodes", "2:2", "--nproc-per-node", "2", "--redirects", "3"),
        *("--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", run_id),
        *("--evict-stragglers", "1", "--log-dir", str(tmp / "logs")),
    ]


def running(out: pathlib.Path, ranks: int) -> bool:
    return len({path.name.split(".")[1] for path in out.glob("start.*")}) >= ranks


def ended(agents: list[Agent]) -> dict[str, Any]:
    """Every agent's exit status and stderr, each ended (killed by pid past the test's bound)."""
    try:
        return {"codes": [agent.end(40) for agent in agents]}
    finally:
        for agent in agents:
            if agent.process.poll() is None:
                agent.process.kill()
                agent.process.wait()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["c10d", "etcd"])
def test_a_slow_node_is_flagged_until_a_spare_comes_then_evicted_to_it(
    tmp_path: pathlib.Path, leaks: LeakCheck, request: pytest.FixtureRequest, backend: str
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run_id = f"evict-{backend}-{os.getpid()}-{time.monotonic_ns()}"
    argv = job_argv(backend, endpoint_of(backend, request), run_id, tmp_path)
    began = time.monotonic()
    agents = [Agent(leaks, argv, "a", False, out), Agent(leaks, argv, "b", True, out)]
    alone = "has been a straggler"
    try:
        # Without a spare, the slow node is only flagged, and that is said (once: the table).
        wait_until(lambda: any(alone in a.text() for a in agents), timeout=40, what="the notice")
        assert running(out, 4) and not any("evicted" in a.text() for a in agents)
        agents.append(Agent(leaks, argv, "c", False, out))  # the job is full: a spare
    finally:
        codes = ended(agents)["codes"]
    took = time.monotonic() - began
    texts = [agent.text() for agent in agents]
    told = "\n".join(f"--- {n} ---\n{text[-3000:]}" for n, text in zip("abc", texts, strict=True))
    assert codes == [0, 0, 0], told
    assert sum(text.count(alone) for text in texts) == 1, told
    assert "no spare is waiting to take its place, so it stays" in texts[0] + texts[1], told
    # Said on both nodes of the round; the slow node's group rank is either.
    evicted = re.compile(r"/b \(node [01], ranks [02]-[13]\) evicted as a straggler \(")
    assert all(evicted.search(text) for text in texts[:2]), told
    assert "waiting as a spare" in texts[2], told
    assert "this node is excluded from the job until" in texts[1], told
    assert "(evicted as a straggler)" in texts[1], told
    assert "finished while this node was out of it, evicted as a straggler" in texts[1], told
    # The spare ran ranks 2 and 3 from where the slow node left them, to the end.
    spare_ranks = {
        path.name.split(".")[1] for path in out.glob("start.*") if path.read_text().endswith(" 0")
    }
    assert spare_ranks == {"0", "1", "2", "3"}, told
    assert all(int((out / f"step.{rank}").read_text()) >= TOTAL for rank in range(4))
    print(f"{backend}: evicted and finished in {took:.1f}s (30 s at the slow node's pace)")
