"""What only etcd gives: a job that outlives any one etcd member or any one node, TLS and
authentication, clear errors, and jobs that share a cluster without meeting.

The tests every backend passes (worlds, growing, a lost node) are in test_rendezvous.py.
"""

from __future__ import annotations

import contextlib
import pathlib
import select
import signal
import socket
import subprocess
import threading
import time
import uuid

import pytest
from conftest import LeakCheck, wait_until
from etcd_cluster import EtcdCluster, b64
from test_rendezvous import Rendezvous, agent, lines, script

from relaunch.core.rendezvous.node_order import Claim
from relaunch.core.rendezvous.rounds import Settings
from relaunch.endpoints import find_free_port
from relaunch.rendezvous.dynamic import DynamicRendezvousHandler
from relaunch.rendezvous.kinds_etcd import EtcdKind, handler_on_etcd
from relaunch.rendezvous.reader import EtcdJobReader
from relaunch.rendezvous.rounds import Rounds
from relaunch.store.etcd import EtcdStore

pytestmark = pytest.mark.timeout(90)

WORLD_THEN_WAIT = """
    import os, time
    print("world", os.environ["WORLD_SIZE"], "rank", os.environ["RANK"], flush=True)
    while not os.path.exists(os.environ["GO_FILE"]):  # the test says when to finish
        time.sleep(0.01)
    time.sleep(2)  # work on after the fault, across several heartbeats
"""


