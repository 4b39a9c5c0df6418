"""State kept in the agent's memory across a worker's death (docs/recovery.md): real agents,
real workers, real torch gloo, both rendezvous backends."""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest
from conftest import LeakCheck, relaunch_cli, wait_until
from test_rendezvous import serving
from test_resilience import endpoint_of

from relaunch.core.run.goodput import CAUSES
from relaunch.state.files import PEERS, committed

HERE = pathlib.Path(__file__).parent
WORKER = str(HERE / "state_worker.py")
DDP = str(HERE / "state_ddp.py")
RING = str(HERE / "state_ring_worker.py")
#: A lost node seen within about a second.
LOST_FAST = ("--rdzv-conf", "keep_alive_interval=0.5,keep_alive_max_attempt=2")


def read(out: pathlib.Path, name: str) -> str:
    return (out / name).read_text()


#: The digests of each uninterrupted run made by this process, by its arguments.
_UNINTERRUPTED: dict[tuple[str, ...], set[str]] = {}


def uninterrupted(tmp_path_factory: pytest.TempPathFactory, *args: str) -> set[str]:
    """The digests of ``state_ddp.py OUT STEPS -1 [in-place]`` (``args``: STEPS [in-place]) run
    to its end, never interrupted, on one node of two ranks: the weights every interrupted run
    of the same arguments must end with, on any layout (the data of each step and rank is fixed;
    two ranks' all-reduce adds in either order alike). Made once a session: the xdist worker
    that asks first runs it, the others wait for it on a lock and read its digests."""
    if args not in _UNINTERRUPTED:
        shared = tmp_path_factory.getbasetemp()
        if "PYTEST_XDIST_WORKER" in os.environ:
            shared = shared.parent  # every xdist worker's basetemp is in it
        out = shared / ("state-ddp-uninterrupted-" + "-".join(args))
        with open(f"{out}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out / "done").exists():
                out.mkdir(exist_ok=True)
                check = LeakCheck()
                command = [DDP, str(out), args[0], "-1", *args[1:]]
                done = relaunch_cli(check, "--nproc-per-node", "2", *command, timeout=120)
                assert done.returncode == 0, done.stderr
                left = check.collect(5.0)
                assert not left, "processes left behind (killed): " + "; ".join(left)
                (out / "done").write_text("")
        digests = {read(out, f"weights.{rank}") for rank in range(2)}
        assert len(digests) == 1, digests  # the ranks agree
        _UNINTERRUPTED[args] = digests
    return _UNINTERRUPTED[args]


def ring_step(out: pathlib.Path, rank: int) -> int:
    """The newest step ``state_ring_worker`` rank ``rank`` saved (-1: none yet)."""
    path = out / f"step.{rank}"
    return int(path.read_text()) if path.exists() else -1


def ring_resumed(out: pathlib.Path, rank: int) -> list[str]:
    """The step each start of ``state_ring_worker`` rank ``rank`` resumed from (-1: none)."""
    path = out / f"resumed.{rank}"
    return path.read_text().split() if path.exists() else []


def stop_ring_at(out: pathlib.Path, step: int) -> None:
    """Have every ``state_ring_worker`` rank end at ``step`` (the file read whole)."""
    (out / "stop.tmp").write_text(str(step))
    os.replace(out / "stop.tmp", out / "stop")


@pytest.mark.timeout(60)
def test_a_killed_worker_resumes_every_rank_from_the_same_step(
    tmp_path: pathlib.Path, leaks: LeakCheck
) -> None:
    done = relaunch_cli(
        leaks,
        "--nproc-per-node",
        "3",
        "--max-restarts",
        "1",
        WORKER,
        str(tmp_path),
        "kill",
        "8",
        "4",
    )
    assert done.returncode == 0, done.stderr
    assert [read(tmp_path, f"resumed.0.{rank}") for rank in range(3)] == ["-1"] * 3
    assert [read(tmp_path, f"resumed.1.{rank}") for rank in range(3)] == ["4"] * 3
    for rank in range(3):  # nothing redone twice, nothing lost: the sum of 0..7 once
        assert read(tmp_path, f"final.{rank}") == repr({"rank": rank, "sum": 28, "step": 7})


@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout", ["one-node", "c10d", "etcd"])
def test_weights_after_a_worker_kill_are_bit_identical_to_an_uninterrupted_run(
    tmp_path: pathlib.Path,
    leaks: LeakCheck,
    request: pytest.FixtureRequest,
    layout: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """torch gloo DDP, model and optimizer kept with save_state every step; one rank SIGKILLed
    after step 5: the job resumes from step 5 on every rank and ends with the very weights of
    a run that was never interrupted."""
    pytest.importorskip("torch")
    out = tmp_path / "kill5"
    out.mkdir()
    command = [DDP, str(out), "10", "5"]
    if layout == "one-node":
        done = relaunch_cli(
            leaks, "--nproc-per-node", "2", "--max-restarts", "1", *command, timeout=120
        )
        assert done.returncode == 0, done.stderr
    else:
        run_two_nodes(leaks, request, layout, f"ddp-{layout}-5-{os.getpid()}", command)
    assert {read(out, f"resumed.1.{rank}") for rank in range(2)} == {"5"}
    assert {read(out, f"weights.{rank}") for rank in range(2)} == uninterrupted(
        tmp_path_factory, "10"
    )


def one_rank_nodes(
    leaks: LeakCheck,
    request: pytest.FixtureRequest,
    backend: str,
    run_id: str,
    nodes: int,
    *argv: str,
    **env: str,
) -> Callable[[], subprocess.Popen[str]]:
    """What starts one more agent of a job of ``nodes`` nodes of one worker each, on
    ``backend`` (and ``argv``: flags, then the command), with a token (the nodes copy their
    state to each other; ``RELAUNCH_RDZV_TOKEN=""`` in ``env``: none). The first one started
    hosts the built-in store: it returns once the store listens."""
    endpoint = endpoint_of(backend, request)
    command = [
        sys.executable,
        "-m",
        "relaunch",
        *("--nnodes", str(nodes), "--nproc-per-node", "1"),
        *("--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", run_id),
        *argv,
    ]
    started: list[subprocess.Popen[str]] = []

    def agent() -> subprocess.Popen[str]:
        process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**leaks.process_env(), "RELAUNCH_RDZV_TOKEN": run_id, **env},
        )
        if not started and backend == "c10d":
            port = int(endpoint.rpartition(":")[2])
            wait_until(lambda: serving(port), 30, "the store to listen")
        started.append(process)
        return process

    return agent


