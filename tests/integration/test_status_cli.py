"""``relaunch status`` on real jobs: two and three agents of two workers each, on the built-in
store and on etcd, with a slow rank and a worker that fails once; the token; ``--watch``.

The agents post their status every 3 s, so the tests poll ``relaunch status --json`` until what
they wait for shows, each wait with a deadline.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from conftest import LeakCheck, wait_until
from etcd_cluster import EtcdCluster

from relaunch.endpoints import find_free_port

#: Every rank reports a step every 20 ms, the slow one every 100 ms; the failing rank exits 3
#: once (at its first start), which spends the job's one restart; all stop once OUT/stop exists.
WORKER = str(pathlib.Path(__file__).parents[2] / "benchmarks" / "workers" / "slow_rank.py")


@contextlib.contextmanager
def job(
    tmp_path: pathlib.Path,
    leaks: LeakCheck,
    nodes: int,
    rendezvous: Sequence[str],
    fail: int = -1,
    env: dict[str, str] | None = None,
    conf: str = "",
) -> Iterator[list[subprocess.Popen[str]]]:
    """``nodes`` agents of 2 workers each; the last rank is slow, rank ``fail`` fails once.
    Stopped (the workers told to finish) on leaving; an agent still alive 30 s later is killed."""
    out = tmp_path / "out"
    out.mkdir()

    slow = 2 * nodes - 1
    agents = [
        leaks.start_relaunch(
            *("--nnodes", str(nodes), "--nproc-per-node", "2", "--max-restarts", "1"),
            *rendezvous,
            *(("--rdzv-conf", conf) if conf else ()),
            *(WORKER, str(out), str(slow), str(fail)),
            **(env or {}),
        )
        for _ in range(nodes)
    ]
    try:
        yield agents
    finally:
        (out / "stop").touch()
        for agent in agents:
            try:
                agent.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.communicate()


def status(
    leaks: LeakCheck, rendezvous: Sequence[str], *argv: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relaunch", "status", *rendezvous, *argv],
        capture_output=True,
        text=True,
        env=leaks.process_env(**(env or {})),
        timeout=30,
    )


def await_job(
    leaks: LeakCheck,
    rendezvous: Sequence[str],
    ready: Any,
    *argv: str,
    timeout: float = 60,
    what: str = "the job",
) -> dict[str, Any]:
    """The first ``relaunch status --json`` document for which ``ready(document)`` holds."""
    seen: list[dict[str, Any]] = []

    def check() -> bool:
        done = status(leaks, rendezvous, "--json", *argv)
        if done.returncode != 0:  # the job may not be in the store yet
            return False
        seen.append(json.loads(done.stdout))
        return bool(ready(seen[-1]))

    wait_until(check, timeout=timeout, what=what)
    return seen[-1]


def steady(nodes: int, restarts: int) -> Any:
    """Whether a document shows ``nodes`` nodes running after ``restarts`` restarts, every rank
    with a rate, and the last rank flagged a straggler."""
    slow = 2 * nodes - 1

    def ready(doc: dict[str, Any]) -> bool:
        ranks = [rank for node in doc["nodes"] for rank in node["ranks"]]
        return (
            doc["phase"] == "running"
            and doc["restarts"] == restarts
            and len(doc["nodes"]) == nodes
            and len(ranks) == 2 * nodes
            and all(rank["rate"] for rank in ranks)
            and doc["job"] is not None
            and list(doc["job"]["stragglers"]) == [str(slow)]
        )

    return ready


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "backend, nodes",
    [("c10d", 2), ("c10d", 3), ("etcd", 2), ("etcd", 3)],
)
def test_status_shows_every_rank_the_straggler_and_the_restart(
    tmp_path: pathlib.Path,
    leaks: LeakCheck,
    etcd_shared: EtcdCluster,
    backend: str,
    nodes: int,
) -> None:
    run_id = f"status-{backend}-{nodes}-{secrets.token_hex(4)}"
    keys: Any
    if backend == "etcd":
        endpoint = etcd_shared.endpoints
        from relaunch.store.etcd import EtcdStore

        etcd = EtcdStore(endpoint, timeout=10)
        keys = lambda: set(etcd.read_prefix(f"relaunch/{run_id}/")[0])  # noqa: E731
        conf = ""
        server = None
    else:  # the store served here, so that its keys can be listed
        from relaunch.store.server import TcpStoreServer

        server = TcpStoreServer("127.0.0.1", 0).start()
        endpoint = server.endpoint
        keys = lambda: set(server._state._data)  # noqa: E731
        conf = "is_host=false"
    rendezvous = ("--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", run_id)
    slow = 2 * nodes - 1
    try:
        with job(tmp_path, leaks, nodes, rendezvous, fail=1, conf=conf):
            doc = await_job(leaks, rendezvous, steady(nodes, 1), what="the straggler")
            assert doc["round"] >= 1 and doc["members"] == nodes and doc["missing"] == []
            assert sorted(n["group_rank"] for n in doc["nodes"]) == list(range(nodes))
            ranks = sorted(r["rank"] for n in doc["nodes"] for r in n["ranks"])
            assert ranks == list(range(2 * nodes))
            assert all(
                r["state"] == "running" and r["step"] > 0 for n in doc["nodes"] for r in n["ranks"]
            )
            assert doc["job"]["slowest"]["rank"] == slow
            (reason,) = doc["restart_reasons"]
            assert "rank 1 exited with code 3" in reason
            # Read-only: the keys of the job are the same before and after a read.
            before = keys()
            shown = status(leaks, rendezvous)
            assert keys() == before
            assert shown.returncode == 0, shown.stderr
            table = shown.stdout
            # The restart's cost (the goodput ledger) once its workers reported progress again.
            head = (
                rf"job {re.escape(run_id)}: {nodes} node\(s\), {2 * nodes} rank\(s\), "
                r"1 restart\(s\) used, \d+\.\ds lost to them; round"
            )
            assert re.match(head, table) and "running" in table.splitlines()[0], table
            rows = {  # rank -> its row: "... group rank local running step rate ..."
                int(cells[cells.index("running") - 2]): line
                for line in table.splitlines()
                if line.startswith("  ") and "running" in (cells := line.split())
            }
            assert sorted(rows) == list(range(2 * nodes)), table
            assert [r for r, line in rows.items() if line.endswith("straggler")] == [slow]
            assert all("/s" in line and "s ago" in line for line in rows.values()), table
            assert table.count("(HEALTHY, posted ") == nodes
            assert "  restart 1: " in table and "rank 1 exited with code 3" in table
    finally:
        if server is not None:
            server.stop()


@pytest.mark.timeout(120)
def test_a_job_with_a_token_is_read_with_it_only_and_watched(
    tmp_path: pathlib.Path, leaks: LeakCheck
) -> None:
    run_id = f"status-token-{secrets.token_hex(4)}"
    endpoint = f"127.0.0.1:{find_free_port()}"
    rendezvous = ("--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id)
    with job(tmp_path, leaks, 2, rendezvous, env={"RELAUNCH_RDZV_TOKEN": "sesame"}):
        token = ("--rdzv-conf", "token=sesame")
        await_job(leaks, rendezvous, steady(2, 0), *token, what="the straggler")
        missing = status(leaks, rendezvous)
        assert missing.returncode == 1 and missing.stdout == ""
        assert "requires a token" in missing.stderr and missing.stderr.count("\n") == 1
        wrong = status(leaks, rendezvous, "--rdzv-conf", "token=open")
        assert wrong.returncode == 1 and "refused the token" in wrong.stderr
        assert "open" not in wrong.stderr.replace("refused the token", "")
        assert "Traceback" not in missing.stderr + wrong.stderr
        by_env = status(leaks, rendezvous, env={"RELAUNCH_RDZV_TOKEN": "sesame"})
        assert by_env.returncode == 0 and "straggler" in by_env.stdout
        # --watch off a terminal: one table per refresh, a blank line between; Ctrl-C ends it.
        tables, code, err = watched(leaks, [*rendezvous, *token], split_tables)
        assert code == 0 and "Traceback" not in err, err
        assert all(part.startswith(f"job {run_id}: 2 node(s)") for part in tables)
        lines, code, err = watched(leaks, [*rendezvous, *token, "--json"], str.splitlines)
        assert code == 0 and "Traceback" not in err, err
        assert all(json.loads(line)["run_id"] == run_id for line in lines)


def split_tables(text: str) -> list[str]:
    return text.split("\n\n")


def watched(
    leaks: LeakCheck, argv: Sequence[str], parts: Callable[[str], list[str]]
) -> tuple[list[str], int, str]:
    """``relaunch status ARGV --watch 0.2`` off a terminal, until it printed three ``parts``
    then got SIGINT (Ctrl-C): the parts, its exit status and its stderr."""
    watcher = subprocess.Popen(
        [sys.executable, "-m", "relaunch", "status", *argv, "--watch", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=leaks.process_env(),
    )
    assert watcher.stdout is not None and watcher.stderr is not None
    lines: list[str] = []
    reader = threading.Thread(target=lines.extend, args=(watcher.stdout,), daemon=True)
    reader.start()
    try:
        wait_until(lambda: len(parts("".join(lines))) >= 3, timeout=30, what="three refreshes")
    finally:
        watcher.send_signal(signal.SIGINT)
        code = watcher.wait(timeout=30)
        reader.join(timeout=10)
        err = watcher.stderr.read()
        watcher.stdout.close()
        watcher.stderr.close()
    return [part for part in parts("".join(lines)) if part.strip()], code, err


@pytest.mark.timeout(60)
def test_a_job_not_in_the_store(leaks: LeakCheck, etcd_shared: EtcdCluster) -> None:
    rendezvous = ("--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_shared.endpoints)
    started = time.monotonic()
    done = status(leaks, rendezvous, "--rdzv-id", f"nobody-{secrets.token_hex(4)}")
    assert done.returncode == 1 and "no job 'nobody-" in done.stderr
    assert "check --rdzv-id" in done.stderr and done.stderr.count("\n") == 1
    assert time.monotonic() - started < 20


@pytest.mark.timeout(60)
def test_a_job_on_etcd_with_authentication_needs_the_credentials(leaks: LeakCheck) -> None:
    from relaunch.store.etcd import EtcdStore

    with EtcdCluster(1, auth=("root", "secret")) as cluster:
        etcd = EtcdStore(cluster.endpoints, user="root", password="secret", timeout=10)
        etcd.set("relaunch/locked/round", b"0")  # a job of one node, as its agent would write
        etcd.set("relaunch/locked/news/r0/final", b'{"count": 1}')
        rendezvous = ("--rdzv-backend", "etcd", "--rdzv-endpoint", cluster.endpoints)
        rendezvous += ("--rdzv-id", "locked")
        refused = status(leaks, rendezvous)
        assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
        assert "Traceback" not in refused.stderr and "user=,password=" in refused.stderr
        shown = status(leaks, rendezvous, "--rdzv-conf", "user=root,password=secret")
        assert shown.returncode == 0, shown.stderr
        assert "round 0 running" in shown.stdout and "(no status posted yet)" in shown.stdout
