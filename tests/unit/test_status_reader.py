"""``relaunch status``'s reader and table: a job read from a store through reads only, in each of
its phases, and the CLI's usage errors (the real agents: tests/integration/test_status_cli.py)."""

from __future__ import annotations

import json
import re

import pytest

from relaunch.cli.status import status_main
from relaunch.core.output import status as core
from relaunch.core.output import status_table
from relaunch.core.rendezvous import rounds as plan
from relaunch.core.rendezvous.membership import ChangeKind, MembershipChange, encode_change
from relaunch.rendezvous.dynamic import DynamicRendezvousHandler
from relaunch.rendezvous.reader import JobNotFound, JobReader
from relaunch.runtime import ManualClock
from relaunch.store.api import Versioned
from relaunch.store.memory import MemoryStore

NOW = 1000.0


class ReadsOnly:
    """A store that can only be read, and keeps the keys read: any write is an AttributeError."""

    def __init__(self, store: MemoryStore) -> None:
        self._store = store
        self.read: list[str] = []

    def get(self, key: str) -> Versioned:
        self.read.append(key)
        return self._store.get(key)


def node(group_rank: int, rates: dict[int, float], reasons: list[str] | None = None) -> bytes:
    ranks = [
        core.RankStatus(rank, local, "running", 10 * (rank + 1), None, rate, NOW - 1)
        for local, (rank, rate) in enumerate(sorted(rates.items()))
    ]
    return core.NodeStatus(
        f"host{group_rank}",
        group_rank,
        "HEALTHY",
        len(reasons or []),
        NOW - 2,
        ranks,
        reasons or [],
    ).encode()


def running_job(store: MemoryStore) -> DynamicRendezvousHandler:
    """A job of one node in round 0 on ``store``, through the real rendezvous."""
    settings = plan.Settings(1, 1, join_timeout=10, last_call_timeout=0.1)
    handler = DynamicRendezvousHandler.on_counters("job", store, settings, "127.0.0.1", store)
    handler.job.set_workers("default", 2)
    handler.next_rendezvous()
    return handler


def test_a_running_job_is_read_through_gets_alone() -> None:
    memory = MemoryStore()
    handler = running_job(memory)
    try:
        handler.job.post_note("status/0", node(0, {0: 10.0, 1: 2.0}))
        posts = [core.NodeStatus.decode(node(0, {0: 10.0, 1: 2.0}))]
        handler.job.post_note("job", core.job_view(posts, 1.5, NOW).encode())
        store = ReadsOnly(memory)
        snapshot = JobReader(store, "job", clock=ManualClock(time=NOW)).read()
    finally:
        handler.shutdown()
    assert (snapshot.round, snapshot.phase, snapshot.members) == (0, "running", 1)
    assert "relaunch/job/r0/notes/status/0" in store.read
    assert "relaunch/job/news/r0/final" in store.read
    table = snapshot.table()
    assert table.startswith("job job: 1 node(s), 2 rank(s), 0 restart(s) used; round 0 running")
    (slow,) = [line for line in table.splitlines() if line.rstrip().endswith("straggler")]
    assert " 1 " in slow and "2/s" in slow
    assert "host0 (HEALTHY, posted 2.0s ago)" in table
    data = snapshot.as_json()
    assert data["phase"] == "running" and data["job"]["stragglers"] == {1: 2.0}
    assert [r["rate"] for n in data["nodes"] for r in n["ranks"]] == [10.0, 2.0]


def test_no_such_job() -> None:
    with pytest.raises(JobNotFound, match="no job 'nope'"):
        JobReader(ReadsOnly(MemoryStore()), "nope").read()


def test_a_round_re_forming_shows_why_and_then_the_last_posts() -> None:
    memory = MemoryStore()
    reader = JobReader(ReadsOnly(memory), "job", clock=ManualClock(time=NOW))
    memory.set(
        reader.key("final", 0),
        b'{"count": 2, "world_size": 4, "master_addr": "h", "master_port": 1}',
    )
    memory.set(reader.key("notes/status/0", 0), node(0, {0: 1.0, 1: 1.0}))
    change = MembershipChange(ChangeKind.RESTARTING, "host1: rank 3 exited with code 3")
    memory.set(reader.key("changed", 0), encode_change(change, 2))
    memory.set(reader.key("restarts"), b"1")
    snapshot = reader.read()
    assert snapshot.phase == "re-forming" and snapshot.why == change.reason
    table = snapshot.table()
    assert "1 restart(s) used; round 0 re-forming (host1: rank 3 exited" in table
    assert re.search(r"\(no status posted yet\) +1$", table, re.M)  # group rank 1 of 2
    # The next round forms: the last round's posts are shown, and said to be.
    memory.set(reader.key("round"), b"1")
    memory.set(reader.key("joins", 1), str(plan.join_increment(2, "default")).encode())
    snapshot = reader.read()
    assert (snapshot.round, snapshot.phase, snapshot.notes_round) == (1, "re-forming", 0)
    assert snapshot.note == "round 1 re-forming (1 node(s) joined); showing round 0's last posts"
    assert [n.group_rank for n in snapshot.nodes] == [0]


def test_a_finished_job() -> None:
    memory = MemoryStore()
    reader = JobReader(ReadsOnly(memory), "job", clock=ManualClock(time=NOW))
    memory.set(reader.key("closed"), b"1")
    memory.set(reader.key("final", 3), b"closed")
    snapshot = reader.read()
    assert snapshot.phase == "finished" and snapshot.note == "finished"


