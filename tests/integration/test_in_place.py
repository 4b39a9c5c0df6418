"""Restarting in place (``@relaunch.restart_in_place``, docs/recovery.md): real agents, real
worker processes, real torch gloo DDP. A surviving rank keeps its process across the restart of
its group; a rank whose exception nothing explains fails with it."""

from __future__ import annotations

import os
import pathlib
import socket
import stat
from collections.abc import Callable, Iterator

import pytest
from conftest import LeakCheck, relaunch_cli, wait_until
from test_state import DDP, read, run_two_nodes, uninterrupted

from relaunch.agent.parking import Graces, ParkingLot
from relaunch.in_place import GO_ON, PARKED, RESUME
from relaunch.procs.worker_process import FailureGrace

HERE = pathlib.Path(__file__).parent
WORKER = str(HERE / "in_place_worker.py")


def calls(out: pathlib.Path, local_rank: int) -> list[list[str]]:
    """``in_place_worker``'s calls of ``local_rank``: ``[pid, rank, attempt, world, resumed]``."""
    return [line.split() for line in read(out, f"calls.{local_rank}").splitlines()]


def logs_of(log_dir: pathlib.Path, attempt: int, local_rank: int, stream: str) -> str:
    (path,) = log_dir.glob(f"*/attempt_{attempt}/{local_rank}/{stream}.log")
    return path.read_text()


@pytest.mark.timeout(60)
def test_a_surviving_rank_takes_the_next_attempt_in_its_own_process(
    tmp_path: pathlib.Path, leaks: LeakCheck
) -> None:
    """Rank 2 is SIGKILLed; ranks 0 and 1 raise as a broken collective would, park, and run
    attempt 1 in the same process, with its environment and its own log files; rank 2 starts
    afresh."""
    log_dir = tmp_path / "logs"
    done = relaunch_cli(
        leaks,
        *("--nproc-per-node", "3", "--max-restarts", "1", "--redirects", "3"),
        *("--log-dir", str(log_dir), WORKER, str(tmp_path), "kill"),
    )
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        first, second = calls(tmp_path, rank)
        assert first[0] == second[0]  # the same process
        assert (first[2], second[2]) == ("0", "1")  # its environment is attempt 1's
        assert logs_of(log_dir, 1, rank, "stdout") == f"call {first[0]} 1\n"
        assert logs_of(log_dir, 0, rank, "stderr") == (
            f"relaunch: rank {rank}: ConnectionError: rank 2 is gone; waiting to restart in place\n"
        )
    first, second = calls(tmp_path, 2)
    assert first[0] != second[0]
    assert "rank 2 (local_rank 2" in done.stderr and "killed by SIGKILL" in done.stderr
    assert "Ranks 0, 1 did not fail: they wait to restart in place" in done.stderr


@pytest.mark.timeout(60)
def test_an_exception_that_nothing_explains_fails_its_rank(
    tmp_path: pathlib.Path, leaks: LeakCheck
) -> None:
    """Rank 0 raises while rank 1 runs on: no failure explains it, so rank 0 is told to go on
    and fails with its own exception (the root cause); the group restarts cold."""
    done = relaunch_cli(
        leaks,
        *("--nproc-per-node", "2", "--max-restarts", "1", WORKER, str(tmp_path), "own"),
    )
    assert done.returncode == 0, done.stderr
    assert "parked with no failure to explain it: its exception stands" in done.stderr
    assert "restart 1: rank 0 exited with code 1: ValueError: a bug of rank 0's own" in done.stderr
    for rank in (0, 1):
        first, second = calls(tmp_path, rank)
        assert first[0] != second[0]


@pytest.mark.timeout(60)
def test_a_parked_rank_is_ended_with_the_run_when_no_restart_is_left(
    tmp_path: pathlib.Path, leaks: LeakCheck
) -> None:
    """With no restart left the job fails, and the rank kept for a restart that never comes is
    killed with the run (the leak check finds no process left)."""
    done = relaunch_cli(
        leaks,
        *("--nproc-per-node", "2", "--max-restarts", "0", WORKER, str(tmp_path), "kill"),
    )
    assert done.returncode == 1, done.stderr
    ((pid, *_),) = calls(tmp_path, 0)
    assert not os.path.exists(f"/proc/{pid}")


