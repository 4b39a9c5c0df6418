"""A worker against the zygote of ``--preload`` (issue 43, item 5): nothing on the zygote's
socket is trusted, and a worker's exit is seen from its own pidfd, not through the zygote.

The real ``relaunch --preload json`` runs two ranks. In the first attempt rank 0 turns on its
parent, the zygote, then fails; the second attempt must start from a new zygote and succeed,
with one line about the old one, no traceback, no hang:

- ``garbage``: rank 0 takes the zygote's end of its socket to the agent (``pidfd_getfd``: the
  zygote is its parent, the same uid) and writes bytes that are no reply (a length, then data
  that is no marshal data);
- ``forge``: rank 0 writes, on that socket, a reply in the agent's format that names a decoy,
  a process of its own (not the zygote's child), with the sequence number the agent's next
  request has (3: the first attempt's two ranks had 1 and 2) and a pipe and a pidfd of it;
- ``stop``: rank 0 SIGSTOPs the zygote, then fails: its exit must be seen within seconds,
  though the zygote, stopped, never reaps it, with its own status (the kernel's, as the zygote
  never gave it); and the goodput line says how long the agent took to know (not 0.00s).
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import platform
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import LeakCheck, pid_alive, wait_until

from relaunch.procs.zygote import Zygote, python_command

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="pidfd_getfd is syscall 438 here"),
]

#: What a run may take, on a loaded machine: a hang (the old agent tracked the decoy, or waited
#: for the stopped zygote) runs into it.
RUN_TIMEOUT = 45.0

#: argv: OUT MODE. Each worker writes OUT/<attempt>-<rank>.json (pid, parent, time) as it starts.
#: In attempt 0 rank 1 waits to be stopped; rank 0 does MODE once rank 1 is up, then exits 1.
#: Attempt 1 exits 0.
WORKER = textwrap.dedent(
    """
    import ctypes, json, os, signal, sys, time

    out, mode = sys.argv[1], sys.argv[2]
    attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]

    def write(name, value):
        path = os.path.join(out, name)
        with open(path + ".tmp", "w") as file:
            json.dump(value, file)
        os.rename(path + ".tmp", path)

    write(f"{attempt}-{rank}.json", {"pid": os.getpid(), "ppid": os.getppid(), "time": time.time()})
    if attempt != "0":
        sys.exit(0)
    if rank != "0":
        time.sleep(120)
    while not os.path.exists(os.path.join(out, "0-1.json")):
        time.sleep(0.005)

    def zygote_socket():
        zygote = os.getppid()
        with open(f"/proc/{zygote}/cmdline", "rb") as file:
            argv = file.read().split(b"\\0")
        number = int(next(argv[i + 1] for i, a in enumerate(argv) if a.endswith(b"_program.py")))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        pidfd = os.pidfd_open(zygote)
        fd = libc.syscall(438, pidfd, number, 0)  # pidfd_getfd
        if fd < 0:
            raise OSError(ctypes.get_errno(), "pidfd_getfd")
        import socket
        return socket.socket(fileno=fd)

    if mode == "garbage":
        zygote_socket().sendall(b"\\x10\\x00\\x00\\x00" + b"\\xff" * 16)
    elif mode == "forge":
        sock = zygote_socket()
        decoy = os.fork()
        if decoy == 0:
            os.setsid()
            for fd in (0, 1, 2):  # else the agent reads the old group's pipes until they end
                os.dup2(os.open(os.devnull, os.O_RDWR), fd)
            env = {k: v for k, v in os.environ.items() if k != "RELAUNCH_TREE"}
            os.execve(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)"], env)
        write("decoy.json", decoy)
        status_r, status_w = os.pipe()
        reply = (3).to_bytes(8, "little") + decoy.to_bytes(4, "little")
        fds = [status_r, os.pidfd_open(decoy)]
        sock.sendmsg([reply], [(1, 1, b"".join(fd.to_bytes(4, sys.byteorder) for fd in fds))])
    elif mode == "stop":
        os.kill(os.getppid(), signal.SIGSTOP)
        write("stopped.json", time.time())
    sys.exit(1)
    """
)


def run(
    leaks: LeakCheck, tmp_path: pathlib.Path, mode: str, *flags: str
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    (tmp_path / "out").mkdir()
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "relaunch",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--preload",
            "json",
            *flags,
            str(script),
            str(tmp_path / "out"),
            mode,
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=leaks.process_env(),
        stdin=subprocess.DEVNULL,
        timeout=RUN_TIMEOUT,
    )


def seen(tmp_path: pathlib.Path, name: str) -> object:
    with open(tmp_path / "out" / name) as file:
        return json.load(file)


def zygote_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "--preload" in line and "zygote" in line]


def assert_a_new_zygote_took_over(done: subprocess.CompletedProcess[str], tmp_path) -> None:
    """The run went on from a new zygote: both ranks of attempt 1 are its children, one line
    said why the old one was let go, and nothing raised."""
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    old = seen(tmp_path, "0-0.json")["ppid"]  # type: ignore[index]
    new = {seen(tmp_path, f"1-{rank}.json")["ppid"] for rank in (0, 1)}  # type: ignore[index]
    assert len(new) == 1 and old not in new, (old, new)
    assert not pid_alive(old)
    assert len(zygote_lines(done.stderr)) == 1, done.stderr


def test_garbage_on_the_zygotes_socket_is_a_lost_zygote(
    leaks: LeakCheck, tmp_path: pathlib.Path
) -> None:
    done = run(leaks, tmp_path, "garbage")
    assert_a_new_zygote_took_over(done, tmp_path)
    (line,) = zygote_lines(done.stderr)
    assert "reply" in line, line


def test_a_forged_reply_naming_a_decoy_is_not_tracked(
    leaks: LeakCheck, tmp_path: pathlib.Path
) -> None:
    decoy = None
    try:
        done = run(leaks, tmp_path, "forge")
        decoy = seen(tmp_path, "decoy.json")
        assert isinstance(decoy, int)
        assert_a_new_zygote_took_over(done, tmp_path)
        (line,) = zygote_lines(done.stderr)
        assert f"pid {decoy}" in line and "not a child" in line, line
        assert pid_alive(decoy)  # never taken for a rank: nobody stopped it
        assert str(decoy) not in done.stderr.replace(line, "")
    finally:
        if decoy is None and (tmp_path / "out" / "decoy.json").exists():
            decoy = seen(tmp_path, "decoy.json")
        if isinstance(decoy, int) and pid_alive(decoy):
            os.kill(decoy, signal.SIGKILL)


def test_a_stopped_zygote_delays_no_exit(leaks: LeakCheck, tmp_path: pathlib.Path) -> None:
    began = time.time()
    events = tmp_path / "events.jsonl"
    done = run(leaks, tmp_path, "stop", "--event-log-handler", f"file:{events}")
    assert_a_new_zygote_took_over(done, tmp_path)
    (line,) = zygote_lines(done.stderr)
    assert "exit status" in line and "exited with code 1, read from /proc" in line, line
    assert re.search(r"rank 0 \(local_rank 0, .*\) exited with code 1", done.stderr), done.stderr
    stopped = seen(tmp_path, "stopped.json")
    restarted = seen(tmp_path, "1-0.json")["time"]  # type: ignore[index]
    assert isinstance(stopped, float) and began < stopped < restarted
    # The new zygote imports and the agent rejoins in that time too: well under a second each.
    assert restarted - stopped < 10.0, restarted - stopped
    # The exit was seen at once, its status not: the agent knew after the zygote's bound (1 s).
    # (The restart's cost is in its event: the summary has no goodput line for workers that
    # report no steps.)
    (cost,) = [
        json.loads(event["metadata"]["metadata"])
        for event in map(json.loads, events.read_text().splitlines())
        if event["metadata"]["state"] == "RESTART_COST"
    ]
    detection = cost["lost_seconds"]["detection"]
    assert 0.9 <= detection < 5.0, cost


def steal_zygote_socket(zygote: int) -> socket.socket:
    """The zygote's end of its socket to the agent, as a worker takes it (``pidfd_getfd``)."""
    with open(f"/proc/{zygote}/cmdline", "rb") as file:
        argv = file.read().split(b"\0")
    number = int(next(argv[i + 1] for i, arg in enumerate(argv) if arg.endswith(b"_program.py")))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    pidfd = os.pidfd_open(zygote)
    try:
        fd = libc.syscall(438, pidfd, number, 0)
    finally:
        os.close(pidfd)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "pidfd_getfd")
    return socket.socket(fileno=fd)


