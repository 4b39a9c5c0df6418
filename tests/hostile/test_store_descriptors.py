"""Outsiders' connections to the built-in store under a low open-file limit (issue 43, item 7).

Before: under ``ulimit -n 200``, connections that never authenticated took 199 of the hosting
agent's descriptors (the store let 1,024 of them wait), and a scrape of its metrics timed out.
Now the store lets at most a quarter of the open-file limit wait to authenticate
(``runtime.descriptor_share``), so the agent keeps the rest for its own work: its metrics
answer and its job finishes. A store without a token, where any client authenticates with an
empty proof, holds at most that share of connections in all (before: every descriptor).

A real agent (c10d, hosting its store, serving metrics) under RLIMIT_NOFILE 200, flooded by
this test's connections on loopback.
"""

from __future__ import annotations

import os
import pathlib
import resource
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from conftest import LeakCheck, wait_until

from relaunch.endpoints import find_free_port
from relaunch.store import wire

pytestmark = pytest.mark.timeout(90)

HOST = "127.0.0.1"
LIMIT = 200
FLOOD = 2 * LIMIT
WORKER = """
import os, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
"""


def scrape(port: int, timeout: float = 5.0) -> bytes:
    """The status line of one ``GET /metrics``, or what went wrong (``TimeoutError``: no answer
    within ``timeout``)."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while chunk := sock.recv(1 << 16):
                answer += chunk
    except OSError as exc:
        return type(exc).__name__.encode()
    return answer.split(b"\r\n", 1)[0]


@pytest.fixture(params=["token=fds-token", "last_call_timeout=1"], ids=["token", "no-token"])
def agent(
    leaks: LeakCheck, tmp_path: pathlib.Path, request: pytest.FixtureRequest
) -> Iterator[tuple[int, int, int]]:
    """A one-node c10d job under ``ulimit -n 200`` whose worker waits for a file; its agent
    hosts the store (with a token, or without) and serves metrics: (agent pid, store port,
    metrics port)."""
    job, done = tmp_path / "worker.py", tmp_path / "done"
    job.write_text(WORKER)
    store_port, metrics_port = find_free_port(HOST), find_free_port(HOST)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))

    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "relaunch", "--nnodes", "1", "--nproc-per-node", "1"),
            *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"{HOST}:{store_port}"),
            *("--rdzv-id", "fds", "--rdzv-conf", request.param),
            *("--metrics-port", f"{HOST}:{metrics_port}", str(job), str(done)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=leaks.process_env(),
        preexec_fn=limit,
    )
    try:
        wait_until(
            lambda: scrape(metrics_port, 1.0) == b"HTTP/1.1 200 OK", 30, "the agent's metrics"
        )
        yield proc.pid, store_port, metrics_port
        done.touch()
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()  # by pid: only the process this test started
            proc.communicate(timeout=20)


def test_outsiders_connections_leave_the_agent_its_descriptors(
    agent: tuple[int, int, int],
) -> None:
    pid, store_port, metrics_port = agent
    flood: list[socket.socket] = []
    try:
        for _ in range(FLOOD):  # connected (or queued by the kernel), never authenticating
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex((HOST, store_port))
            flood.append(sock)

        def greeted() -> int:
            """Flood connections the store took in (it greets each at once)."""
            return len(select.select(flood, [], [], 0)[0])

        wait_until(lambda: greeted() >= LIMIT // 5, 20, "the store to take the flood in")
        for sock in flood:  # an empty proof: all a store without a token asks
            sock.send(wire.encode(wire.AUTH, [b"", b"\0" * 32]))
        # Scrapes for two seconds, while the store takes what it will of the flood.
        answers, held = [], []
        until = time.monotonic() + 2.0
        while time.monotonic() < until:
            answers.append(scrape(metrics_port))
            held.append(len(os.listdir(f"/proc/{pid}/fd")))
        assert set(answers) == {b"HTTP/1.1 200 OK"}, answers
        assert max(held) <= LIMIT * 3 // 4, f"the agent held up to {max(held)} of {LIMIT}"
    finally:
        for sock in flood:
            sock.close()
