"""Issue 24 item 10: ``relaunch status`` against a corrupt or hostile store.

Every malformed reply (of the built-in store's protocol, of etcd's gateway, or a value no agent
writes) ends in one line on stderr and exit 1, with no traceback, within a few seconds, and no
escape sequence from outside reaches the terminal. Before, 7 of 21 such replies gave
tracebacks, a final record claiming 3,000,000 members made it build 3M keys, and a store's error
text cleared the screen. And (item 4) ``timeout=`` bounds one whole read of the job, however
slowly a store answers its many requests."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time

import pytest

from relaunch.cli.status import status_main
from relaunch.core.defaults import MAX_SECONDS
from relaunch.core.output import status as core
from relaunch.rendezvous.reader import MAX_MEMBERS, JobReader
from relaunch.store import wire
from relaunch.store.api import StoreTimeout
from relaunch.store.client import TcpStore
from tests.support.hostile_stores import (
    elapsed,
    etcd_member,
    etcd_range_reply,
    fake_store,
    http_reply,
    values_store,
)

ESC = "\x1b"
KEYS = JobReader(None, "j")  # type: ignore[arg-type]  # only its key names


def key(name: str, round_: int | None = None) -> str:
    return KEYS.key(name, round_)


def note(**changes: object) -> bytes:
    rank = core.RankStatus(0, 0, "running", 5, 10, 1.5, 1000.0)
    data = json.loads(core.NodeStatus("host0", 0, "HEALTHY", 0, 1000.0, [rank]).encode())
    data.update(changes)
    return json.dumps(data).encode()


def job(**overrides: bytes) -> dict[str, bytes]:
    """A running job of one node (round 0), with the values ``overrides`` names replaced
    (names as ``key``'s, with ``/`` as ``__``; round 0)."""
    values = {
        key("round"): b"0",
        key("final", 0): b'{"count": 1}',
        key("notes/status/0", 0): note(),
    }
    for name, value in overrides.items():
        parts = name.split("__")
        values[
            key(parts[0])
            if parts[0] in ("round", "restarts", "closed")
            else key("/".join(parts), 0)
        ] = value
    return values


def frame(code: int, fields: list[bytes]) -> bytes:
    return b"FRAME:" + wire.encode(code, fields)


EIGHT_MIB_DIGITS = b"9" * (8 << 20)
MALFORMED = {
    # the built-in store's protocol: replies no store sends
    "an empty OK": {key("round"): frame(wire.OK, [])},
    "an OK of two fields": {key("round"): frame(wire.OK, [b"1", b"0"])},
    "a presence flag of 7": {key("round"): frame(wire.OK, [b"7", b"0", b"1"])},
    "a version not an integer": {key("round"): frame(wire.OK, [b"1", b"0", b"v1"])},
    "a version of a million digits": {key("round"): frame(wire.OK, [b"1", b"0", b"9" * 10**6])},
    "an unknown status": {key("round"): frame(9, [b"what"])},
    "an error with escape codes": {key("round"): frame(wire.ERROR, [b"\x1b[2J\x1b[Hcleared"])},
    # values no agent writes
    "a round not an integer": job(round=b"abc"),
    "a negative round": job(round=b"-1"),
    "restarts of 8 MiB of digits": job(restarts=EIGHT_MIB_DIGITS),
    "a final record not JSON": job(final=b"{count"),
    "a final record of 3,000,000 members": job(final=b'{"count": 3000000}'),
    "a final record's count a string": job(final=b'{"count": "1"}'),
    "a final record a list": job(final=b"[1]"),
    "a final record of 0 members": job(final=b'{"count": 0}'),
    "a joins counter not an integer": {key("round"): b"0", key("joins", 0): b"x\x1b[2J"},
    "a changed record not JSON": job(changed=b"\x1b]0;pwned\x07"),
    "a changed record a list": job(changed=b"[]"),
    "a note not JSON": job(notes__status__0=b"not json"),
    "a note a list": job(notes__status__0=b"[]"),
    "a note missing fields": job(notes__status__0=b'{"node": "h"}'),
    "a note with a rate as text": job(
        notes__status__0=note(ranks=[{"rank": 0, "local_rank": 0, "state": "r", "rate": "x"}])
    ),
    "a note nested 100,000 deep": job(notes__status__0=b"[" * 100_000 + b"]" * 100_000),
    "a note of 2 MiB": job(notes__status__0=note(node="h" * (2 << 20))),
    "a job view of the wrong shape": job(notes__job=b'{"stragglers": [], "posted_at": 1}'),
    # the records that say how fresh a post is and how many nodes a round wants
    "a note posted at NaN": job(notes__status__0=note(posted_at=float("nan"))),
    "a note stale after NaN": job(notes__status__0=note(stale_after=float("nan"))),
    "a note stale after never": job(notes__status__0=note(stale_after=float("inf"))),
    "a note stale after 1e300 s": job(notes__status__0=note(stale_after=1e300)),
    "a note stale after -1 s": job(notes__status__0=note(stale_after=-1)),
    "a note stale after a string": job(notes__status__0=note(stale_after="20")),
    "a size not min:max": {key("round"): b"0", key("joins", 0): b"1", key("size", 0): b"\x1b[2J"},
    "a size of 10 digits": {
        key("round"): b"0",
        key("joins", 0): b"1",
        key("size", 0): b"1:9999999999",
    },
    "a size of max below min": {key("round"): b"0", key("joins", 0): b"1", key("size", 0): b"3:2"},
    "a job view with a rank not a number": job(
        notes__job=b'{"stragglers": {"x": 1}, "slowest": null, "posted_at": 1}'
    ),
}


def run(capsys: pytest.CaptureFixture[str], endpoint: str, *conf: str) -> tuple[int, str, str]:
    argv = ["--rdzv-endpoint", endpoint, "--rdzv-id", "j", "--rdzv-conf", "timeout=2", *conf]
    code = status_main(argv, {})
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_reply_is_one_line_and_exit_1(
    case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with values_store(MALFORMED[case]) as store:
        started = time.monotonic()
        code, out, err = run(capsys, store.endpoint)
    assert code == 1, (case, out, err)
    assert err.count("\n") == 1 and err.startswith("relaunch status: error: "), err[:500]
    assert ESC not in out + err and "\x07" not in out + err and "Traceback" not in err
    assert len(err) < 2000, len(err)
    assert time.monotonic() - started < 3


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "values",
    [
        job(notes__status__0=note(node="\x1b[2J\x1b[Hevil\rhost\n", state="\x9b31m")),
        job(changed=json.dumps({"kind": "restarting", "reason": "\x1b[2Jgone"}).encode()),
    ],
    ids=["a node's name and state", "a change's reason"],
)
def test_escape_codes_in_a_job_are_shown_not_obeyed(
    values: dict[str, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    with values_store(values) as store:
        code, out, err = run(capsys, store.endpoint)
    assert code == 0, err
    assert ESC not in out and "\x9b" not in out and "\r" not in out, out
    assert "\\x1b[2J" in out
    with values_store(values) as store:
        code, out, err = run(capsys, store.endpoint, "--json")
    assert code == 0 and ESC not in out and "\x9b" not in out


@pytest.mark.timeout(30)
@pytest.mark.parametrize("at", [b"NaN", b"Infinity", b'"yesterday"', b"true", b"1e400"])
def test_a_final_records_forged_time_is_not_taken(
    at: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    """When the round formed (its final record's ``at``) only words the first seconds of a
    job: a time that is no time is left out, and the job is shown."""
    with values_store(job(final=b'{"count": 1, "at": ' + at + b"}")) as store:
        code, out, err = run(capsys, store.endpoint)
    assert code == 0, err
    assert "host0" in out and "Traceback" not in err


@pytest.mark.timeout(30)
def test_a_dead_nodes_post_ages_whatever_it_claims(capsys: pytest.CaptureFixture[str]) -> None:
    """A post of long ago is stale, at the most ``stale_after`` any post may claim: a forged
    post cannot show a dead node healthy for ever."""
    old = note(posted_at=time.time() - 2 * MAX_SECONDS, stale_after=MAX_SECONDS)
    with values_store(job(notes__status__0=old)) as store:
        code, out, err = run(capsys, store.endpoint)
    assert code == 0, err
    assert "(STALE" in out and "(HEALTHY" not in out, out


@pytest.mark.timeout(30)
def test_three_million_members_and_escape_codes_through_the_real_cli() -> None:
    """The real command: the claim is refused at once (before: 3M requests, a hang), and a
    store's error text cannot clear the screen (before: it did)."""
    code = "import sys; from relaunch.cli.status import status_main; "
    code += "sys.exit(status_main(sys.argv[1:]))"
    cases = [
        (job(final=b'{"count": 3000000}'), f"1 to {MAX_MEMBERS}"),
        (MALFORMED["an error with escape codes"], "cleared"),
    ]
    for values, said in cases:
        with values_store(values) as store:
            argv = ["--rdzv-endpoint", store.endpoint, "--rdzv-id", "j"]
            took, done = elapsed(
                lambda argv=argv: subprocess.run(  # type: ignore[misc]
                    [sys.executable, "-c", code, *argv], capture_output=True, timeout=20
                )
            )
        assert isinstance(done, subprocess.CompletedProcess)
        assert done.returncode == 1 and done.stderr.count(b"\n") == 1, done.stderr
        assert b"\x1b" not in done.stdout + done.stderr and b"Traceback" not in done.stderr
        assert said.encode() in done.stderr, done.stderr
        assert took < 5


def b64(text: bytes) -> str:
    return base64.b64encode(text).decode()


ETCD_MALFORMED = {
    "a revision not an integer": etcd_range_reply([], revision="x"),
    "kvs not a list": etcd_range_reply("kvs"),
    "a key-value without its key": etcd_range_reply([{"value": b64(b"0")}]),
    "a value not base64": etcd_range_reply([{"key": b64(b"k"), "value": "%%%"}]),
    "a round not an integer": etcd_range_reply(
        [{"key": b64(b"k"), "value": b64(b"abc"), "mod_revision": "3"}]
    ),
    "an error with escape codes": http_reply(
        json.dumps({"code": 3, "message": "\x1b[2J\x1b[Hcleared"}).encode(), "400 Bad Request"
    ),
    "a body not JSON": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n{{{{{",
    "a JSON list": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]",
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(ETCD_MALFORMED))
def test_a_malformed_etcd_reply_is_one_line_and_exit_1(
    case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with etcd_member("reply", ETCD_MALFORMED[case]) as member:
        argv = ["--rdzv-backend", "etcd", "--rdzv-endpoint", member.endpoint]
        argv += ["--rdzv-id", "j", "--rdzv-conf", "timeout=0.3"]
        started = time.monotonic()
        code = status_main(argv, {})
        out, err = capsys.readouterr()
    assert code == 1, (case, out, err)
    assert err.count("\n") == 1 and ESC not in out + err and "Traceback" not in err, err
    assert member.endpoint in err
    assert time.monotonic() - started < 2


@pytest.mark.timeout(30)
def test_a_read_of_many_slow_requests_ends_by_the_timeout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each reply comes after 0.45 s, within each request's time: before, a read of the job
    took as many times that as it made requests; now ``timeout=1`` bounds the whole read."""
    with values_store(job(), delay=0.45) as store:
        argv = ["--rdzv-endpoint", store.endpoint, "--rdzv-id", "j", "--rdzv-conf", "timeout=1"]
        took, code = elapsed(lambda: status_main(argv, {}))
        err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and store.endpoint in err, err
    assert "within 1s" in err or "within 0.9" in err, err
    assert took < 1.6, took


@pytest.mark.timeout(30)
def test_the_store_client_ends_a_trickled_reply_by_its_deadline() -> None:
    """A reply sent a byte every 0.2 s: the request fails at its deadline, not at its end."""
    with fake_store(
        lambda op, fields: wire.encode(wire.OK, [b"1", b"v" * 50, b"7"]), trickle=0.2
    ) as server:
        client = TcpStore("127.0.0.1", server.port, timeout=1)
        took, result = elapsed(lambda: client.get("k"))
        client.close()
    assert isinstance(result, StoreTimeout) and server.endpoint in str(result), result
    assert took < 1.4, took


def group_job(group: int, **overrides: bytes) -> dict[str, bytes]:
    """``job``'s values as replica group ``group`` of job ``j`` holds them (run id ``j-groupG``)."""
    return {
        k.replace("relaunch/j/", f"relaunch/j-group{group}/", 1): v
        for k, v in job(**overrides).items()
    }


@pytest.mark.timeout(30)
def test_many_groups_are_read_within_one_jobs_bounds(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store of replica groups (``j-group0``, ...) shows every group, but all of them within
    what one job may hold: a store that fills many groups cannot make ``relaunch status`` take
    in many times that (the bound is lowered here to keep the test small)."""
    import relaunch.rendezvous.reader as reader

    monkeypatch.setattr(reader, "MAX_READ", 1 << 20)
    big = note(node="n" * (300 << 10))
    values: dict[str, bytes] = {}
    for group in range(2):
        values.update(group_job(group))
    with values_store(values) as store:
        code, out, err = run(capsys, store.endpoint)
    assert code == 0, err
    assert "replica group 0 of 2:" in out and "replica group 1 of 2:" in out, out
    values = {}
    for group in range(6):
        values.update(group_job(group, notes__status__0=big))
    with values_store(values) as store:
        code, out, err = run(capsys, store.endpoint)
    assert code == 1 and err.count("\n") == 1, err[:300]
    assert "groups hold more than 1048576 bytes in all" in err, err[:300]


# -- the node a view evicts (--evict-stragglers) ------------------------------------------------


def _view(evict: object, flagged: bool = True) -> bytes:
    from relaunch.core.workers.stragglers import SlowNode

    slow = [SlowNode("h/b", 1, [2, 3], "compute", 0.1, 0.02, 1.5)] if flagged else []
    data = json.loads(core.JobView(None, {}, None, None, None, 1000.0, slow).encode())
    data["evict"] = evict
    return json.dumps(data).encode()


GOOD_EVICT = {"node": "h/b", "node_rank": 1, "line": "node h/b (node 1) evicted as a straggler"}


@pytest.mark.parametrize(
    "evict",
    [
        "node 1",
        {**GOOD_EVICT, "node_rank": -1},
        {**GOOD_EVICT, "node_rank": "1"},
        {**GOOD_EVICT, "node_rank": True},
        {**GOOD_EVICT, "line": None},
        {**GOOD_EVICT, "line": f"evicted {ESC}[2J{ESC}]0;owned\a"},
        {**GOOD_EVICT, "line": "x" * (core.MAX_EVICT_LINE + 1)},
        {**GOOD_EVICT, "node": f"h{ESC}[31m"},
        {"node_rank": 1, "line": "x"},
    ],
)
def test_a_malformed_eviction_in_the_jobs_view_is_refused(evict: object) -> None:
    """The view's eviction becomes every node's restart reason: one it cannot be is refused
    whole (the status thread skips a view it cannot decode), never printed."""
    with pytest.raises(ValueError):
        core.JobView.decode(_view(evict))


def test_a_forged_eviction_of_a_node_the_view_does_not_flag_is_not_heeded() -> None:
    """A view that evicts a node it does not flag is no judge's: the node named stays (and
    one that does flag it is heeded: the node re-forms the round without itself)."""
    from relaunch.agent.eviction import Evictor

    class Job:
        evicted: list[tuple[int, str]] = []

        def evict(self, node_rank: int, reason: str) -> None:
            self.evicted.append((node_rank, reason))

    job = Job()
    assert core.JobView.decode(_view(GOOD_EVICT)).evict is not None
    Evictor.heed(core.JobView.decode(_view(GOOD_EVICT, flagged=False)), 1, job)  # type: ignore[arg-type]
    Evictor.heed(core.JobView.decode(_view(GOOD_EVICT)), 0, job)  # type: ignore[arg-type]
    assert job.evicted == []
    Evictor.heed(core.JobView.decode(_view(GOOD_EVICT)), 1, job)  # type: ignore[arg-type]
    assert job.evicted == [(1, GOOD_EVICT["line"])]
