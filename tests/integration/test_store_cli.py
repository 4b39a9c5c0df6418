"""``relaunch store``: the built-in store served on its own, and its client's errors."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from conftest import LeakCheck

from relaunch.endpoints import find_free_port
from relaunch.store import StoreAuthError, StoreConnectionError, TcpStore

pytestmark = pytest.mark.timeout(60)


def test_the_standalone_store_serves_token_holders_until_sigterm(leaks: LeakCheck) -> None:
    server = subprocess.Popen(
        [sys.executable, "-m", "relaunch", "store", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=leaks.process_env(RELAUNCH_RDZV_TOKEN="tok"),
    )
    assert server.stdout is not None
    line = server.stdout.readline()
    assert line.startswith("relaunch store: serving on 127.0.0.1:")
    port = int(line.rsplit(":", 1)[1])
    with TcpStore("127.0.0.1", port, token="tok", timeout=10) as store:
        store.set("k", b"v")
        assert store.get("k").value == b"v"
    with pytest.raises(StoreAuthError, match="refused the token"):
        TcpStore("127.0.0.1", port, token="wrong", timeout=10)
    server.send_signal(signal.SIGTERM)
    _, stderr = server.communicate(timeout=30)
    assert server.returncode == 0
    assert "refused" in stderr and "wrong or missing token" in stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--host", "10.1.2.3"], "listens on loopback only"),
        (["--port", "http"], "--port"),
    ],
)
def test_store_usage_errors(leaks: LeakCheck, argv: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "relaunch", "store", *argv],
        capture_output=True,
        text=True,
        env=leaks.process_env(),
        timeout=30,
    )
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_an_endpoint_nobody_serves_fails_clearly_within_the_timeout() -> None:
    port = find_free_port("127.0.0.1")
    started = time.monotonic()
    with pytest.raises(StoreConnectionError, match=f"cannot reach the store at 127.0.0.1:{port}"):
        TcpStore("127.0.0.1", port, timeout=0.5)
    assert time.monotonic() - started < 5
