"""A full log disk (issue 24, item 2): a small tmpfs, mounted by the test as root, is the
``--log-dir``. The worker fills it, then fails with an exception under ``@relaunch.record``,
whose error file cannot be written either. relaunch must say once which file could not be
written and why, keep the console going, end with the job's normal status (1) within the
timeout, and show the worker's traceback in the failure report (from the stderr tail it keeps
in memory)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator

import pytest
from conftest import LeakCheck, tmpfs

pytestmark = pytest.mark.timeout(60)

WORKER = textwrap.dedent(
    """
    import sys, relaunch

    @relaunch.record
    def main():
        for i in range(3000):  # about 200 kB on each stream: more than the disk holds
            print(f"line {i} " + "x" * 60, flush=True)
            print(f"err {i} " + "y" * 60, file=sys.stderr, flush=True)
        print("after the disk filled", flush=True)
        raise RuntimeError("the root cause of issue 24")

    main()
    """
)


@pytest.fixture
def full_disk() -> Iterator[str]:
    """A 64 KiB tmpfs, unmounted afterwards."""
    path = tempfile.mkdtemp(prefix="relaunch-full-disk-")
    try:
        with tmpfs(path, "size=64k"):
            yield path
    finally:
        os.rmdir(path)


def launch(leaks: LeakCheck, tmp_path, log_dir: str, *flags: str) -> subprocess.CompletedProcess:
    job = tmp_path / "fill.py"
    job.write_text(WORKER)
    return subprocess.run(
        [sys.executable, "-m", "relaunch", "--log-dir", log_dir, *flags, str(job)],
        capture_output=True,
        text=True,
        env=leaks.process_env(),
        timeout=40,  # before the fix, --tee never ended
    )


def said_once(stderr: str, log_dir: str) -> None:
    said = [line for line in stderr.splitlines() if line.startswith("relaunch: cannot write ")]
    assert len(said) == 1, said
    assert log_dir in said[0] and "No space left on device" in said[0], said


def root_cause(stderr: str) -> str:
    assert "Root cause (first failure):" in stderr, stderr[-3000:]
    report = stderr[stderr.index("Root cause (first failure):") :]
    assert "Traceback (most recent call last):" in report, report
    assert "RuntimeError: the root cause of issue 24" in report, report
    assert "kept in memory" in report and "No space left on device" in report, report
    return report


@pytest.mark.parametrize("flag", ["--tee", "--redirects"])
def test_a_full_log_disk_loses_neither_the_console_nor_the_root_cause(
    tmp_path, leaks: LeakCheck, full_disk: str, flag: str
) -> None:
    done = launch(leaks, tmp_path, full_disk, flag, "3")
    assert done.returncode == 1, done.stderr[-3000:]
    said_once(done.stderr, full_disk)
    report = root_cause(done.stderr)
    # @record could not write the error file: the worker's own line says so, from memory too.
    assert "cannot write error file" in report
    assert not any(name.endswith(".tmp") for _, _, names in os.walk(full_disk) for name in names)
    if flag == "--tee":
        assert "[default0]:after the disk filled" in done.stdout, "the console goes on"
        assert "[default0]:err 2999 " in done.stderr
    else:
        assert done.stdout == ""


def test_a_log_file_that_fails_is_said_once_and_the_stderr_tail_kept(tmp_path) -> None:
    """The mechanism, on /dev/full (every write: ENOSPC): the copy never raises, the line is
    said once for the whole process, the console still gets every line, the tail is kept."""
    from relaunch.procs import rank_streams
    from relaunch.procs.console import Console

    out, err = io.StringIO(), io.StringIO()
    console = Console(out, err)
    rank_streams._told.discard(28)
    streams = []
    for n in range(2):
        read_fd, write_fd = os.pipe()
        log_fd = os.open("/dev/full", os.O_WRONLY)
        stream = rank_streams.TeeStream(
            read_fd, log_fd, console, b"[r0]:", err=True, log_path=f"/full/{n}/stderr.log"
        )
        for _ in range(6):  # 200 kB, a pipe's worth at a time
            os.write(write_fd, b"x" * 32_767 + b"\n")
            assert not stream.pump(until_empty=True)
        os.write(write_fd, b"RuntimeError: boom\n")
        os.close(write_fd)
        assert stream.pump(until_empty=True)
        assert stream.log_error == "[Errno 28] No space left on device"
        console.write(b"", stream.take_pending())
        stream.finish()
        streams.append(stream)
    said = [line for line in err.getvalue().splitlines() if line.startswith("relaunch:")]
    assert len(said) == 1 and "/full/0/stderr.log: [Errno 28] No space left on device" in said[0]
    assert err.getvalue().count("[r0]:RuntimeError: boom") == 2, "the console goes on"
    tail = streams[1].stderr_tail()
    assert tail is not None and tail.endswith(b"RuntimeError: boom\n")
    assert len(tail) == rank_streams.STDERR_TAIL_BYTES