def run_two_nodes(
    leaks: LeakCheck,
    request: pytest.FixtureRequest,
    backend: str,
    run_id: str,
    command: list[str],
    flags: tuple[str, ...] = (),
    codes: tuple[int, int] = (0, 0),
) -> None:
    """Two agents of one worker each on ``backend`` (and ``flags``), run to their end (they
    exit with ``codes``)."""
    start = one_rank_nodes(
        leaks,
        request,
        backend,
        run_id,
        2,
        *("--max-restarts", "1", "--tee", "2"),  # the workers' stderr too, should the run fail
        *flags,
        *command,
    )
    agents = [start(), start()]
    errors = [agent.communicate(timeout=120)[1] for agent in agents]
    got = tuple(agent.returncode for agent in agents)
    assert got == codes, f"exit statuses {got}:\n" + "\n---\n".join(errors)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["jit", "callback"])
def test_a_failure_lets_the_listening_workers_save_just_in_time(
    tmp_path: pathlib.Path, leaks: LeakCheck, mode: str
) -> None:
    """Rank 0 saves nothing until told that rank 1 failed; then its replicated save is what
    both ranks resume from, past rank 1's own last save."""
    done = relaunch_cli(
        leaks,
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        WORKER,
        str(tmp_path),
        mode,
        "200",
        "5",
    )
    assert done.returncode == 0, done.stderr
    resumed = {read(tmp_path, f"resumed.1.{rank}") for rank in range(2)}
    assert resumed == {read(tmp_path, "jit")}, resumed  # the just-in-time save
    assert int(resumed.pop()) >= 4  # rank 1 saved 0..4, rank 0 at least as far once told
    assert read(tmp_path, "final.0") == read(tmp_path, "final.1").replace("'rank': 1", "'rank': 0")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("mode", "flags"), [("section", ()), ("silent", ("--hang-timeout", "2"))], ids=str
)
def test_a_hang_lets_the_listening_workers_save_just_in_time(
    tmp_path: pathlib.Path, leaks: LeakCheck, mode: str, flags: tuple[str, ...]
) -> None:
    """Rank 1 hangs (past its section's deadline, or silent beyond ``--hang-timeout``): rank 0
    is told before its stack is taken, and its save is what both ranks resume from."""
    done = relaunch_cli(
        leaks,
        *("--nproc-per-node", "2", "--max-restarts", "1", *flags),
        WORKER,
        str(tmp_path),
        mode,
        "3000",  # rank 0 steps every 10 ms until it is stopped
        "5",
    )
    assert done.returncode == 0, done.stderr
    assert "hung" in done.stderr and "most recent call first" in done.stderr  # the stacks
    resumed = {read(tmp_path, f"resumed.1.{rank}") for rank in range(2)}
    assert resumed == {read(tmp_path, "jit")}, resumed  # the just-in-time save
    assert int(resumed.pop()) >= 4
    assert read(tmp_path, "final.0") == read(tmp_path, "final.1").replace("'rank': 1", "'rank': 0")


