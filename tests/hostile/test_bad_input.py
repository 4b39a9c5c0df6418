"""Bad input gets one line on stderr, exit 2, no traceback: each of these was a traceback.

Each case runs the real ``relaunch`` command; none of them starts a worker.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator

import pytest
from conftest import LeakCheck, relaunch_cli, tmpfs

pytestmark = pytest.mark.timeout(60)


def assert_usage_error(done: subprocess.CompletedProcess[str], *says: str) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("relaunch: error: "), done.stderr
    for text in says:
        assert text in done.stderr


@pytest.fixture
def job(tmp_path) -> str:
    (tmp_path / "job.py").write_text("print('ran')\n")
    (tmp_path / "a_file").write_text("")
    (tmp_path / "a_dir").mkdir()
    return str(tmp_path / "job.py")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--hang-timeout", "inf"], ["--hang-timeout", "'inf'", "at most"]),
        (["--hang-timeout", "nan"], ["--hang-timeout", "'nan'"]),
        (["--hang-timeout", "3000000"], ["--hang-timeout", "at most 1000000"]),  # past poll's
        (["--monitor-interval", "1e300"], ["--monitor-interval"]),
        (["--shutdown-timeout", "nan"], ["--shutdown-timeout"]),
        (["--restart-backoff", "1:1e300"], ["--restart-backoff"]),
        (["--signals-to-handle", "SIGKILL"], ["SIGKILL cannot be handled", "use SIGTERM"]),
        (["--signals-to-handle", "SIGTERM,stop"], ["SIGSTOP cannot be handled"]),
        (["--signals-to-handle", "9"], ["SIGKILL cannot be handled"]),
        (["--log-dir", "a_file"], ["--log-dir a_file is a file, not a directory"]),
        (["--log-dir", "a_file/logs"], ["--log-dir a_file/logs", "a_file is not a directory"]),
        (["--log-dir", ""], ["--log-dir is empty"]),
        (["--event-log-handler", "file:a_dir"], ["a_dir is a directory", "a_dir/events.jsonl"]),
        (["--event-log-handler", "file:a_file/ev"], ["a_file/ev cannot be created", "a_file"]),
        (["--event-log-handler", "file:"], ["bad event handler spec"]),
        (["--nproc-per-node", "65536"], ["1 to 1024 workers per node", "65536"]),
        (["--nproc-per-node", "1025"], ["1 to 1024 workers per node"]),
        (["--master-addr", "\U0006d6cc\U000ff072"], ["expected a host name or an IP address"]),
        (["--local-addr", "a b"], ["expected a host name or an IP address"]),
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "a b:1"], ["expected a host name"]),
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-conf", "timeout=nan"], []),
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-conf", "timeout=inf"], []),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    leaks: LeakCheck, job: str, argv: list[str], says: list[str]
) -> None:
    assert_usage_error(relaunch_cli(leaks, *argv, job, cwd=os.path.dirname(job), timeout=30), *says)


def test_a_value_cannot_break_the_line_or_reach_the_terminal(leaks: LeakCheck, job: str) -> None:
    hostile = "logs\nsecond line\x1b[2J"
    done = relaunch_cli(
        leaks,
        "--event-log-handler",
        f"file:a_file/{hostile}",
        job,
        cwd=os.path.dirname(job),
        timeout=30,
    )
    assert_usage_error(done, "cannot be created")
    assert "\x1b" not in done.stderr


@contextlib.contextmanager
def read_only_tmpfs(path: str) -> Iterator[str]:
    """A read-only tmpfs at ``path`` (root, which ``chmod`` alone does not stop, cannot write
    there either), holding ``present``, a file made before it turned read-only."""
    with tmpfs(path, "size=64k,mode=0755"):
        with open(os.path.join(path, "present"), "w"):
            pass
        subprocess.run(["mount", "-o", "remount,ro", path], check=True, timeout=10)
        yield path


def test_an_unwritable_log_dir_or_event_log_is_one_line(
    leaks: LeakCheck, job: str, tmp_path
) -> None:
    with read_only_tmpfs(str(tmp_path / "ro")) as ro:
        cwd = os.path.dirname(job)
        done = relaunch_cli(leaks, "--log-dir", ro, job, cwd=cwd, timeout=30)
        assert_usage_error(done, f"--log-dir {ro} is not writable")
        done = relaunch_cli(leaks, "--log-dir", f"{ro}/new/logs", job, cwd=cwd, timeout=30)
        assert_usage_error(done, "cannot be created", f"{ro} is not writable")
        done = relaunch_cli(
            leaks, "--event-log-handler", f"file:{ro}/present", job, cwd=cwd, timeout=30
        )
        assert_usage_error(done, f"{ro}/present cannot be written", "Read-only file system")
        done = relaunch_cli(
            leaks, "--event-log-handler", f"file:{ro}/new.jsonl", job, cwd=cwd, timeout=30
        )
        assert_usage_error(done, "cannot be created", f"{ro} is not writable")
