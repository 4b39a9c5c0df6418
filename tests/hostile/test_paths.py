"""Paths another user may have planted: the event log's symbolic link, the timer FIFO of
``TORCHELASTIC_TIMER_FILE``, and the pids a timer FIFO's writer names; and places where no
log, state or event-log directory can be made (a link to nothing, ``/sys``)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import LeakCheck, pid_alive, wait_until

from relaunch.events import Event, EventSource, JsonLinesEventHandler
from relaunch.timer import FileTimerServer

pytestmark = pytest.mark.timeout(60)


def relaunch(leaks: LeakCheck, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relaunch", *argv],
        capture_output=True,
        text=True,
        env=leaks.process_env(**env),
        timeout=30,
    )


def one_line_exit_2(done: subprocess.CompletedProcess[str], *says: str) -> None:
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
    for text in says:
        assert text in done.stderr, done.stderr


def event(name: str = "e") -> Event:
    return Event(name=name, source=EventSource.AGENT)


def test_a_symlink_planted_as_the_event_log_is_refused_at_start(tmp_path, leaks) -> None:
    job = tmp_path / "job.py"
    job.write_text("pass\n")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "events.jsonl").symlink_to(victim)
    done = relaunch(leaks, "--event-log-handler", f"file:{tmp_path}/events.jsonl", str(job))
    one_line_exit_2(done, "events.jsonl", "symbolic link", "does not follow")
    assert victim.read_text() == "precious\n"


def test_the_event_log_never_follows_a_symlink_planted_later_or_at_rotation(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    path = tmp_path / "events.jsonl"
    handler = JsonLinesEventHandler(path, max_bytes=200)  # each line of 100 x's rotates it
    try:
        handler.record(event("first"))
        (tmp_path / "events.jsonl.1").symlink_to(victim)  # the rename replaces the link
        handler.record(event("x" * 100))
        assert not (tmp_path / "events.jsonl.1").is_symlink()
        path.unlink()  # while the handler still writes the file it opened ...
        path.symlink_to(victim)  # ... a link is planted where it opens the next one
        with caplog.at_level(logging.WARNING, logger="relaunch.events"):
            for _ in range(4):
                handler.record(event("x" * 100))  # never raises
    finally:
        handler.close()
    assert victim.read_text() == "precious\n"
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "symbolic link" in said[0] and str(path) in said[0], said


@pytest.mark.parametrize("problem", ["writable by others", "not ours", "symlink", "regular file"])
def test_an_unsafe_timer_fifo_is_refused(tmp_path, leaks: LeakCheck, problem: str) -> None:
    job = tmp_path / "job.py"
    job.write_text("pass\n")
    fifo = str(tmp_path / "timers.fifo")
    if problem == "regular file":
        open(fifo, "w").close()
    else:
        os.mkfifo(fifo, 0o600)
    if problem == "writable by others":
        os.chmod(fifo, 0o622)
    elif problem == "not ours":
        os.chown(fifo, 65534, 65534) if os.geteuid() == 0 else pytest.skip("chown needs root")
    elif problem == "symlink":
        os.rename(fifo, fifo + ".real")
        os.symlink(fifo + ".real", fifo)
    says = {
        "writable by others": "writable by other users",
        "not ours": "belongs to uid 65534",
        "symlink": "is a symbolic link",
        "regular file": "is not a FIFO",
    }[problem]
    done = relaunch(leaks, "--timers", str(job), TORCHELASTIC_TIMER_FILE=fifo)
    one_line_exit_2(done, "TORCHELASTIC_TIMER_FILE", says)
    server = FileTimerServer(fifo, "run")
    with pytest.raises(ValueError, match=says):
        server.start()


def test_the_agents_own_fifo_is_accepted(tmp_path, leaks: LeakCheck) -> None:
    job = tmp_path / "job.py"
    job.write_text("import relaunch.timer as t\nwith t.expires(after=30):\n    print('timed')\n")
    fifo = str(tmp_path / "timers.fifo")
    os.mkfifo(fifo, 0o600)
    done = relaunch(leaks, "--timers", "--tee", "1", str(job), TORCHELASTIC_TIMER_FILE=fifo)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[default0]:timed\n"


def test_the_file_timer_server_reaps_only_its_descendants_by_default(
    tmp_path, leaks: LeakCheck, caplog: pytest.LogCaptureFixture
) -> None:
    # A process that is not this one's descendant: the shell that started it is gone.
    started = subprocess.run(
        ["sh", "-c", "sleep 60 </dev/null >/dev/null 2>&1 & echo $!"],
        capture_output=True,
        text=True,
        env=leaks.process_env(),
        timeout=10,
    )
    stranger = int(started.stdout)
    child = subprocess.Popen(["sleep", "60"], env=leaks.process_env())
    reaped: list[int] = []
    server = FileTimerServer(
        str(tmp_path / "timers.fifo"),
        "run",
        max_interval=0.05,
        on_reap=lambda worker, timers: reaped.append(int(worker)),
    )
    server.start()
    try:
        with caplog.at_level(logging.WARNING):
            # A FIFO writer names pids: the stranger's and a child's, both already expired.
            with open(server.file_path, "w") as fifo:
                for pid in (stranger, child.pid):
                    fifo.write(
                        json.dumps({"pid": pid, "scope_id": "s", "expiration_time": 1, "signal": 9})
                        + "\n"
                    )
            assert child.wait(timeout=20) == -signal.SIGKILL
            wait_until(
                lambda: any(str(stranger) in r.getMessage() for r in caplog.records),
                what="the stranger's request to be turned down",
            )
        assert reaped == [child.pid]
        assert pid_alive(stranger)
    finally:
        server.stop()
        try:
            os.kill(stranger, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.kill()
        child.wait()
    time.sleep(0)  # nothing to wait for: the stranger is init's to reap


#: Places no directory can be made in, each as a template of ``tmp_path``: a symbolic link to
#: nothing (os.makedirs: "File exists"), a place under one, and under /sys, where os.access says
#: yes to root and mkdir says EPERM (issue 43, item 8).
UNMAKEABLE = {
    "a link to nothing": ("{tmp}/dangling", "is a symbolic link to {tmp}/nowhere"),
    "under a link to nothing": ("{tmp}/dangling/logs", "is a symbolic link to {tmp}/nowhere"),
    "a new place under /sys": ("/sys/relaunch-{name}", "/sys is not writable by this user"),
    "a directory under /sys": ("/sys/kernel", "/sys/kernel is not writable by this user"),
}


@pytest.mark.parametrize("flag", ["--log-dir", "--state-dir", "--event-log-handler"])
@pytest.mark.parametrize("place", list(UNMAKEABLE))
def test_a_place_no_directory_can_be_made_in_is_one_line(
    tmp_path, leaks: LeakCheck, flag: str, place: str
) -> None:
    if place.endswith("/sys") and not os.path.isdir("/sys/kernel"):
        pytest.skip("no sysfs at /sys here")
    path, says = (text.format(tmp=tmp_path, name=tmp_path.name) for text in UNMAKEABLE[place])
    if place.endswith("/sys") and flag != "--event-log-handler":
        says = "is under /sys, which holds the kernel's files"  # a directory: refused by its place
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    job = tmp_path / "job.py"
    job.write_text("pass\n")
    before = sorted(os.listdir(tmp_path))
    named = f"{path}/events.jsonl" if flag == "--event-log-handler" else path
    done = relaunch(leaks, flag, f"file:{named}" if named != path else path, str(job))
    one_line_exit_2(done, named, says)
    assert sorted(os.listdir(tmp_path)) == before, "nothing made, nothing left behind"
    assert not os.path.lexists(f"/sys/relaunch-{tmp_path.name}")


def test_a_log_dir_that_cannot_be_made_when_the_launch_starts_is_one_line(tmp_path) -> None:
    """The directory is made before the rendezvous: a problem the check could not foresee (the
    place changed since, a filesystem that refuses the name) is one line as well."""
    from relaunch.cli.args import make_log_dir
    from relaunch.config import ConfigError, LaunchConfig

    (tmp_path / "a_file").write_text("")
    config = LaunchConfig(1, 1, 1, log_dir=str(tmp_path / "a_file" / "logs"))
    with pytest.raises(ConfigError, match=r"^--log-dir .*/a_file/logs cannot be created \(Not a"):
        make_log_dir(config)
    made = LaunchConfig(1, 1, 1, log_dir=str(tmp_path / "new" / "logs"))
    make_log_dir(made)
    assert (tmp_path / "new" / "logs").is_dir()
