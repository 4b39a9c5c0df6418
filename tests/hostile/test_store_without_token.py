"""The built-in store without a token (issue 43, items 3 and the start-up line).

Before: a store without a token streamed every key (the peers' tokens included) to anyone who
asked ``REPLICATE`` and took anyone's ``PROMOTE``; a job naming several store hosts ran its
failover without a token, so any peer that reached a standby could split the job or turn
failover off; and a job of several nodes without a token said nothing of it. Now a store
without a token serves no copy and takes no vote, failover without a token is refused at start
(one line, exit 2), and a job that may span nodes without a token says so in one line.

Real servers and the real ``relaunch`` command, on loopback.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import LeakCheck

from relaunch.endpoints import find_free_port
from relaunch.store import wire
from relaunch.store.api import StoreError
from relaunch.store.client import TcpStore
from relaunch.store.server import TcpStoreServer

pytestmark = pytest.mark.timeout(60)


def test_a_store_without_a_token_serves_no_copy_and_takes_no_vote() -> None:
    server = TcpStoreServer("127.0.0.1", 0).start()
    copied: list[list[bytes]] = []

    def take(record: list[bytes]) -> None:
        copied.append(record)
        if record[0] == wire.RECORD_SYNCED:
            raise StoreError("the whole copy came")

    try:
        with TcpStore("127.0.0.1", server.port) as client:
            client.set("relaunch/job/state/peers/0/token", b"secret-of-node-0")
        with TcpStore("127.0.0.1", server.port) as follower, pytest.raises(StoreError):
            follower.replicate(take)
        assert copied == [], "a store without a token streamed its keys"
        with TcpStore("127.0.0.1", server.port) as voter, pytest.raises(StoreError):
            voter.promote("2/0", 0.5)
        standby = TcpStoreServer("127.0.0.2", 0).start()
        try:
            with pytest.raises(ValueError, match="token"):
                standby.follow("127.0.0.1", server.port, lambda read: None)
        finally:
            standby.stop()
    finally:
        server.stop()


def relaunch(
    leaks: LeakCheck, *argv: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relaunch", *argv],
        capture_output=True,
        text=True,
        env=leaks.process_env(**(env or {})),
        timeout=50,
    )


def test_failover_without_a_token_is_refused_at_start_in_one_line(
    leaks: LeakCheck, tmp_path
) -> None:
    (tmp_path / "job.py").write_text("print('ran')\n")
    port = find_free_port("127.0.0.1")
    argv = [
        *("--nnodes", "2:3", "--rdzv-backend", "c10d", "--rdzv-id", "j"),
        *("--rdzv-endpoint", f"127.0.0.1:{port},127.0.0.2:{port},127.0.0.3:{port}"),
        str(tmp_path / "job.py"),
    ]
    done = relaunch(leaks, *argv)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("relaunch: error: --rdzv-endpoint names 3 hosts"), line
    assert "needs a token on every node" in line and "split the job" in line, line
    assert "--rdzv-conf token=" in line and "RELAUNCH_RDZV_TOKEN" in line, line
    assert "ran" not in done.stdout
    # Nothing started: no store was served.
    with pytest.raises(StoreError):
        TcpStore("127.0.0.1", port, timeout=1, connect_timeout=0.2).close()
    # With the token in the environment (or --rdzv-conf token=), the same line is accepted.
    for extra, env in (([], {"RELAUNCH_RDZV_TOKEN": "t"}), (["--rdzv-conf", "token=t"], {})):
        checked = relaunch(leaks, "--dry-run", *extra, *argv, env=env)
        assert checked.returncode == 0, checked.stderr


def test_a_job_that_may_span_nodes_without_a_token_says_so_in_one_line(
    leaks: LeakCheck, tmp_path
) -> None:
    (tmp_path / "job.py").write_text("print('ran')\n")
    port = find_free_port("127.0.0.1")
    c10d = [*("--rdzv-backend", "c10d", "--rdzv-id", "j", "--rdzv-endpoint", f"127.0.0.1:{port}")]
    quick = ["--rdzv-conf", "last_call_timeout=0.1"]  # a round of 1 of up to 2 forms at once
    job = str(tmp_path / "job.py")

    def said(*argv: str, env: dict[str, str] | None = None) -> list[str]:
        done = relaunch(leaks, *argv, job, env=env)
        assert done.returncode == 0 and "ran" in done.stdout, done.stderr
        return [line for line in done.stderr.splitlines() if "no token" in line]

    (line,) = said("--nnodes", "1:2", *c10d, *quick)
    assert line.startswith("relaunch: job 'j' may run on up to 2 nodes"), line
    assert f"anyone who reaches 127.0.0.1:{port} can join the job" in line, line
    assert "--rdzv-conf token=" in line and "RELAUNCH_RDZV_TOKEN" in line, line
    assert said("--nnodes", "1:2", *c10d, *quick, env={"RELAUNCH_RDZV_TOKEN": "t"}) == []
    assert said("--nnodes", "1", *c10d) == []  # one node: nobody else joins
    assert said("--standalone") == []
