"""``--metrics-port`` against a real Prometheus: two and three agents on loopback, on the built-in
store and on etcd, scraped every half second; the test asks Prometheus (PromQL over its HTTP API)
what it saw: every agent up, every rank's step and rate, the restart a failing worker caused,
the slow rank flagged, the rendezvous rounds, the store's round trip. Every expression of the
Grafana dashboard in docs/ is run too, so none is malformed.

Debian's ``prometheus`` package provides the binary (``make install-test`` installs it).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import time
import urllib.parse
import urllib.request
from typing import Any

import pytest
from conftest import LeakCheck

from relaunch.endpoints import find_free_port

DASHBOARD = pathlib.Path(__file__).parents[2] / "docs" / "grafana-dashboard.json"

#: Every rank reports a step every 20 ms, the slow rank every 100 ms; in the first attempt,
#: global rank 1 fails at its 20th step (the job has one restart); all stop once OUT/stop exists.
WORKER = textwrap.dedent(
    """
    import os, pathlib, sys, time, relaunch
    out, slow = pathlib.Path(sys.argv[1]), int(sys.argv[2])
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    pause = 0.1 if rank == slow else 0.02
    step = 0
    while not (out / "stop").exists():
        step += 1
        relaunch.report_progress(step)
        if attempt == 0 and rank == 1 and step == 20:
            sys.exit(3)
        time.sleep(pause)
    """
)


class Prometheus:
    """A Prometheus server this test starts on a free loopback port, scraping ``targets``."""

    def __init__(self, tmp: pathlib.Path, targets: list[str], leaks: LeakCheck) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("prometheus is not on PATH: run `make install-test` (Debian's package)")
        config = tmp / "prometheus.yml"
        config.write_text(
            json.dumps(  # YAML is a superset of JSON
                {
                    "global": {"scrape_interval": "500ms", "scrape_timeout": "400ms"},
                    "scrape_configs": [
                        {"job_name": "relaunch", "static_configs": [{"targets": targets}]}
                    ],
                }
            )
        )
        self.url = f"http://127.0.0.1:{find_free_port()}"
        self._log = (tmp / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=leaks.process_env(),
        )

    def query(self, expression: str) -> dict[str, Any]:
        """The answer of the HTTP API to an instant query (its ``data``, or its ``error``)."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                body = json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 503:  # listening, but not ready: its storage is still opening
                return {"status": "error", "error": f"{exc.code} {exc.reason}"}
            body = json.loads(exc.read())
        except OSError as exc:  # not listening yet
            return {"status": "error", "error": str(exc)}
        return body.get("data", body) if body["status"] == "success" else body

    def values(self, expression: str) -> list[tuple[dict[str, str], float]]:
        data = self.query(expression)
        return [(r["metric"], float(r["value"][1])) for r in data.get("result", [])]

    def scalar(self, expression: str) -> float | None:
        found = self.values(expression)
        return found[0][1] if len(found) == 1 else None

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self._log.close()


def agent(
    leaks: LeakCheck,
    tmp: pathlib.Path,
    nodes: int,
    backend: str,
    endpoint: str,
    run_id: str,
    port: int,
    slow: int,
) -> subprocess.Popen[str]:
    job = tmp / "worker.py"
    if not job.exists():
        job.write_text(WORKER)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "relaunch",
            *("--nnodes", str(nodes), "--nproc-per-node", "2"),
            *("--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", run_id),
            *("--max-restarts", "1", "--metrics-port", f"127.0.0.1:{port}"),
            *(str(job), str(tmp / "out"), str(slow)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp / f"agent{port}.err").open("w"),
        text=True,
        env=leaks.process_env(),
    )