@pytest.fixture
def sleeper_zygote(leaks: LeakCheck, tmp_path: pathlib.Path) -> Iterator[tuple[Zygote, Callable]]:
    """A zygote of ``--preload json`` in this process, and ``spawn()``: a worker that sleeps."""
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(60)\n")
    argv = [sys.executable, str(script)]
    command = python_command(argv)
    assert command is not None
    env = leaks.process_env()
    zygote = Zygote(["json"], command, env)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        yield zygote, lambda: zygote.spawn(argv, env, devnull, devnull)
    finally:
        zygote.close()
        os.close(devnull)


def test_a_reply_naming_a_child_forked_before_is_refused(
    sleeper_zygote: tuple[Zygote, Callable], caplog: Any
) -> None:
    """A forged reply to the second request names the first child (a real child of the
    zygote, with its real pidfd): no second handle holds it; a new zygote forks the second."""
    zygote, spawn = sleeper_zygote
    first = spawn()
    assert first is not None
    old = zygote.pid
    assert old is not None
    status_r, status_w = os.pipe()
    pidfd = os.pidfd_open(first.pid)
    blob = b"".join(fd.to_bytes(4, sys.byteorder) for fd in (status_r, pidfd))
    reply = (2).to_bytes(8, "little") + first.pid.to_bytes(4, "little")
    with steal_zygote_socket(old) as stolen:
        stolen.sendmsg([reply], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, blob)])
    for fd in (status_r, status_w, pidfd):
        os.close(fd)
    second = spawn()
    assert second is not None and second.pid != first.pid
    assert zygote.pid != old and zygote.started == 2
    assert first.wait(10) == -signal.SIGKILL  # it died with its zygote
    (line,) = [r.getMessage() for r in caplog.records if "zygote" in r.getMessage()]
    assert f"it names pid {first.pid}, which the zygote forked before" in line, line
    second.kill()
    assert second.wait(10) == -signal.SIGKILL
    first.release()
    second.release()


