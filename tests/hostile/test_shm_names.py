"""No name of the worker channel or of kept state in /dev/shm can be taken, planted or read by
another user, no path of theirs is followed through a link or waited on, and what a job killed
whole leaves there is removed by the next relaunch on the host (issue 43, item 6).

Before: the channel was ``/dev/shm/relaunch_channel_XXXX`` with FIFOs, bounds files and the
parking socket at predictable names beside it. Another user who made those names first crashed
every agent (``os.mkfifo``: ``FileExistsError``), a FIFO at ``.bounds0`` hung the agent at its
first restart, a link at ``.bounds0.<pid>`` made a worker write through it, and a job killed
whole (agent, guardian, workers) left its channel and its state in /dev/shm until reboot."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
from conftest import LeakCheck

from relaunch.agent.channel import Channel
from relaunch.agent.parking import parking_path
from relaunch.core import channel as layout
from relaunch.core.sections import Learned

pytestmark = pytest.mark.timeout(120)

DRIVER = str(pathlib.Path(__file__).with_name("shm_driver.py"))
#: What relaunch names its directories in /dev/shm (``agent.shm``).
PREFIXES = ("relaunch_channel_", "relaunch_state_")


@pytest.fixture
def opened() -> Iterator[Channel]:
    made = Channel(2)
    yield made
    made.close()


def test_the_channel_lies_in_a_directory_of_its_own() -> None:
    opened = Channel(2)
    directory = os.path.dirname(opened.path)
    assert os.path.basename(directory).startswith(PREFIXES[0])
    assert stat.S_IMODE(os.lstat(directory).st_mode) == 0o700
    for path in (
        opened.path,
        layout.wake_path(opened.path),
        layout.pending_path(opened.path, 1),
        parking_path(opened.path),
    ):
        assert os.path.dirname(path) == directory
    assert stat.S_IMODE(os.lstat(opened.path).st_mode) == 0o600
    opened.close()
    assert not os.path.exists(directory)


def test_a_fifo_where_the_bounds_are_is_passed_over(opened: Channel) -> None:
    """The agent reads the bounds the workers wrote at each restart: a FIFO there (which
    nothing writes) is not waited on."""
    fifo = opened.path + ".bounds0"  # where the workers' bounds were files, before the channel
    os.mkfifo(fifo, 0o600)
    read: list[Learned] = []
    reader = threading.Thread(target=lambda: read.append(opened.learned()), daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # let it go: open the FIFO's other end
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail("reading the workers' bounds waited on a FIFO")
    assert read == [Learned()]


def test_a_link_where_a_worker_wrote_its_bounds_is_not_followed(
    tmp_path: pathlib.Path, opened: Channel
) -> None:
    """A worker writes its bounds into its rank's part of the channel, no file beside it: links
    planted at the names of the files it once wrote (``.bounds0.<pid>``, ``.bounds0``) are
    never written through, and its agent reads what it learned."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    code = (
        "import os, sys\n"
        "from relaunch import worker\n"
        "path = os.environ['RELAUNCH_CHANNEL']\n"
        "os.symlink(sys.argv[1], f'{path}.bounds0.{os.getpid()}')\n"
        "os.symlink(sys.argv[1], f'{path}.bounds0')\n"
        "assert worker._open() is not None\n"
        "for _ in range(5):\n"
        "    worker._Live.beat_gaps.observe(1.0)\n"
        "worker._keep_learned()\n"
    )
    env = {**os.environ, **opened.env(), "LOCAL_RANK": "0"}
    subprocess.run([sys.executable, "-c", code, str(victim)], env=env, check=True, timeout=30)
    assert victim.read_text() == "precious"
    assert opened.learned() == Learned({}, (5, 1.0))
    beside = pathlib.Path(opened.path).parent.iterdir()
    assert all(p.is_symlink() for p in beside if p.name.startswith("channel.bounds"))


def in_private_shm(leaks: LeakCheck, mode: str, out: pathlib.Path) -> dict[str, object]:
    """``shm_driver.py MODE OUT``, run in a mount namespace of its own with a fresh /dev/shm;
    skips where none can be made (not root, no unshare)."""
    if os.geteuid() != 0:
        pytest.skip("a squatter of another user and a private /dev/shm need root")
    if shutil.which("unshare") is None:
        pytest.skip("util-linux's unshare is not installed")
    mount = 'mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec "$0" "$@"'
    argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", mount]
    probe = subprocess.run([*argv, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a private /dev/shm: {probe.stderr.strip()}")
    done = subprocess.run(
        [*argv, sys.executable, DRIVER, mode, str(out)],
        capture_output=True,
        text=True,
        env=leaks.process_env(),
        timeout=110,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_another_user_cannot_take_the_channels_names(
    tmp_path: pathlib.Path, leaks: LeakCheck
) -> None:
    """Five jobs, each restarting once, while a user of its own (``nobody``) makes the names
    relaunch used to make beside a channel, as soon as one appears: each ends 0."""
    os.chmod(tmp_path, 0o755)  # nobody may read the driver's output directory, not write it
    result = in_private_shm(leaks, "squat", tmp_path)
    assert result["runs"] == [0] * 5, result
    assert isinstance(result["squatted"], int) and result["squatted"] >= 5  # it was there


def test_what_a_job_killed_whole_leaves_is_removed_by_the_next(
    tmp_path: pathlib.Path, leaks: LeakCheck
) -> None:
    """A job keeping state is SIGKILLed whole at once (agent, guardian and workers, as a
    cgroup kill): its channel and state directories stay, and the next relaunch removes them."""
    result = in_private_shm(leaks, "killed", tmp_path)
    left = result["left"]
    assert isinstance(left, list)
    assert {prefix for prefix in PREFIXES for name in left if name.startswith(prefix)} == set(
        PREFIXES
    ), result
    assert result["second"] == 0, result
    assert result["after"] == [], result