def expectations(prometheus: Prometheus, nodes: int, backend: str, slow: int) -> dict[str, bool]:
    """What Prometheus must answer, each check by name: true once it does."""
    ranks = 2 * nodes
    flagged = prometheus.values("relaunch_rank_straggler == 1")
    return {
        "every agent up": prometheus.scalar('count(up{job="relaunch"} == 1)') == nodes,
        "the agents' backend": prometheus.scalar(
            f'count(relaunch_agent_info{{backend="{backend}"}})'
        )
        == nodes,
        "every rank's step": prometheus.scalar("count(relaunch_rank_step > 0)") == ranks,
        "every rank's rate": prometheus.scalar("count(relaunch_rank_steps_per_second > 0)")
        == ranks,
        "every rank running": prometheus.scalar(
            'count(relaunch_worker_state{state="running"} == 1)'
        )
        == ranks,
        "signs of life": prometheus.scalar("max(relaunch_rank_seconds_since_last_sign) < 5")
        is not None,
        "one restart for a failed worker": prometheus.scalar(
            'sum(relaunch_group_restarts_total{cause="worker_failed"})'
        )
        == 1,
        "every node restarted": prometheus.scalar(
            "count(sum by (instance) (relaunch_group_restarts_total) == 1)"
        )
        == nodes,
        "two rounds per agent": prometheus.scalar("count(relaunch_rendezvous_rounds_total == 2)")
        == nodes,
        "rendezvous durations": prometheus.scalar(
            "count(relaunch_rendezvous_duration_seconds_count == 2)"
        )
        == nodes,
        "the slow rank flagged, alone": [m["rank"] for m, _ in flagged] == [str(slow)],
        "the store's round trip": prometheus.scalar("count(relaunch_store_round_trip_seconds >= 0)")
        == nodes,
        "the job's restarts used": prometheus.scalar("min(relaunch_restarts_used)") == 1,
    }


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("backend", "nodes"), [("c10d", 2), ("c10d", 3), ("etcd", 2), ("etcd", 3)])
def test_prometheus_scrapes_every_agent(
    tmp_path: pathlib.Path,
    leaks: LeakCheck,
    request: pytest.FixtureRequest,
    backend: str,
    nodes: int,
) -> None:
    (tmp_path / "out").mkdir()
    if backend == "etcd":
        endpoint = request.getfixturevalue("etcd_shared").endpoints
    else:
        endpoint = f"127.0.0.1:{find_free_port()}"
    run_id = f"metrics-{backend}-{nodes}-{os.getpid()}"
    ports = [find_free_port() for _ in range(nodes)]
    slow = 2 * nodes - 1  # the last global rank
    prometheus = Prometheus(tmp_path, [f"127.0.0.1:{port}" for port in ports], leaks)
    agents: list[subprocess.Popen[str]] = []
    try:
        agents = [
            agent(leaks, tmp_path, nodes, backend, endpoint, run_id, port, slow) for port in ports
        ]
        deadline = time.monotonic() + 90
        checks: dict[str, bool] = {}
        began = time.monotonic()
        while time.monotonic() < deadline:
            checks = expectations(prometheus, nodes, backend, slow)
            if all(checks.values()):
                break
            assert all(a.poll() is None for a in agents), "an agent ended early"
            time.sleep(0.25)  # Prometheus scrapes every 0.5 s: ask again at that pace
        failing = [name for name, ok in checks.items() if not ok]
        assert not failing, f"Prometheus never answered as expected: {failing}"
        print(f"every check answered {time.monotonic() - began:.1f}s after the start")
        # Every expression of the dashboard is valid PromQL, and most of them have data.
        answered = 0
        for expression in dashboard_expressions():
            data = prometheus.query(expression)
            assert "result" in data, (expression, data)
            answered += bool(data["result"])
        assert answered >= len(dashboard_expressions()) - 3, answered
    finally:
        (tmp_path / "out" / "stop").touch()
        codes = []
        for process in agents:
            try:
                codes.append(process.wait(timeout=30))
            except subprocess.TimeoutExpired:
                process.kill()  # by pid: its workers die with it
                codes.append(process.wait(timeout=10))
        prometheus.close()
    errs = [(tmp_path / f"agent{port}.err").read_text() for port in ports]
    assert codes == [0] * nodes, errs


def dashboard_expressions() -> list[str]:
    """The dashboard's PromQL, with Grafana's variables given values Prometheus takes."""
    text = DASHBOARD.read_text()
    found = re.findall(r'"(?:expr|definition)": "((?:[^"\\]|\\.)*)"', text)
    expressions = [json.loads(f'"{raw}"') for raw in found]
    return [
        e.replace("$__rate_interval", "5s").replace("$run_id", ".*")
        for e in expressions
        if not e.startswith("label_values(")
    ]
