"""Several relaunch agents, each a real process, forming one job: on the built-in store and on
a real etcd member (the same tests for both backends)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from conftest import LeakCheck, said_until, wait_until

from relaunch.endpoints import find_free_port

pytestmark = pytest.mark.timeout(90)

FAST = "keep_alive_interval=0.2,keep_alive_max_attempt=3,last_call_timeout=0.5,join_timeout=20"
#: For two agents started one after the other that must first form one world of 2: the host's
#: last call outlasts the second agent's start on a loaded machine.
FORM_TWO = FAST.replace("last_call_timeout=0.5", "last_call_timeout=3")
#: The first of two such agents, when it leads the round: it waits for the second's cold start.
FIRST_OF_TWO = FAST.replace("last_call_timeout=0.5", "last_call_timeout=60")
#: What the first of such agents says once it waits for the store (c10d) or for the other node.
WAITING = "waiting up to"


def script(tmp_path, body: str, name: str = "job.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def agent(
    leaks: LeakCheck,
    endpoint: str,
    job: str,
    *flags: str,
    env: dict[str, str] | None = None,
    backend: str = "c10d",
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "relaunch",
            "--rdzv-backend",
            backend,
            "--rdzv-endpoint",
            endpoint,
            "--tee",
            "1",
            *flags,
            job,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=leaks.process_env(**(env or {})),
    )


@dataclass
class Rendezvous:
    """Where a test's agents meet: a backend, its endpoint and a job id of the test's own."""

    backend: str
    endpoint: str
    #: Whether the first agent started is up for others to join (c10d: it hosts the store).
    ready: Callable[[], bool]
    run_id: str = ""

    def agent(
        self, leaks: LeakCheck, job: str, *flags: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        return agent(
            leaks,
            self.endpoint,
            job,
            *("--rdzv-id", self.run_id, *flags),
            env=env,
            backend=self.backend,
        )

    def pair(
        self, leaks: LeakCheck, job: str, *flags: str
    ) -> tuple[subprocess.Popen[str], subprocess.Popen[str]]:
        """Two agents that form one world of 2: the host (c10d: of the store) and the other.
        The other starts first, the host once the other says it waits (c10d: for the store;
        etcd: as the round's lead, with a last call longer than any cold start): a cold start
        takes seconds on a loaded machine, and one inside the last call of the node that
        joined first left that node a world of its own."""
        other = self.pair_other(leaks, job, *flags)
        said_until(other, WAITING)
        return self.pair_host(leaks, job, *flags), other

    def pair_other(
        self, leaks: LeakCheck, job: str, *flags: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        """The agent of a ``pair`` started first; start the host once it says ``WAITING``."""
        conf = FIRST_OF_TWO + (",is_host=false" if self.backend == "c10d" else "")
        notice = {"RELAUNCH_WAIT_NOTICE": "0.05", **(env or {})}
        return self.agent(leaks, job, *flags, "--rdzv-conf", conf, env=notice)

    def pair_host(
        self, leaks: LeakCheck, job: str, *flags: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        """The agent of a ``pair`` started once the other waits."""
        return self.agent(leaks, job, *flags, "--rdzv-conf", FORM_TWO, env=env)


@pytest.fixture(params=["c10d", "etcd"])
def rdzv(request: pytest.FixtureRequest) -> Rendezvous:
    return rendezvous_for(request)


def rendezvous_for(request: pytest.FixtureRequest) -> Rendezvous:
    """For a fixture with params c10d and etcd: the built-in store (hosted by the first agent),
    or a real etcd member shared by tests."""
    run_id = uuid.uuid4().hex
    if request.param == "etcd":
        etcd = request.getfixturevalue("etcd_shared")
        return Rendezvous("etcd", etcd.endpoints, lambda: True, run_id)
    port = find_free_port("127.0.0.1")
    return Rendezvous("c10d", f"127.0.0.1:{port}", lambda: serving(port), run_id)


def serving(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def lines(output: str) -> list[str]:
    return [line.split(":", 1)[1] for line in output.splitlines() if line.startswith("[")]


def test_nodes_of_different_sizes_form_one_world(
    tmp_path, leaks: LeakCheck, rdzv: Rendezvous
) -> None:
    job = script(
        tmp_path,
        """
        import os
        print(os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["GROUP_RANK"],
              os.environ["GROUP_WORLD_SIZE"], os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    """,
    )
    nodes = [rdzv.agent(leaks, job, "--nnodes", "2", "--nproc-per-node", str(n)) for n in (3, 2)]
    outputs = [node.communicate(timeout=60)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0]
    rows = sorted((line.split() for out in outputs for line in lines(out)), key=lambda r: int(r[0]))
    assert [int(row[0]) for row in rows] == [0, 1, 2, 3, 4]
    assert {row[1] for row in rows} == {"5"} and {row[3] for row in rows} == {"2"}
    assert len({(row[4], row[5]) for row in rows}) == 1, "one master for everyone"
    for out in outputs:  # each node's workers are contiguous and share its group rank
        mine = sorted(int(line.split()[0]) for line in lines(out))
        assert mine == list(range(mine[0], mine[0] + len(mine)))
        assert len({line.split()[2] for line in lines(out)}) == 1


def test_a_killed_node_leaves_the_survivor_to_finish_alone(
    tmp_path, leaks: LeakCheck, rdzv: Rendezvous
) -> None:
    job = script(
        tmp_path,
        """
        import os, time
        print("world", os.environ["WORLD_SIZE"], flush=True)
        if os.environ["WORLD_SIZE"] == "2":
            time.sleep(120)
    """,
    )
    host, other = rdzv.pair(leaks, job, "--nnodes", "1:2")
    assert other.stdout is not None
    assert other.stdout.readline().endswith("world 2\n")
    other.kill()
    other.communicate()
    out, err = host.communicate(timeout=60)
    assert host.returncode == 0, err
    assert lines(out) == ["world 2", "world 1"]
    assert "node of group rank" in err and "lost" in err
    assert "0 restart(s) left" in err, "a lost node does not use up a restart"


def test_a_node_joining_a_running_job_grows_it(
    tmp_path, leaks: LeakCheck, rdzv: Rendezvous
) -> None:
    job = script(
        tmp_path,
        """
        import os, time
        print("world", os.environ["WORLD_SIZE"], flush=True)
        if os.environ["WORLD_SIZE"] == "1":
            time.sleep(120)
    """,
    )
    first = rdzv.agent(leaks, job, "--nnodes", "1:2", "--rdzv-conf", FAST)
    assert first.stdout is not None
    assert first.stdout.readline().endswith("world 1\n")
    second = rdzv.agent(leaks, job, "--nnodes", "1:2", "--rdzv-conf", FAST)
    out2, err2 = second.communicate(timeout=60)
    out1, err1 = first.communicate(timeout=60)
    assert (first.returncode, second.returncode) == (0, 0), err1 + err2
    assert lines(out1) == ["world 2"] and lines(out2) == ["world 2"]
    assert "1 node(s) waiting to join" in err1


def test_an_endpoint_nobody_serves_is_a_clear_error(tmp_path, leaks: LeakCheck) -> None:
    job = script(tmp_path, "pass\n")
    endpoint = f"127.0.0.1:{find_free_port('127.0.0.1')}"
    node = agent(leaks, endpoint, job, "--rdzv-conf", "is_host=false,join_timeout=0.5")
    _, err = node.communicate(timeout=60)
    assert node.returncode == 1
    assert f"cannot reach the store at {endpoint}" in err
    # One line saying what it waits for, when the first connection fails; one for the end.
    waiting, error = err.strip().splitlines()
    assert waiting.startswith(
        f"relaunch: waiting up to 0.5s (join_timeout) for the store at {endpoint}"
    )
    assert error.startswith("relaunch: error: ") and "Traceback" not in err


def test_a_wrong_token_is_refused(tmp_path, leaks: LeakCheck) -> None:
    job = script(tmp_path, "pass\n")
    port = find_free_port("127.0.0.1")
    endpoint = f"127.0.0.1:{port}"
    store = subprocess.Popen(
        [sys.executable, "-m", "relaunch", "store", "--port", str(port), "--token", "right"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=leaks.process_env(),
    )
    try:
        wait_until(lambda: serving(port), what="the store")
        node = agent(leaks, endpoint, job, "--rdzv-conf", "is_host=false,token=wrong")
        _, err = node.communicate(timeout=60)
        assert node.returncode == 1 and "refused the token" in err
        assert "wrong" not in err.replace("refused the token", ""), "the token is never shown"
        token = {"RELAUNCH_RDZV_TOKEN": "right"}
        good = agent(leaks, endpoint, job, "--rdzv-conf", "is_host=false", env=token)
        _, err = good.communicate(timeout=60)
        assert good.returncode == 0, err
        # The job is over: a node arriving now is told so and exits cleanly.
        late = agent(leaks, endpoint, job, "--rdzv-conf", "is_host=false", env=token)
        _, err = late.communicate(timeout=60)
        assert late.returncode == 0 and "has already finished" in err
    finally:
        store.send_signal(signal.SIGTERM)
        store.communicate(timeout=30)


def test_standalone_runs_on_the_built_in_store(tmp_path, leaks: LeakCheck) -> None:
    job = script(tmp_path, "import os; print(os.environ['WORLD_SIZE'], os.environ['RANK'])\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "relaunch",
            "--standalone",
            "--nproc-per-node",
            "3",
            "--tee",
            "1",
            job,
        ],
        capture_output=True,
        text=True,
        env=leaks.process_env(),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(lines(done.stdout)) == ["3 0", "3 1", "3 2"]
    assert os.environ.get("RELAUNCH_RDZV_TOKEN") is None


def test_workers_failing_because_a_node_died_do_not_fail_the_job(
    tmp_path, leaks: LeakCheck, rdzv: Rendezvous
) -> None:
    """A collective breaks at once when a peer node dies; heartbeats tell it a moment later.
    The failure is the membership change's, so the survivor re-forms instead of failing."""
    broken = tmp_path / "broken"
    job = script(
        tmp_path,
        f"""
        import os, sys, time
        print("world", os.environ["WORLD_SIZE"], flush=True)
        if os.environ["WORLD_SIZE"] == "2":
            while not os.path.exists({str(broken)!r}):  # the collective, until its peer dies
                time.sleep(0.01)
            sys.exit("the collective broke: peer gone")
    """,
    )
    host, other = rdzv.pair(leaks, job, "--nnodes", "1:2", "--max-restarts", "0")
    assert other.stdout is not None and host.stdout is not None
    assert other.stdout.readline().endswith("world 2\n")
    assert host.stdout.readline().endswith("world 2\n")
    other.kill()
    other.communicate()
    broken.touch()
    out, err = host.communicate(timeout=60)
    assert host.returncode == 0, err
    assert lines(out) == ["world 1"] and "lost" in err