def test_what_is_no_exit_status_is_a_lost_zygote(
    sleeper_zygote: tuple[Zygote, Callable], caplog: Any
) -> None:
    """Bytes that are no wait status in a child's status pipe (written through the zygote's
    end of it, which a worker can open in /proc) make the zygote lost; the child reads as
    killed, at once."""
    zygote, spawn = sleeper_zygote
    child = spawn()
    assert child is not None
    old = zygote.pid
    assert old is not None
    os.kill(old, signal.SIGSTOP)  # it never writes the real status
    pipe = os.fstat(child.status_fd).st_ino
    for name in os.listdir(f"/proc/{old}/fd"):
        if os.readlink(f"/proc/{old}/fd/{name}") == f"pipe:[{pipe}]":
            fd = os.open(f"/proc/{old}/fd/{name}", os.O_WRONLY)
            os.write(fd, b"xx")
            os.close(fd)
            break
    else:
        pytest.fail("the zygote holds no end of the status pipe")
    os.kill(child.pid, signal.SIGKILL)
    began = time.monotonic()
    assert child.wait(10) == -signal.SIGKILL
    assert time.monotonic() - began < 0.5  # no wait for a status that is none
    wait_until(lambda: not pid_alive(old), 10, "the lost zygote's end")
    (line,) = [r.getMessage() for r in caplog.records if "zygote" in r.getMessage()]
    assert f"gave b'xx' as the exit status of pid {child.pid}, which is none" in line, line
    child.release()
    again = spawn()  # from a new zygote
    assert again is not None and zygote.pid not in (None, old)
    again.kill()
    assert again.wait(10) == -signal.SIGKILL
    again.release()
