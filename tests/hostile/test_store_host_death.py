"""The store host's death (issue 24, item 5): on c10d the built-in store lives in the agent that
hosts it. When that agent is SIGKILLed, the others used to stop their workers at once, then sit
for about twice ``join_timeout`` (20 minutes with the defaults) before saying "within 20s". Now
the survivor concludes within the keep-alive detection time (interval x attempts) and a few
seconds, says in one line that the store's host is gone and what to do, and its workers are gone.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
from conftest import LeakCheck, pid_alive, said_until, wait_until

from relaunch.endpoints import find_free_port
from relaunch.store.api import StoreRefused
from relaunch.store.client import TcpStore

pytestmark = pytest.mark.timeout(60)

INTERVAL, ATTEMPTS = 0.5, 3
#: join_timeout stays at its default (600 s): the survivor must not wait for it.
CONF = f"keep_alive_interval={INTERVAL},keep_alive_max_attempt={ATTEMPTS},last_call_timeout=3"
#: Beyond the keep-alive detection time, what a loaded machine may need to say it.
SLACK = 5.0

JOB = textwrap.dedent(
    """
    import os, time
    open(os.path.join(os.environ["PIDS"], str(os.getpid())), "w").close()
    print("up", flush=True)
    time.sleep(120)
    """
)


def test_the_survivor_of_the_store_hosts_death_says_so_within_the_keep_alive(
    tmp_path, leaks: LeakCheck
) -> None:
    job, pids = tmp_path / "job.py", tmp_path / "pids"
    job.write_text(JOB)
    pids.mkdir()
    port = find_free_port("127.0.0.1")
    argv = [
        sys.executable,
        "-m",
        "relaunch",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        uuid.uuid4().hex[:12],
        "--nnodes",
        "1:2",
        "--max-restarts",
        "3",  # restarts left: the store host's death must still not be called a restart
        str(job),
    ]

    def start(conf: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*argv[:-1], "--rdzv-conf", conf, argv[-1]],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=leaks.process_env(PIDS=str(pids)),
        )

    # The survivor first, the host once the survivor waits for its store: a cold start inside
    # the host's last call left the host a world of its own.
    survivor = start(CONF.replace("last_call_timeout=3", "last_call_timeout=60") + ",is_host=false")
    said_until(survivor, "waiting up to")
    host = start(CONF)
    try:
        wait_until(lambda: len(os.listdir(pids)) == 2, 30, "a worker on each node")
        host.kill()
        host.wait(10)
        killed_at = time.monotonic()
        _, err = survivor.communicate(timeout=INTERVAL * ATTEMPTS + SLACK + 10)
        took = time.monotonic() - killed_at
    finally:
        for agent in (host, survivor):
            if agent.poll() is None:
                agent.kill()
                agent.wait(10)
    assert survivor.returncode == 1, err
    assert took < INTERVAL * ATTEMPTS + SLACK, f"{took:.1f}s: {err}"
    assert "Traceback" not in err, err
    gone = [line for line in err.splitlines() if "store's host is gone" in line]
    assert len(gone) == 1 and gone[0].startswith("relaunch: error: "), err
    assert "--rdzv-backend etcd" in gone[0] and "restart the job" in gone[0], err
    # Both ways to survive it: a store that moves (several hosts named), or etcd.
    assert "name several hosts in --rdzv-endpoint" in gone[0], err
    # The store's host being gone is no restart: none is said, nor counted in the summary.
    assert "restarting the worker group" not in err, err
    (summary,) = [line for line in err.splitlines() if "run summary" in line]
    assert "restart" not in summary, err
    for pid in os.listdir(pids):  # the workers of both nodes
        wait_until(lambda pid=pid: not pid_alive(int(pid)), 5, f"worker {pid} to be gone")


def test_a_connection_reset_before_the_hello_is_tried_again_and_found_refused() -> None:
    """A store's host being killed may still take a connection into its listener's backlog,
    then reset it: the client tries again within its connect timeout, and the refusal that
    follows says the store is gone (``StoreRefused``), not merely out of reach (CI once saw
    the survivor call a restart for that reset before it found the host gone)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def reset_the_first_and_stop_listening() -> None:
        connection, _ = listener.accept()
        listener.close()
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        connection.close()  # a reset, before any hello

    thread = threading.Thread(target=reset_the_first_and_stop_listening)
    thread.start()
    try:
        with pytest.raises(StoreRefused):
            TcpStore("127.0.0.1", port, timeout=1, connect_timeout=1).close()
    finally:
        thread.join(10)
