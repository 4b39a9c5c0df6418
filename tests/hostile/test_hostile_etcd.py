"""Issue 24 item 4 on etcd: ``timeout`` bounds each operation as a whole, fail-overs included.

A member that trickles its reply a byte at a time, says nothing, sends garbage or answers with
JSON of the wrong shape is a failed member: with a healthy (real) etcd as the second member an
operation completes on it within its deadline; with the hostile member alone it fails within the
deadline and a little more, in one line naming the member. Before, a trickling member held a
call for as long as it kept sending (a socket timeout bounds each ``recv``, not the call)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from etcd_cluster import EtcdCluster

from relaunch.store.api import StoreError
from relaunch.store.etcd import EtcdStore
from tests.support.hostile_stores import elapsed, etcd_member, http_reply

MODES = ["trickle", "silent", "garbage", "wrong-shape", "not-json"]
WRONG_SHAPE = http_reply(b'{"header": {"revision": "1"}, "kvs": "not a list"}')
NOT_JSON = http_reply(b"<html>not etcd</html>")


def hostile(mode: str):  # type: ignore[no-untyped-def]
    if mode == "wrong-shape":
        return etcd_member("reply", WRONG_SHAPE)
    if mode == "not-json":
        return etcd_member("reply", NOT_JSON)
    return etcd_member(mode)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", MODES)
def test_a_hostile_member_is_left_for_a_healthy_one_within_the_deadline(
    mode: str, etcd_shared: EtcdCluster
) -> None:
    EtcdStore(etcd_shared.endpoints, timeout=5).set("hostile/etcd/key", b"value")
    with hostile(mode) as member:
        store = EtcdStore(f"{member.endpoint},{etcd_shared.endpoints}", timeout=2)
        took, result = elapsed(lambda: store.get("hostile/etcd/key"))
        store.close()
    assert not isinstance(result, Exception), f"{mode}: {result}"
    assert result.value == b"value"  # type: ignore[attr-defined]
    assert took < 1.8, f"{mode}: {took:.2f}s"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", MODES)
def test_a_hostile_member_alone_fails_within_the_deadline_in_one_line(mode: str) -> None:
    with hostile(mode) as member:
        store = EtcdStore(member.endpoint, timeout=1)
        took, result = elapsed(lambda: store.get("key"))
        store.close()
    assert isinstance(result, StoreError), f"{mode}: {result!r}"
    message = str(result)
    assert member.endpoint in message and "\n" not in message, message
    assert took < 1.5, f"{mode}: {took:.2f}s"


@pytest.mark.timeout(30)
def test_relaunch_status_on_a_trickling_member_ends_in_time() -> None:
    """The real CLI: before, it was still waiting after 60 s with ``timeout=2``."""
    with etcd_member("trickle") as member:
        argv = ["--rdzv-backend", "etcd", "--rdzv-endpoint", member.endpoint, "--rdzv-id", "j"]
        argv += ["--rdzv-conf", "timeout=1"]
        code = "import sys; from relaunch.cli.status import status_main; "
        code += "sys.exit(status_main(sys.argv[1:]))"
        took, done = elapsed(
            lambda: subprocess.run(
                [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=20
            )
        )
    assert isinstance(done, subprocess.CompletedProcess)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert member.endpoint in done.stderr and "Traceback" not in done.stderr
    assert took < 4, took