@pytest.mark.timeout(90)
def test_another_nodes_failure_lets_the_listening_workers_save_just_in_time(
    tmp_path: pathlib.Path, leaks: LeakCheck, request: pytest.FixtureRequest
) -> None:
    """Rank 1 fails on its node; rank 0, on the other, is told through the rendezvous (its
    agent stops it for the re-form) and saves; rank 1's node pulls that replicated save."""
    run_two_nodes(
        leaks,
        request,
        "c10d",
        f"jit-nodes-{os.getpid()}",
        [WORKER, str(tmp_path), "jit", "200", "5"],
    )
    resumed = {read(tmp_path, f"resumed.1.{rank}") for rank in range(2)}
    assert resumed == {read(tmp_path, "jit")}  # the just-in-time save, on both nodes
    assert read(tmp_path, "final.0") == read(tmp_path, "final.1")


@pytest.mark.timeout(60)
def test_a_requeued_job_resumes_from_the_state_dir(
    tmp_path: pathlib.Path, leaks: LeakCheck
) -> None:
    state_dir, out = tmp_path / "state", tmp_path / "out"
    out.mkdir()
    flags = ("--nproc-per-node", "2", "--state-dir", str(state_dir), "--state-persist-every", "3")
    failed = relaunch_cli(leaks, *flags, "--max-restarts", "0", WORKER, str(out), "exit", "10", "6")
    assert failed.returncode == 1, failed.stderr
    assert sorted(os.listdir(state_dir)) == ["rank0.state", "rank1.state"]
    again = relaunch_cli(leaks, *flags, WORKER, str(out), "exit", "10", "-1")
    assert again.returncode == 0, again.stderr
    assert [read(out, f"resumed.0.{rank}") for rank in range(2)] == ["6", "6"]
    for rank in range(2):
        assert read(out, f"final.{rank}") == repr({"rank": rank, "sum": 45, "step": 9})


@pytest.mark.timeout(120)
def test_a_requeued_job_of_two_nodes_resumes_from_the_state_dir(
    tmp_path: pathlib.Path, leaks: LeakCheck, request: pytest.FixtureRequest
) -> None:
    """Each node tells the others the steps its ranks have on disk before it copies them into
    memory (no node waits on another's disk), and the requeued job resumes from them."""
    state_dir, out = tmp_path / "state", tmp_path / "out"
    out.mkdir()
    flags = ("--state-dir", str(state_dir), "--state-persist-every", "3")
    run_id = f"requeue-{os.getpid()}"
    failing = [WORKER, str(out), "exit", "10", "6"]
    run_two_nodes(leaks, request, "c10d", run_id, failing, (*flags, "--max-restarts", "0"), (1, 1))
    assert sorted(os.listdir(state_dir)) == ["rank0.state", "rank1.state"]
    run_two_nodes(
        leaks, request, "c10d", f"{run_id}-again", [WORKER, str(out), "exit", "10", "-1"], flags
    )
    assert [read(out, f"resumed.0.{rank}") for rank in range(2)] == ["6", "6"]
    for rank in range(2):
        assert read(out, f"final.{rank}") == repr({"rank": rank, "sum": 45, "step": 9})


