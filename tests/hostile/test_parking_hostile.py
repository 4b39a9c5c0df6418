"""The parking lot (``agent.parking``) never swallows a real failure: a park that is not a
current worker's is refused, and a rank told to go on explains nothing until it has failed.

Issue 43, item 4: a rank's helper process whose ``@restart_in_place`` function raised parked
first; it was told to go on after 2 s, the lot stayed "explained" for the rest of the attempt,
and rank 1's own ``ValueError`` was then kept as if a failure explained it: the run succeeded.
Real agents, real workers, two ranks, no restart left: the run must fail with rank 1's error."""

from __future__ import annotations

import logging
import os
import pathlib
import socket
import textwrap

import pytest
from conftest import LeakCheck, relaunch_cli, wait_until

from relaunch.agent.parking import ParkingLot
from relaunch.in_place import PARKED

pytestmark = pytest.mark.timeout(60)

#: argv: OUT MODE. Rank 1 raises ``ValueError("rank 1's own")`` in its ``@restart_in_place``
#: function once rank 0 has written OUT/ready; rank 0 then returns 0, once rank 1 wrote
#: OUT/raising. Before that, rank 0:
#: - ``helper``: runs a helper process (a child with the rank's environment) whose own
#:   ``@restart_in_place`` function raises; the helper's failure is rank 0's business;
#: - ``caught``: raises in its ``@restart_in_place`` function itself, is told to go on, and
#:   catches the exception outside it.
WORKER = textwrap.dedent(
    """
    import os, pathlib, subprocess, sys, time

    import relaunch

    out, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
    HELPER = (
        "import relaunch\\n"
        "@relaunch.restart_in_place\\n"
        "def helper():\\n"
        "    raise ValueError('the helper fails')\\n"
        "helper()\\n"
    )

    def wait_for(name):
        while not (out / name).exists():
            time.sleep(0.01)

    @relaunch.restart_in_place
    def work():
        rank = os.environ["RANK"]
        if rank == "1":
            wait_for("ready")
            (out / "raising").write_text("")
            raise ValueError("rank 1's own")
        if mode == "helper":
            helper = subprocess.run([sys.executable, "-c", HELPER], capture_output=True)
            (out / "helper").write_text(str(helper.returncode))
        else:
            raise ValueError("rank 0's own, caught")
        return 0

    if os.environ["RANK"] == "1":
        work()
    else:
        try:
            work()
        except ValueError:
            pass
        (out / "ready").write_text("")
        wait_for("raising")
    """
)


@pytest.mark.parametrize("mode", ["helper", "caught"])
def test_a_ranks_own_exception_fails_the_run_after_another_process_was_told_to_go_on(
    tmp_path: pathlib.Path, leaks: LeakCheck, mode: str
) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    done = relaunch_cli(
        leaks,
        *("--nproc-per-node", "2", "--max-restarts", "0", str(worker), str(tmp_path), mode),
    )
    assert done.returncode == 1, done.stderr
    assert "rank 1 (local_rank 1" in done.stderr, done.stderr
    assert "ValueError: rank 1's own" in done.stderr, done.stderr
    if mode == "helper":
        assert (tmp_path / "helper").read_text() == "1"  # its exception stood
        # Refused at once, in one line, not kept until a go on.
        assert done.stderr.count("the parking lot refused pid") == 1, done.stderr


# -- the lot's rules, from a process of the agent's user that is not a worker ----------------


def connect(path: str) -> socket.socket:
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    peer.settimeout(10)
    peer.connect(path)
    return peer


def test_a_park_from_a_process_that_is_no_worker_is_refused_and_changes_nothing(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Refused at once (no ``go on`` after the wait: its connection ends), never kept, never
    parked; said in one line however many come, their count at the attempt's end."""
    kept: list[int] = []
    lot = ParkingLot(str(tmp_path / "lot"), kept.append, set, lambda: 30.0)
    try:
        with caplog.at_level(logging.WARNING, logger="relaunch.agent.parking"):
            for _ in range(20):
                with connect(lot.path) as peer:
                    peer.send(PARKED)
                    assert peer.recv(64) == b""  # not GO_ON 30 s later: at once
            lot.explain()
            assert not lot.parked() and not kept
            lot.new_attempt()
        said = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(said) == 2, said
        assert said[0].startswith(f"the parking lot refused pid {os.getpid()}: it is not a worker")
        assert said[1].startswith("the parking lot refused 19 more process(es)")
    finally:
        lot.close()


def test_a_park_made_while_the_workers_start_waits_until_they_are_known(
    tmp_path: pathlib.Path,
) -> None:
    """A worker may park before the agent has its pid (it raised at once): judged when the
    attempt's workers are known, counted from when it parked."""
    workers: set[int] = set()
    lot = ParkingLot(str(tmp_path / "lot"), lambda pid: None, lambda: workers, lambda: 30.0)
    try:
        lot.starting()
        with connect(lot.path) as peer:
            peer.send(PARKED)
            wait_until(lambda: os.getpid() in lot._unknown, 10, "the park to be held")
            assert not lot.parked() and lot.can_park([os.getpid()])  # held, not refused
            workers.add(os.getpid())
            lot.new_attempt()
            wait_until(lambda: lot.parked() == {os.getpid()}, 10, "the park to be judged")
    finally:
        lot.close()
