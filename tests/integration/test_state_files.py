"""The slot files of kept state under a real SIGKILL: a save cut short never damages the save
before it (``relaunch.state``)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import LeakCheck, wait_until

import relaunch
from relaunch.core.workers import state as layout
from relaunch.state import api as state_api
from relaunch.state import files as state_files
from relaunch.state.files import committed

SAVER = textwrap.dedent(
    """
    import os, sys
    import relaunch
    step = 0
    while True:
        # 8 MiB of the step's byte: a save torn anywhere would mix two steps' bytes.
        relaunch.save_state({"step": step, "data": bytes([step % 251]) * (8 << 20)}, step)
        if step == 3:
            open(sys.argv[1], "w").close()
        step += 1
    """
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("delay", "copy_every"),
    [(0.0, 1), (0.003, 1), (0.011, 1), (0.023, 1), (0.037, 1), (0.005, 4), (0.029, 4)],
)
def test_a_save_killed_midway_leaves_the_previous_state_whole(
    tmp_path: pathlib.Path, leaks: LeakCheck, delay: float, copy_every: int
) -> None:
    """A saver SIGKILLed at varied moments: every slot still committed loads whole; with
    ``--state-copy-every 4`` (four slots), its two newest saves of copy steps are among them."""
    directory = tmp_path / "state"
    directory.mkdir()
    ready = tmp_path / "ready"
    env = {
        **leaks.process_env(),
        layout.STATE_DIR_ENV: str(directory),
        "RANK": "0",
        "LOCAL_RANK": "0",
        layout.COPY_EVERY_ENV: str(copy_every),
    }
    saver = subprocess.Popen([sys.executable, "-c", SAVER, str(ready)], env=env)
    wait_until(ready.exists, 30)
    time.sleep(delay)  # the kill's moment, varied: not a wait for a condition
    saver.send_signal(signal.SIGKILL)
    saver.wait(10)
    steps = sorted(head.step for head in committed(str(directory), 0).values())
    assert steps and steps[-1] >= 3
    if copy_every > 1:
        assert [step for step in steps if step % copy_every == 0][-2:] == [
            step for step in range(steps[-1], -1, -1) if step % copy_every == 0
        ][:2][::-1]
    for step in steps:  # every committed slot loads whole, with its own step's bytes
        os.environ.update({k: v for k, v in env.items() if k != "PATH"})
        os.environ[layout.STATE_STEP_ENV] = str(step)
        try:
            loaded = relaunch.load_state()
        finally:
            for name in (
                layout.STATE_DIR_ENV,
                layout.STATE_STEP_ENV,
                layout.COPY_EVERY_ENV,
                "RANK",
                "LOCAL_RANK",
            ):
                os.environ.pop(name, None)
        assert loaded is not None
        assert loaded[0] == step and loaded[1]["step"] == step
        assert loaded[1]["data"] == bytes([step % 251]) * (8 << 20)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kernel", ["populate-write", "older"])
def test_a_loaded_state_is_the_workers_own_memory(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, kernel: str
) -> None:
    """A tensor ``load_state`` gives is the worker's own: saving over both slots afterwards
    does not change it, and writing it does not change the kept state; so too where the
    kernel cannot copy a mapping's pages on demand (``older``: the part is read instead)."""
    torch = pytest.importorskip("torch")
    if kernel == "older":
        monkeypatch.setattr(state_files, "_POPULATE_WRITE", -1)  # madvise: EINVAL
    copied: list[memoryview | None] = []  # what each large part's copy-on-write mapping gave
    real = state_files._copied_pages

    def copied_pages(fd: int, offset: int, length: int) -> memoryview | None:
        copied.append(real(fd, offset, length))
        return copied[-1]

    monkeypatch.setattr(state_files, "_copied_pages", copied_pages)
    directory = tmp_path / "state"
    directory.mkdir()
    for name, value in {
        layout.STATE_DIR_ENV: str(directory),
        "RANK": "0",
        "LOCAL_RANK": "0",
        layout.STATE_STEP_ENV: "1",
    }.items():
        monkeypatch.setenv(name, value)
    large = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: a part mapped of its own
    try:
        relaunch.save_state({"weight": large, "small": torch.ones(4)}, 1)
        loaded = relaunch.load_state()
        assert loaded is not None
        weight = loaded[1]["weight"]
        assert copied and all((part is not None) == (kernel != "older") for part in copied)
        assert torch.equal(weight, large) and torch.equal(loaded[1]["small"], torch.ones(4))
        for step in (2, 3):  # both slots written again, one of them the one just loaded
            relaunch.save_state({"weight": torch.full((1 << 20,), float(step))}, step)
        assert torch.equal(weight, large)
        weight.add_(1)  # writable, and the worker's alone
        monkeypatch.setenv(layout.STATE_STEP_ENV, "3")
        again = relaunch.load_state()
        assert again is not None and bool((again[1]["weight"] == 3).all())
    finally:  # this test process is the worker: its slot files closed, as at a worker's exit
        for writer in state_api._slots.values():
            writer.close()
            os.close(writer.fd)
        state_api._forget()


LOADER = textwrap.dedent(
    """
    import sys, torch, relaunch
    from relaunch.state import files
    if sys.argv[1] in ("own", "save"):
        weight = torch.arange(1 << 22, dtype=torch.float32)
        relaunch.save_state({"w": weight}, 1, replicated=True)
    if sys.argv[1] in ("own", "replica"):
        weight = relaunch.load_state()[1]["w"]
        for step in (2, 3):  # the 2nd to the slot loaded from, and 100000 times smaller
            relaunch.save_state({"tiny": step}, step)
        print(torch.equal(weight, torch.arange(1 << 22, dtype=torch.float32)), len(files._mapped))
    """
)