def test_a_job_stopped_for_a_failure_restarting_cannot_mend_says_so() -> None:
    memory = MemoryStore()
    reader = JobReader(ReadsOnly(memory), "job", clock=ManualClock(time=NOW))
    memory.set(reader.key("round"), b"3")
    memory.set(
        reader.key("final", 3),
        b'{"count": 2, "world_size": 4, "master_addr": "h", "master_port": 1}',
    )
    failed = MembershipChange.failed("host1: rank 1 exited with code 3", requeue=False)
    memory.set(reader.key("changed", 3), encode_change(failed, 2))
    memory.set(reader.key("closed"), b"1")
    snapshot = reader.read()
    assert snapshot.phase == "finished"
    assert snapshot.note == (
        "finished (the job failed: host1: rank 1 exited with code 3; do not requeue it)"
    )


def test_restart_reasons_are_told_once_each_naming_the_node() -> None:
    own = "rank 2 exited with code 3"
    posts = [
        core.NodeStatus.decode(node(0, {0: 1.0}, [f"host1: {own}", "nodes joined"])),
        core.NodeStatus.decode(node(1, {1: 1.0}, [own, "nodes joined"])),
    ]
    assert status_table.restart_reasons(posts) == [f"host1: {own}", "nodes joined"]
    table = status_table.format_table("j", posts, None, 1, NOW)
    assert f"  restart 1: host1: {own}\n  restart 2: nodes joined" in table
    assert status_table.format_table("j", [], None, 0, NOW).count("\n") == 1  # no rows: the header


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--rdzv-id", "x"], "--rdzv-endpoint is required"),
        (["--rdzv-endpoint", "127.0.0.1:1"], "--rdzv-id is required"),
        (["--rdzv-backend", "static", "--rdzv-id", "x"], "invalid choice"),
        (["--rdzv-endpoint", "h:1", "--rdzv-id", "x", "--watch", "0"], "--watch"),
        (["--rdzv-endpoint", "h:1", "--rdzv-id", "x", "--rdzv-conf", "oops"], "--rdzv-conf"),
    ],
)
def test_usage_errors_are_one_line_and_status_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert status_main(argv, {}) == 2
    err = capsys.readouterr().err
    assert err.startswith("relaunch status: error: ") and says in err
    assert err.count("\n") == 1


def test_an_unreachable_store_is_status_1(capsys: pytest.CaptureFixture[str]) -> None:
    from relaunch.endpoints import find_free_port

    endpoint = f"127.0.0.1:{find_free_port()}"
    argv = ["--rdzv-endpoint", endpoint, "--rdzv-id", "x", "--rdzv-conf", "timeout=0.3"]
    assert status_main(argv, {}) == 1
    err = capsys.readouterr().err
    assert f"cannot reach the store at {endpoint}" in err and err.count("\n") == 1


def test_watch_redraws_in_place_on_a_terminal_and_ends_with_the_job() -> None:
    import io

    from relaunch.cli.status import watch
    from relaunch.rendezvous.reader import Snapshot

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    phases = iter(["running", "running", "finished"])

    class Reader:
        def read(self) -> Snapshot:
            return Snapshot("j", 0, next(phases), 1, None, 0, NOW)

    out = Terminal()
    assert watch(Reader(), 0.001, False, out) == 0  # type: ignore[arg-type]
    text = out.getvalue()
    assert text.count("\x1b[3A\x1b[J") == 2  # up over the last table (3 rows), clear below
    assert text.splitlines()[-3].endswith("; finished")  # the last table: the job ended


def test_the_notes_json_keeps_its_fields_in_order() -> None:
    """A node's and the job's notes are the JSON they were as dataclasses (``asdict``): every
    field in its order, a rank's and the slowest rank's as objects, and read back equal."""
    rank = core.RankStatus(3, 1, "running", 5, 10, 1.5, 1000.0)
    node = core.NodeStatus("host0", 0, "HEALTHY", 1, 1000.0, [rank], ["rank 2 exited 1"], 2.5, 20.0)
    view = core.JobView(4.0, {3: 1.5}, core.Slowest(3, "host0", 5, 10), 1.5, 3.3, 1001.0)
    assert node.encode() == (
        b'{"node":"host0","group_rank":0,"state":"HEALTHY","restarts":1,"posted_at":1000.0,'
        b'"ranks":[{"rank":3,"local_rank":1,"state":"running","step":5,"total":10,"rate":1.5,'
        b'"last_sign":1000.0,"sections":{}}],"restart_reasons":["rank 2 exited 1"],'
        b'"lost_seconds":2.5,"stale_after":20.0}'
    )
    assert view.encode() == (
        b'{"median":4.0,"stragglers":{"3":1.5},"slowest":{"rank":3,"node":"host0","step":5,'
        b'"total":10},"rate":1.5,"eta":3.3,"posted_at":1001.0,"slow_nodes":[]}'
    )
    assert core.NodeStatus.decode(node.encode()) == node
    assert core.JobView.decode(view.encode()) == view
    data = status_table.as_json("j", [node], view, 1, 2, core.Standing(), 1003.0)
    assert list(data["nodes"][0]) == [*json.loads(node.encode()), "health"]
    assert json.loads(json.dumps(data))["job"] == json.loads(view.encode())