def etcd_agent(
    leaks: LeakCheck,
    endpoints: str,
    job: str,
    run_id: str,
    *flags: str,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    return agent(leaks, endpoints, job, "--rdzv-id", run_id, *flags, backend="etcd", env=env)


def read_world(node: subprocess.Popen[str]) -> str:
    """The first line a worker of ``node`` printed (the agent's stderr if there is none)."""
    assert node.stdout is not None
    first = lines(node.stdout.readline())
    if not first:
        node.kill()
        pytest.fail(f"the agent printed nothing: {node.communicate()[1]}")
    return first[0]


def two_agents_of_one_world(
    leaks: LeakCheck, endpoints: list[str], job: pathlib.Path, go: pathlib.Path
) -> list[subprocess.Popen[str]]:
    """Two agents of one job (keep-alive 0.2 s x 5, no restart), each on its ``endpoints``,
    once both workers run in a world of two; the workers wait for ``go``."""
    run_id = uuid.uuid4().hex
    nodes = [
        etcd_agent(
            leaks,
            members,
            job,
            run_id,
            "--nnodes",
            "2",
            "--rdzv-conf",
            "keep_alive_interval=0.2,keep_alive_max_attempt=5",
            "--max-restarts",
            "0",
            env={"GO_FILE": str(go)},
        )
        for members in endpoints
    ]
    assert sorted(read_world(node) for node in nodes) == ["world 2 rank 0", "world 2 rank 1"]
    return nodes


def assert_ran_once(nodes: list[subprocess.Popen[str]], results: list[tuple[str, str]]) -> None:
    """Each agent ended 0 with its workers run once: no restart, no re-forming, nobody lost."""
    both = "\n".join(f"agent {i} stderr:\n{err}" for i, (_, err) in enumerate(results))
    for node, (out, err) in zip(nodes, results, strict=True):
        assert node.returncode == 0, both
        assert lines(out) == [], f"the workers ran once: no restart, no re-forming\n{both}"
        assert "lost" not in err and "restart" not in err.lower(), both


def test_a_job_outlives_the_sigkill_of_the_etcd_leader(
    tmp_path, leaks: LeakCheck, etcd3: EtcdCluster
) -> None:
    job = script(tmp_path, WORLD_THEN_WAIT)
    go = tmp_path / "go"
    leader = etcd3.leader()
    # Every agent talks to the leader first, so its death is felt by every connection.
    order = [leader] + [i for i in range(3) if i != leader]
    endpoints = ",".join(etcd3.endpoint_list[i] for i in order)
    nodes = two_agents_of_one_world(leaks, [endpoints, endpoints], job, go)
    etcd3.kill(leader)
    go.touch()
    assert_ran_once(nodes, [node.communicate(timeout=60) for node in nodes])


def test_the_node_that_started_the_job_can_die(
    tmp_path, leaks: LeakCheck, etcd: EtcdCluster
) -> None:
    """With the built-in store the first node hosts it, and its death ends the job; on etcd the
    survivor re-forms and finishes."""
    job = script(
        tmp_path,
        """
        import os, time
        print("world", os.environ["WORLD_SIZE"], flush=True)
        if os.environ["WORLD_SIZE"] == "2":
            time.sleep(120)
    """,
    )
    # The first leads the round and waits for the second: started together, a world of 1
    # formed when the second's start outlasted a short last call.
    rdzv = Rendezvous("etcd", etcd.endpoints, lambda: True, uuid.uuid4().hex)
    second, first = rdzv.pair(leaks, job, "--nnodes", "1:2")
    assert read_world(first) == "world 2" and read_world(second) == "world 2"
    first.kill()
    first.communicate()
    out, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    assert lines(out) == ["world 1"]
    assert "node of group rank" in err and "lost" in err


def test_unreachable_etcd_is_a_clear_error_within_the_timeout(tmp_path, leaks: LeakCheck) -> None:
    job = script(tmp_path, "pass\n")
    endpoints = f"127.0.0.1:{find_free_port('127.0.0.1')},127.0.0.1:{find_free_port('127.0.0.1')}"
    started = time.monotonic()
    node = etcd_agent(leaks, endpoints, job, "job", "--rdzv-conf", "timeout=1")
    _, err = node.communicate(timeout=60)
    elapsed = time.monotonic() - started
    assert node.returncode == 1
    assert f"cannot reach etcd at {endpoints.replace(',', ', ')} within 1s" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert elapsed < 10, f"took {elapsed:.1f}s"


def test_two_jobs_on_one_cluster_never_meet(tmp_path, leaks: LeakCheck, etcd: EtcdCluster) -> None:
    job = script(
        tmp_path,
        """
        import os
        print(os.environ["WORLD_SIZE"], os.environ["RANK"], os.environ["MASTER_PORT"])
    """,
    )
    jobs = {
        run_id: [
            etcd_agent(leaks, etcd.endpoints, job, run_id, "--nnodes", "2", "--nproc-per-node", "2")
            for _ in range(2)
        ]
        for run_id in (uuid.uuid4().hex, uuid.uuid4().hex)
    }
    ports = set()
    for nodes in jobs.values():
        rows = []
        for node in nodes:
            out, err = node.communicate(timeout=60)
            assert node.returncode == 0, err
            rows += [line.split() for line in lines(out)]
        assert sorted(int(rank) for _, rank, _ in rows) == [0, 1, 2, 3]
        assert {world for world, _, _ in rows} == {"4"}
        assert len({port for _, _, port in rows}) == 1, "one master per job"
        ports |= {port for _, _, port in rows}
    assert len(ports) == 2, "each job has its own master"


@pytest.fixture
def secure_etcd() -> EtcdCluster:
    with EtcdCluster(1, tls=True, auth=("root", "pa55-w0rd-xyz")) as cluster:
        yield cluster


def test_tls_and_authentication(tmp_path, leaks: LeakCheck, secure_etcd: EtcdCluster) -> None:
    job = script(tmp_path, "import os; print('world', os.environ['WORLD_SIZE'])\n")
    tls = (
        f"protocol=https,cacert={secure_etcd.cacert},cert={secure_etcd.cert},key={secure_etcd.key}"
    )
    good = etcd_agent(
        leaks,
        secure_etcd.endpoints,
        job,
        uuid.uuid4().hex,
        "--rdzv-conf",
        f"{tls},user=root,password=pa55-w0rd-xyz",
    )
    out, err = good.communicate(timeout=60)
    assert good.returncode == 0, err
    assert lines(out) == ["world 1"]
    assert "pa55-w0rd-xyz" not in out + err

    wrong = etcd_agent(
        leaks,
        secure_etcd.endpoints,
        job,
        uuid.uuid4().hex,
        "--rdzv-conf",
        f"{tls},user=root,password=wr0ng-pa55",
        env={"LOGLEVEL": "DEBUG"},
    )
    out, err = wrong.communicate(timeout=60)
    assert wrong.returncode == 1
    assert "refused the user name or password of user 'root'" in err
    assert "wr0ng-pa55" not in out + err, "credentials never appear in messages or logs"

    plain = etcd_agent(
        leaks,
        secure_etcd.endpoints,
        job,
        uuid.uuid4().hex,
        "--rdzv-conf",
        "timeout=2,user=root,password=pa55-w0rd-xyz",
    )
    _, err = plain.communicate(timeout=60)
    assert plain.returncode == 1 and "cannot reach etcd" in err
    assert "pa55-w0rd-xyz" not in err


def test_a_node_arriving_after_the_job_finished_exits_cleanly(
    tmp_path, leaks: LeakCheck, etcd: EtcdCluster
) -> None:
    job = script(tmp_path, "print('ran')\n")
    run_id = uuid.uuid4().hex
    first = etcd_agent(
        leaks,
        etcd.endpoints,
        job,
        run_id,
        "--nnodes",
        "1:2",
        "--rdzv-conf",
        "last_call_timeout=0.2",
    )
    out, err = first.communicate(timeout=60)
    assert first.returncode == 0 and lines(out) == ["ran"], err
    late = etcd_agent(leaks, etcd.endpoints, job, run_id, "--nnodes", "1:2")
    out, err = late.communicate(timeout=60)
    assert late.returncode == 0 and "has already finished" in err and lines(out) == []


def job_keys(etcd: EtcdCluster, run_id: str) -> dict[str, int]:
    """The keys job ``run_id`` left in etcd, each with its lease (0: none)."""
    store = EtcdStore(etcd.endpoints)
    try:
        prefix = f"relaunch/{run_id}/"
        keys = {key: 0 for key, _, _ in store.range_prefix(prefix)}
        for key in keys:
            reply = store._gateway.call("/v3/kv/range", {"key": b64(key)})
            keys[key] = int(reply["kvs"][0].get("lease", 0))
        return keys
    finally:
        store.close()


def test_a_finished_job_leaves_only_what_dismisses_late_nodes_on_a_lease(
    tmp_path, leaks: LeakCheck, etcd: EtcdCluster
) -> None:
    job = script(tmp_path, "print('ran')\n")
    run_id = uuid.uuid4().hex
    nodes = [etcd_agent(leaks, etcd.endpoints, job, run_id, "--nnodes", "2") for _ in range(2)]
    for node in nodes:
        out, err = node.communicate(timeout=60)
        assert node.returncode == 0 and lines(out) == ["ran"], err
    keys = job_keys(etcd, run_id)
    closing = {f"relaunch/{run_id}/news/closed", f"relaunch/{run_id}/news/r1/final"}
    assert set(keys) == closing and all(keys.values()), keys  # they go with the lease


def test_a_join_written_again_counts_once(etcd: EtcdCluster) -> None:
    """A write retried after an ambiguous failure (a member died before answering) writes the
    node's own key again: the node is counted once, at the place of its first write."""
    store = EtcdStore(etcd.endpoints)
    try:
        on_etcd = EtcdKind("idempotent", Settings(1, 4), store, store)
        rounds = Rounds("idempotent", on_etcd, Settings(1, 4), "127.0.0.1", "node-a")
        other = Rounds("idempotent", on_etcd, Settings(1, 4), "127.0.0.1", "node-b")
        first = rounds.roster.join(0, 2, "default", Claim()).entry
        other.roster.join(0, 3, "default", Claim())
        again = rounds.roster.join(0, 2, "default", Claim()).entry
        assert first is not None and first == again and first.lead
        assert rounds.roster.joined(0) == 2
        _, world_size, runs, *_ = rounds.roster.members(0, 2, Settings(1, 4))
        assert world_size == 5 and len(runs) == 2
    finally:
        store.close()


def etcd_nodes(
    etcd: EtcdCluster, run_id: str, settings: Settings, count: int
) -> list[DynamicRendezvousHandler]:
    """``count`` nodes' handlers of job ``run_id`` on ``etcd``, each with its own connections."""
    return [
        handler_on_etcd(
            run_id,
            EtcdStore(etcd.endpoints),
            settings,
            "127.0.0.1",
            EtcdStore(etcd.endpoints),
            backend="etcd",
            watch_store=EtcdStore(etcd.endpoints),
        )
        for _ in range(count)
    ]


@pytest.mark.timeout(60)
def test_the_failure_that_closed_a_job_is_read_after_its_rounds_are_gone(
    etcd: EtcdCluster,
) -> None:
    """Closing a job deletes its keys on etcd, the round's record of the failure with them: a
    node that was re-forming then reads the failure (and its "do not requeue") from the one
    record left, ``closed``."""
    fast = Settings(2, 2, join_timeout=30, last_call_timeout=1, keep_alive_interval=0.3)
    run_id = uuid.uuid4().hex
    handlers = etcd_nodes(etcd, run_id, fast, 2)
    try:
        threads = [threading.Thread(target=h.next_rendezvous) for h in handlers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        handlers[0].job.fail_job("node 0: the same failure 3 times in a row", requeue=False)
        keys = job_keys(etcd, run_id)  # (a member's heartbeat may beat its key in again)
        assert f"relaunch/{run_id}/news/r0/changed" not in keys, keys  # the round's record
        assert f"relaunch/{run_id}/news/closed" in keys, keys
        failure = handlers[1].job.closing_failure()
        assert failure is not None and not failure.requeue
        assert failure.reason == "the job failed: node 0: the same failure 3 times in a row"
        store = EtcdStore(etcd.endpoints)  # relaunch status says it too
        try:
            snapshot = EtcdJobReader(store, run_id).read()
        finally:
            store.close()
        assert snapshot.phase == "finished"
        assert snapshot.why == f"{failure.reason}; do not requeue it"
    finally:
        for handler in handlers:
            handler.shutdown()


@pytest.mark.timeout(60)
def test_a_re_form_slower_than_the_lease_leaves_the_new_round_alone(etcd: EtcdCluster) -> None:
    """Between rounds nobody renews a node's lease: when re-forming outlasts it, the node's
    first beat in the new round takes a new lease, rather than the store counting as lost."""
    fast = Settings(3, 3, join_timeout=30, last_call_timeout=1, keep_alive_interval=0.3)
    run_id = uuid.uuid4().hex
    handlers = etcd_nodes(etcd, run_id, fast, 3)
    try:

        def form(late_by: float = 0.0) -> list[int]:
            """A round of the three, the last joining ``late_by`` seconds after the others."""
            ranks: list[int] = []

            def join(handler: DynamicRendezvousHandler) -> None:
                ranks.append(handler.next_rendezvous().group_rank)

            threads = [threading.Thread(target=join, args=(h,)) for h in handlers[:2]]
            threads.append(threading.Timer(late_by, join, args=(handlers[2],)))
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            return sorted(ranks)

        assert form() == [0, 1, 2]
        assert form(late_by=3 * fast.dead_after) == [0, 1, 2]  # the round outlives every lease
        # Three lease lifetimes in the new round: nobody is lost, no store is.
        assert handlers[0].job.wait_membership_change(3 * fast.dead_after) is None
        assert [h.job.membership_change() for h in handlers] == [None, None, None]
    finally:
        for handler in handlers:
            handler.shutdown()


def test_a_stalled_etcd_leader_is_not_a_lost_node(
    tmp_path, leaks: LeakCheck, etcd3: EtcdCluster
) -> None:
    """The deterministic form of the test above (issue 24, item 6): the leader stops answering
    (SIGSTOP) for several times the keep-alive detection time, on purpose, while every agent
    talks to it first; a new leader is elected meanwhile, then the old one dies. A store outage
    is not a peer's death: the job runs on, once, with no re-forming and nothing lost."""
    job = script(tmp_path, WORLD_THEN_WAIT)
    go = tmp_path / "go"
    leader = etcd3.leader()
    assert leader is not None
    order = [leader] + [i for i in range(3) if i != leader]
    endpoints = ",".join(etcd3.endpoint_list[i] for i in order)
    dead_after = 0.2 * 5
    nodes = two_agents_of_one_world(leaks, [endpoints, endpoints], job, go)
    stalled = etcd3.procs[leader]
    stalled.send_signal(signal.SIGSTOP)
    try:
        began = time.monotonic()
        wait_until(
            lambda: etcd3.leader() not in (None, leader), 30, "the other members to elect a leader"
        )
        # The stall is the fault itself: it outlasts the keep-alive detection time three times.
        time.sleep(max(0.0, 3 * dead_after - (time.monotonic() - began)))
    finally:
        stalled.send_signal(signal.SIGCONT)
    etcd3.kill(leader)
    go.touch()
    assert_ran_once(nodes, [node.communicate(timeout=60) for node in nodes])


class HoldingProxy:
    """A TCP proxy on loopback to one etcd member that the test can make hold every request
    (``hold``): connections stay open and nothing goes either way, as with a member that waits
    out a leader election (it answers once the cluster has a leader) or is cut off from the
    others; ``release`` lets the bytes through again."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.05)
        self.endpoint = f"127.0.0.1:{self._server.getsockname()[1]}"
        self._open = threading.Event()
        self._open.set()
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._closed.set()
        self._open.set()
        for thread in self._threads:
            thread.join(5)
        self._server.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            member = socket.create_connection(self._target, timeout=5)
            for source, sink in ((client, member), (member, client)):
                thread = threading.Thread(target=self._pump, args=(source, sink), daemon=True)
                self._threads.append(thread)
                thread.start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while not self._closed.is_set():
                self._open.wait()
                if not select.select([source], [], [], 0.05)[0] or not self._open.is_set():
                    continue
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
            source.close()


def test_a_member_that_holds_one_nodes_requests_is_not_its_death(
    tmp_path, leaks: LeakCheck, etcd3: EtcdCluster
) -> None:
    """Issue 24, item 6, at its root: after the leader's SIGKILL, one node's lease renewal sat
    on a member for its whole attempt (5 s) while the other node reached etcd throughout; the
    lease (1 s) expired, and the other node judged it lost. Here one node reaches etcd through
    a member that holds every request for three times the keep-alive detection time, the other
    node directly: the first must renew its lease on another member within a beat, and the job
    runs on, once."""
    job = script(tmp_path, WORLD_THEN_WAIT)
    go = tmp_path / "go"
    proxy = HoldingProxy(etcd3.endpoint_list[0])
    try:
        others = ",".join(etcd3.endpoint_list[1:])
        dead_after = 0.2 * 5
        nodes = two_agents_of_one_world(leaks, [f"{proxy.endpoint},{others}", others], job, go)
        proxy.hold()
        # The hold is the fault itself: it outlasts the keep-alive detection time three times.
        time.sleep(3 * dead_after)
        proxy.release()
        go.touch()
        results = [node.communicate(timeout=60) for node in nodes]
    finally:
        proxy.close()
    assert_ran_once(nodes, results)