@pytest.mark.timeout(60)
def test_a_smaller_save_over_the_slot_loaded_from_leaves_the_loaded_tensors(
    tmp_path: pathlib.Path, leaks: LeakCheck
) -> None:
    """A tensor loaded from the rank's own slot is that slot's pages, copied on write: a save
    of a much smaller state over that slot must not shorten its file (which would take the
    pages from under the tensor: a SIGBUS). A rank that loads another rank's replicated save
    reads it instead (that rank's process may shorten its own file)."""
    pytest.importorskip("torch")

    def run(directory: pathlib.Path, rank: int, what: str) -> list[str]:
        directory.mkdir(exist_ok=True)
        env = {
            layout.STATE_DIR_ENV: str(directory),
            layout.STATE_STEP_ENV: "1",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
        }
        done = subprocess.run(
            [sys.executable, "-c", LOADER, what],
            env=leaks.process_env(**env),
            capture_output=True,
            text=True,
            timeout=50,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    assert run(tmp_path / "own", 0, "own") == ["True", "1"]  # mapped, and never shortened
    run(tmp_path / "replica", 0, "save")
    assert run(tmp_path / "replica", 1, "replica") == ["True", "0"]  # rank 0's: read


LAZY = textwrap.dedent(
    """
    import os, sys, torch, relaunch

    torch.set_num_threads(1)  # no thread pool for the forked child to inherit mid-use

    def load(step):
        os.environ["RELAUNCH_STATE_STEP"] = str(step)
        return relaunch.load_state()[1]["w"]

    def copied_kib(tensor):  # the worker's own pages (copies) of the mapping holding tensor
        at = tensor.data_ptr()
        with open("/proc/self/smaps") as smaps:
            inside = False
            for line in smaps:
                head = line.split()[0]
                if "-" in head and not head.endswith(":"):
                    low, high = (int(bound, 16) for bound in head.split("-"))
                    inside = low <= at < high
                elif inside and head == "Anonymous:":
                    return int(line.split()[1])
        raise AssertionError("no mapping holds the tensor")

    first = torch.arange(1 << 22, dtype=torch.float32)  # 16 MiB
    relaunch.save_state({"w": first}, 1)
    weight = load(1)
    seen = [copied_kib(weight)]
    weight[: 1 << 20].add_(0)  # its first 4 MiB written
    seen.append(copied_kib(weight))
    relaunch.save_state({"w": torch.zeros(1 << 22)}, 2)  # the other slot
    seen.append(copied_kib(weight))
    relaunch.save_state({"w": torch.ones(1 << 22)}, 3)  # over the slot loaded from
    print(*seen, torch.equal(weight, first))

    weight = load(3)  # mapped afresh, nothing copied: then a fork, and two saves
    reading, writing = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(writing)
        os.read(reading, 1)  # the parent saved over the slot
        os._exit(0 if torch.equal(weight, torch.ones(1 << 22)) else 1)
    os.close(reading)
    for step in (4, 5):
        relaunch.save_state({"w": torch.full((1 << 22,), float(step))}, step)
    os.write(writing, b"x")
    status = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    print(status, torch.equal(weight, torch.ones(1 << 22)))
    """
)


@pytest.mark.timeout(60)
def test_a_load_copies_a_page_only_when_written_or_before_the_next_save_or_fork(
    tmp_path: pathlib.Path, leaks: LeakCheck
) -> None:
    """``load_state`` maps the rank's own slot and copies nothing on the way back from a
    failure: a page becomes the worker's own when written, or every one at once before this
    process saves (a save over the slot loaded from would change them) or forks (whose child
    would share them with the slot). The loaded tensors keep their values through both, in
    the parent and in the child."""
    pytest.importorskip("torch")
    directory = tmp_path / "state"
    directory.mkdir()
    env = {layout.STATE_DIR_ENV: str(directory), "RANK": "0", "LOCAL_RANK": "0"}
    done = subprocess.run(
        [sys.executable, "-c", LAZY],
        env=leaks.process_env(**env),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 0, done.stderr
    loaded, written, saved, kept, child, kept_again = done.stdout.split()
    assert int(loaded) <= 8, done.stdout  # a page of the header's
    assert 4 << 10 <= int(written) <= (4 << 10) + 8, done.stdout  # the pages written
    assert int(saved) >= 16 << 10, done.stdout  # all 16 MiB copied before the save
    assert kept == "True"
    assert (child, kept_again) == ("0", "True")


def test_an_agreed_step_uncommits_every_later_save_and_copy(tmp_path: pathlib.Path) -> None:
    """Once the nodes agreed on a step, the saves and copies of later steps belong to a history
    the world left: none of them may ever be taken for one of the new history's."""
    from relaunch.state.files import PEERS, SlotWriter, forget_after

    (tmp_path / PEERS).mkdir()
    for where, rank, slot, step in [
        ("", 0, 0, 5),
        ("", 0, 1, 6),
        ("", 3, 2, 8),
        (PEERS, 1, 0, 5),
        (PEERS, 1, 1, 7),
    ]:
        fd = os.open(tmp_path / where / layout.slot_name(rank, slot), os.O_RDWR | os.O_CREAT)
        writer = SlotWriter(fd)
        writer.write(step, step, [memoryview(b"x" * 10)])
        writer.close()
        os.close(fd)

    def steps(where: str, rank: int) -> list[int]:
        return sorted(head.step for head in committed(str(tmp_path / where), rank).values())

    forget_after(str(tmp_path), 5)
    assert (steps("", 0), steps("", 3), steps(PEERS, 1)) == ([5], [], [5])
    forget_after(str(tmp_path), None)  # the world starts afresh
    assert (steps("", 0), steps(PEERS, 1)) == ([], [])