@pytest.mark.timeout(30)
def test_a_save_larger_than_the_state_memory_fails_with_one_line(
    tmp_path: pathlib.Path, leaks: LeakCheck
) -> None:
    done = relaunch_cli(
        leaks,
        "--nproc-per-node",
        "1",
        "--state-memory",
        "4M",
        WORKER,
        str(tmp_path),
        "big",
        "0",
        "8",
    )
    assert done.returncode == 1
    (line,) = [line for line in done.stderr.splitlines() if "StateError" in line][-1:]
    assert "save_state needs 8 MiB but the agent's state memory holds 4 MiB" in line
    assert "raise --state-memory" in line


@pytest.mark.timeout(20)
def test_a_bad_state_memory_is_a_usage_error(leaks: LeakCheck) -> None:
    done = relaunch_cli(leaks, "--state-memory", "lots", "--nproc-per-node", "1", WORKER)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "is not a size" in done.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ending", ["success", "failure", "sigterm", "sigkill"])
def test_nothing_is_left_in_dev_shm_after_any_end(
    tmp_path: pathlib.Path, leaks: LeakCheck, ending: str
) -> None:
    script = tmp_path / "save.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, pathlib, sys, time
            import relaunch
            relaunch.save_state(bytes(1 << 20), 1)
            marker = pathlib.Path({str(tmp_path)!r}, "dir")
            if os.environ["RANK"] == "0":  # one writer, and a rename: the test reads it whole
                marker.with_suffix(".tmp").write_text(os.environ["RELAUNCH_STATE_DIR"])
                os.replace(marker.with_suffix(".tmp"), marker)
            if {ending!r} == "failure":
                deadline = time.monotonic() + 20
                while not marker.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)  # rank 0 told the test first: a failure stops it
                sys.exit(1)
            if {ending!r} in ("sigterm", "sigkill"):
                time.sleep(60)
            """
        )
    )
    agent = subprocess.Popen(
        [sys.executable, "-m", "relaunch", "--nproc-per-node", "2", str(script)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=leaks.process_env(),
    )
    marker = tmp_path / "dir"
    try:
        wait_until(marker.exists, 20)
    except BaseException:
        agent.kill()
        print(agent.communicate(timeout=30)[1])  # what the agent said, for the report
        raise
    directory = marker.read_text()
    assert directory.startswith("/dev/shm/relaunch_state_")
    if ending in ("sigterm", "sigkill"):
        assert os.path.isdir(directory)
        agent.send_signal(signal.SIGTERM if ending == "sigterm" else signal.SIGKILL)
    agent.communicate(timeout=30)
    # The guardian removes it after a SIGKILL of the agent: wait for it, bounded.
    wait_until(lambda: not os.path.exists(directory), 10, f"{directory} to be removed")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", ["c10d", "etcd"])
def test_weights_after_a_node_kill_are_bit_identical_and_at_most_one_step_is_lost(
    tmp_path: pathlib.Path,
    leaks: LeakCheck,
    request: pytest.FixtureRequest,
    backend: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Two nodes of one rank; the agent of the node that does not host the store is SIGKILLed
    (its worker dies with it) and a new node takes its place: it resumes from the copy of its
    rank's state that the lost node pushed to the survivor."""
    pytest.importorskip("torch")
    out = tmp_path / "out"
    out.mkdir()
    agent = one_rank_nodes(
        leaks,
        request,
        backend,
        f"node-kill-{backend}-{os.getpid()}",
        2,
        *(*LOST_FAST, "--max-restarts", "2", DDP, str(out), "30", "-1"),
        STATE_DDP_STEP_SECONDS="0.1",
    )
    host = agent()  # first: it hosts the built-in store, which must outlive this test's kill
    victim = agent()
    wait_until(lambda: (out / "step.0").exists() and int(read(out, "step.0") or 0) >= 10, 60)
    rank = next(r for r in range(2) if int(read(out, f"agent.{r}")) == victim.pid)
    killed_at = int(read(out, f"step.{rank}"))
    victim.kill()
    victim.communicate(timeout=10)
    survivor = host
    newcomer = agent()
    errors = [process.communicate(timeout=100)[1] for process in (survivor, newcomer)]
    assert [survivor.returncode, newcomer.returncode] == [0, 0], errors
    # A node's loss re-forms the job without spending a restart: attempt 0 again.
    resumed = {read(out, f"resumed.0.{rank}") for rank in range(2)}
    assert len(resumed) == 1, resumed
    assert killed_at - 1 - int(resumed.pop()) <= 1  # at most one step redone
    assert {read(out, f"weights.{rank}") for rank in range(2)} == uninterrupted(
        tmp_path_factory, "30"
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("backend", "replicas"), [("c10d", 2), ("etcd", 2), ("c10d", 1)])
def test_two_nodes_lost_at_once_leave_every_ranks_state_with_two_replicas(
    tmp_path: pathlib.Path,
    leaks: LeakCheck,
    request: pytest.FixtureRequest,
    backend: str,
    replicas: int,
) -> None:
    """Three nodes of one rank, each saving its own state (not replicated); two agents are
    SIGKILLed at once and two new nodes take their places. With ``--state-replicas 2`` each
    node's state was on both others, so the job resumes where it was; with 1, one lost node's
    only copy was on the other lost node, and the job starts afresh. The kills come once the
    copies caught up with the saves (the ranks paused): a copy that trails its save while the
    survivor saved one step more leaves no step every rank has (docs/recovery.md)."""
    out = tmp_path / "out"
    out.mkdir()
    agent = one_rank_nodes(
        leaks,
        request,
        backend,
        f"two-lost-{backend}-{replicas}-{os.getpid()}",
        3,
        *(*LOST_FAST, "--state-replicas", str(replicas), RING, str(out)),
    )

    host = agent()  # first: it hosts the built-in store, which must outlive this test's kills
    victims = [agent(), agent()]
    wait_until(lambda: min(ring_step(out, r) for r in range(3)) >= 10, 60, "every rank's step 10")
    (out / "pause").write_text("")
    directories = [read(out, f"dir.{rank}") for rank in range(3)]

    def copied() -> bool:  # each rank's newest save on both other nodes
        for rank, own in enumerate(directories):
            newest = max((head.step for head in committed(own, rank).values()), default=None)
            for other in directories:
                peers = os.path.join(other, PEERS)
                if other != own and newest not in {
                    head.step for head in committed(peers, rank).values()
                }:
                    return False
        return True

    if replicas == 2:
        wait_until(copied, 30, "the copies of the newest saves")
    paused_at = min(ring_step(out, rank) for rank in range(3))  # each saves one more at most
    for victim in victims:
        victim.kill()
    for victim in victims:
        victim.communicate(timeout=10)
    pids = {victim.pid for victim in victims}
    assert sum(int(read(out, f"agent.{rank}")) in pids for rank in range(3)) == 2
    newcomers = [agent(), agent()]
    wait_until(
        lambda: all(len(ring_resumed(out, rank)) == 2 for rank in range(3)),
        60,
        "the re-formed job",
    )
    os.unlink(out / "pause")
    stop_ring_at(out, max(ring_step(out, rank) for rank in range(3)) + 10)
    errors = [process.communicate(timeout=60)[1] for process in (host, *newcomers)]
    assert [process.returncode for process in (host, *newcomers)] == [0, 0, 0], errors
    after = {int(ring_resumed(out, rank)[-1]) for rank in range(3)}
    assert len(after) == 1, after  # every rank from the same step
    if replicas == 2:
        assert paused_at <= after.pop() <= paused_at + 1
    else:
        assert after == {-1}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("mode", "redone"),
    [("progress", 3), ("quiet", 0)],  # 11, 12, 13 after the save of step 10; every step saved
)
def test_the_goodput_ledger_adds_up_to_the_time_the_restart_lost(
    tmp_path: pathlib.Path, leaks: LeakCheck, mode: str, redone: int
) -> None:
    """The restart's causes, in the RESTART_COST event and the summary, add up (within 5 %) to
    what the job lost: from the failure to the restarted job beginning again the step it failed
    in. Workers that report no
    progress but keep state are seen back by their ``load_state``."""
    events = tmp_path / "events.jsonl"
    done = relaunch_cli(
        leaks,
        *("--nproc-per-node", "2", "--max-restarts", "1"),
        *("--event-log-handler", f"file:{events}"),
        str(HERE / "goodput_worker.py"),
        str(tmp_path),
        "14",
        mode,
    )
    assert done.returncode == 0, done.stderr
    lost = max(float(read(tmp_path, f"back.{rank}")) for rank in range(2))
    lost -= float(read(tmp_path, "failed"))
    (cost,) = [
        json.loads(event["metadata"]["metadata"])
        for event in map(json.loads, events.read_text().splitlines())
        if event["metadata"]["state"] == "RESTART_COST"
    ]
    seconds = cost["lost_seconds"]
    assert tuple(seconds) == CAUSES
    assert cost["steps_redone"] == redone
    # 5 %, or 20 ms where the restart is short (quiet: no steps redone; the worker's start
    # alone, which the ledger would miss without load_state, is some 60 ms of it)
    assert sum(seconds.values()) == pytest.approx(lost, rel=0.05, abs=0.02)
    (line,) = [line for line in done.stderr.splitlines() if "goodput:" in line]
    assert "lost over 1 restart" in line and "recomputation" in line


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["c10d", "etcd"])
def test_a_node_lost_while_its_copies_trail_resumes_from_a_copy_step_every_rank_kept(
    tmp_path: pathlib.Path, leaks: LeakCheck, request: pytest.FixtureRequest, backend: str
) -> None:
    """Two nodes of one rank, each saving 16 MiB of its own (not replicated) every 10 ms, so
    that a copy to the other node takes steps; with ``--state-copy-every 16`` both copy steps
    16, 32, ... and keep their own two newest (a copy may take up to 16 steps: a loaded
    machine's margin). The node that does not host the store is SIGKILLed while both train;
    the node that takes its place resumes from the lost node's copy, and the survivor from its
    own save of the same step (not from the start)."""
    out = tmp_path / "out"
    out.mkdir()
    agent = one_rank_nodes(
        leaks,
        request,
        backend,
        f"trailing-{backend}-{os.getpid()}",
        2,
        *(*LOST_FAST, "--state-copy-every", "16", RING, str(out)),
        RING_PAD_MB="16",
        RING_STEP_S="0.01",
    )

    host = agent()  # first: it hosts the built-in store, which must outlive this test's kill
    victim = agent()
    wait_until(lambda: (out / "agent.1").exists() and (out / "agent.0").exists(), 60)
    lost = next(rank for rank in range(2) if int(read(out, f"agent.{rank}")) == victim.pid)
    peers = os.path.join(read(out, f"dir.{1 - lost}"), PEERS)  # the survivor's copies

    def copied() -> int:  # the newest copy of the lost rank's state on the survivor
        return max((head.step for head in committed(peers, lost).values()), default=-1)

    wait_until(lambda: copied() >= 16, 60, "a copy of step 16 or later")
    copied_before = copied()
    victim.kill()
    victim.communicate(timeout=10)
    reached = max(ring_step(out, rank) for rank in range(2))
    newcomer = agent()
    wait_until(lambda: len(ring_resumed(out, lost)) == 2, 60, "the re-formed job")
    stop_ring_at(out, reached + 10)
    errors = [process.communicate(timeout=60)[1] for process in (host, newcomer)]
    assert [host.returncode, newcomer.returncode] == [0, 0], errors
    resumed = {int(ring_resumed(out, rank)[-1]) for rank in range(2)}
    assert len(resumed) == 1, resumed  # every rank from the same step
    (step_resumed,) = resumed
    assert step_resumed % 16 == 0 and copied_before <= step_resumed <= reached, (
        step_resumed,
        copied_before,
        reached,
    )