@pytest.mark.timeout(60)
def test_outside_relaunch_the_exception_goes_on(tmp_path: pathlib.Path) -> None:
    import subprocess
    import sys

    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }
    env.pop("RELAUNCH_PARKING", None)
    done = subprocess.run(
        [sys.executable, WORKER, str(tmp_path), "own"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == "ValueError: a bug of rank 0's own"
    assert "waiting to restart in place" not in done.stderr


@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout", ["one-node", "preloaded", "c10d", "etcd"])
def test_a_rank_kept_in_place_ends_with_the_weights_of_an_uninterrupted_run(
    tmp_path: pathlib.Path,
    leaks: LeakCheck,
    request: pytest.FixtureRequest,
    layout: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """torch gloo DDP, the last rank SIGKILLed after step 5: the other rank keeps its process
    and goes on from the model it holds (nothing loaded), the killed one loads its saved state,
    and both end with the weights of a run that was never interrupted."""
    pytest.importorskip("torch")
    out = tmp_path / "kill5"
    out.mkdir()
    command = [DDP, str(out), "10", "5", "in-place"]
    if layout in ("one-node", "preloaded"):
        # preloaded: the workers forked from a zygote, torch's store served by the agent
        preload = ("--preload", "torch,torch._dynamo") if layout == "preloaded" else ()
        done = relaunch_cli(
            leaks,
            *("--nproc-per-node", "2", "--max-restarts", "1", *preload, *command),
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
    else:
        run_two_nodes(leaks, request, layout, f"in-place-{layout}-5-{os.getpid()}", command)
    assert {read(out, f"resumed.1.{rank}") for rank in range(2)} == {"5"}
    assert read(out, "kept.1.0") == "5"  # rank 0 went on from what it held
    kept, fresh = (read(out, f"pids.{rank}").split() for rank in range(2))
    assert kept[0] == kept[1] and fresh[0] != fresh[1]
    # the uninterrupted run restarts in place too (nothing to restart): the same arguments
    assert {read(out, f"weights.{rank}") for rank in range(2)} == uninterrupted(
        tmp_path_factory, "10", "in-place"
    )


# -- the parking lot, from a worker's side ------------------------------------------------------


@pytest.fixture
def lot(tmp_path: pathlib.Path) -> Iterator[tuple[ParkingLot, list[int]]]:
    """A lot whose unexplained parks go on after 0.2 s; the pids it was told to keep."""
    kept: list[int] = []
    parking = ParkingLot(str(tmp_path / "lot"), kept.append, lambda: {os.getpid()}, lambda: 0.2)
    yield parking, kept
    parking.close()


def connect(lot: ParkingLot) -> socket.socket:
    worker = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    worker.settimeout(10)
    worker.connect(lot.path)
    wait_until(lambda: lot.can_park([os.getpid()]), 10, "the lot to know this process")
    return worker


@pytest.mark.timeout(30)
def test_the_lot_is_for_its_owner_alone(lot: tuple[ParkingLot, list[int]]) -> None:
    parking, _ = lot
    assert stat.S_IMODE(os.stat(parking.path).st_mode) == 0o600


@pytest.mark.timeout(30)
def test_a_worker_that_says_anything_but_parked_is_let_go(
    lot: tuple[ParkingLot, list[int]],
) -> None:
    parking, kept = lot
    with connect(parking) as worker:
        worker.send(b"resume\0RANK=0")
        assert worker.recv(64) == b""  # the lot closed the connection
        assert not parking.can_park([os.getpid()]) and not kept


@pytest.mark.timeout(30)
def test_a_park_that_nothing_explains_is_told_to_go_on(
    lot: tuple[ParkingLot, list[int]],
) -> None:
    parking, kept = lot
    with connect(parking) as worker:
        worker.send(PARKED)
        assert worker.recv(64) == GO_ON
        assert not kept and not parking.parked()


@pytest.mark.timeout(30)
def test_an_explained_park_is_kept_and_handed_its_attempt(
    lot: tuple[ParkingLot, list[int]], tmp_path: pathlib.Path
) -> None:
    """Parked before the failure is told (a collective broke first): kept when it is, then
    handed the next attempt's environment and streams."""
    parking, kept = lot
    with connect(parking) as worker:
        worker.send(PARKED)
        wait_until(lambda: parking.parked() == {os.getpid()}, 10, "the park")
        parking.explain()
        assert kept == [os.getpid()]
        with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
            assert parking.resume(
                os.getpid(), {"RANK": "3", "A": "b=c"}, out.fileno(), err.fileno()
            )
        message, fds, _, _ = socket.recv_fds(worker, 1 << 20, 2)
        for fd in fds:
            os.close(fd)
        assert message == RESUME + b"RANK=3\0A=b=c" and len(fds) == 2
        assert not parking.parked() and parking.can_park([os.getpid()])


class Holding(FailureGrace):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.release = lambda: None

    def begin(self, running: set[int], release: Callable[[], None]) -> float:
        self.release = release
        return self.seconds


def test_graces_hold_the_stop_until_each_has_released_it() -> None:
    saves, parks, idle = Holding(3.0), Holding(2.0), Holding(0.0)
    released: list[bool] = []
    assert Graces(saves, idle, parks).begin({0, 1}, lambda: released.append(True)) == 3.0
    parks.release()
    assert not released
    saves.release()
    assert released == [True]
