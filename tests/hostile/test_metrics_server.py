"""The agent's metrics endpoint against hostile clients (issue 24, item 9): a real ``relaunch
--metrics-port`` agent keeps answering scrapes in milliseconds while 1,000 idle connections and
a client trickling a byte every 1.5 s are held open (before: one connection at a time, each
scrape timed out); a request head too slow is cut off at its deadline, one too long gets a 431.
"""

from __future__ import annotations

import pathlib
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from conftest import LeakCheck, wait_until

from relaunch.agent import metrics_server
from relaunch.endpoints import find_free_port

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"
WORKER = """
import os, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
"""


def scrape(port: int, timeout: float = 5.0) -> tuple[float, bytes]:
    """Seconds one ``GET /metrics`` took, and the status line."""
    started = time.monotonic()
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while chunk := sock.recv(1 << 16):
            answer += chunk
    return time.monotonic() - started, answer.split(b"\r\n", 1)[0]


@pytest.fixture
def agent(leaks: LeakCheck, tmp_path: pathlib.Path) -> Iterator[int]:
    """A one-node job whose worker waits for a file; its agent serves metrics: the port."""
    job, done = tmp_path / "worker.py", tmp_path / "done"
    job.write_text(WORKER)
    port = find_free_port(HOST)
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "relaunch", "--standalone", "--nproc-per-node", "1"),
            *("--metrics-port", f"{HOST}:{port}", str(job), str(done)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=leaks.process_env(),
    )
    try:

        def serving() -> bool:
            try:
                return scrape(port, 1.0)[1] == b"HTTP/1.1 200 OK"
            except OSError:
                return False

        wait_until(serving, 20, "the agent to serve metrics")
        yield port
        done.touch()
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()  # by pid: only the process this test started
            proc.communicate(timeout=20)


@pytest.fixture
def many_descriptors() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1500 if hard == resource.RLIM_INFINITY else min(hard, 1500)
    if want < 1200:
        pytest.skip(f"the hard open-file limit ({hard}) cannot hold 1,000 connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_scrapes_answer_at_once_past_1000_idle_connections_and_a_trickler(
    agent: int, many_descriptors: None
) -> None:
    idle: list[socket.socket] = []
    trickler = socket.create_connection((HOST, agent), timeout=5)
    try:
        for _ in range(1000):  # connected (or queued by the kernel), never a byte
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex((HOST, agent))
            idle.append(sock)
        head = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
        trickler.send(head[:1])
        took = []
        for i in range(1, 4):  # about 1.5 s between the trickler's bytes
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                seconds, status = scrape(agent)
                assert status == b"HTTP/1.1 200 OK"
                took.append(seconds)
                time.sleep(0.1)
            trickler.send(head[i : i + 1])
        assert max(took) < 0.5, f"slowest scrape {max(took):.3f}s"
        # The trickler's whole request head was due within 5 s of its connect: it is cut off.
        assert closed(trickler)
    finally:
        trickler.close()
        for sock in idle:
            sock.close()


def test_a_request_head_too_long_gets_a_431_not_a_reset(agent: int) -> None:
    with socket.create_connection((HOST, agent), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\n" + b"X-Padding: " + b"a" * 20000)
        answer = b""
        while chunk := sock.recv(1 << 16):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 431 ")


def closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (an end of file, or a reset) within 5 s."""
    sock.settimeout(5)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True


def test_past_the_connection_cap_the_oldest_make_room(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_server, "MAX_CONNECTIONS", 8)
    server = metrics_server.MetricsServer(HOST, 0, lambda: b"relaunch_x 1\n")
    server.start()
    crowd = [socket.create_connection((HOST, server.port), timeout=5) for _ in range(12)]
    try:
        assert server.max_connections == 8
        assert scrape(server.port)[1] == b"HTTP/1.1 200 OK"
        assert all(closed(sock) for sock in crowd[:5])  # the 5 oldest (the scrape was 13th)
        wait_until(lambda: len(server._connections) <= 7, 5, "the scrape's connection to end")
    finally:
        for sock in crowd:
            sock.close()
        server.close()
    assert server._thread is not None and not server._thread.is_alive()
