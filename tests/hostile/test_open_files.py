"""A low open-file limit: relaunch raises its soft limit to the hard one when the workers asked
for need more, and says in one line how many it needs when even the hard limit is too low.
(256 workers under ``ulimit -n 64``, and ``--tee 3`` under the common 1024, died of EMFILE.)"""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest
from conftest import LeakCheck

from relaunch.config import LaunchConfig, open_files_needed
from relaunch.core.workers.streams import Std

pytestmark = pytest.mark.timeout(60)


def relaunch_limited(
    leaks: LeakCheck, soft: int, hard: int, *argv: str
) -> subprocess.CompletedProcess[str]:
    """``relaunch ARGV`` with RLIMIT_NOFILE at (soft, hard); the workers run ``true``."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return subprocess.run(
        [sys.executable, "-m", "relaunch", *argv, "--no-python", "true"],
        capture_output=True,
        text=True,
        env=leaks.process_env(OMP_NUM_THREADS="1"),
        preexec_fn=limit,
        timeout=50,
    )


@pytest.mark.parametrize(
    ("soft", "flags"),
    [(64, ["--nproc-per-node", "256"]), (1024, ["--nproc-per-node", "256", "--tee", "3"])],
)
def test_many_workers_under_a_low_soft_limit_run(
    leaks: LeakCheck, soft: int, flags: list[str]
) -> None:
    done = relaunch_limited(leaks, soft, 4096, *flags)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Too many open files" not in done.stderr


def test_a_hard_limit_too_low_is_one_line_with_the_number_needed(leaks: LeakCheck) -> None:
    done = relaunch_limited(leaks, 64, 64, "--nproc-per-node", "256")
    needed = open_files_needed(LaunchConfig(1, 1, 256))
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"relaunch: error: 256 workers per node need about {needed} open files, but this "
        "process may open at most 64 (hard limit 64, ulimit -Hn): raise the limit (ulimit -n "
        f"{needed}, LimitNOFILE= in systemd, nofile in /etc/security/limits.conf) or run fewer "
        "workers per node (see relaunch --help)"
    ]


def test_the_number_needed_counts_the_streams_relaunch_reads() -> None:
    def needed(config: LaunchConfig, terminals: Std = Std.ALL) -> int:
        return open_files_needed(config, terminals)

    # On a terminal, relaunch reads only what is redirected or tee'd.
    plain = needed(LaunchConfig(1, 1, 100))
    teed = needed(LaunchConfig(1, 1, 100, tee=Std.ALL))
    one_stream = needed(LaunchConfig(1, 1, 100, redirects={0: Std.OUT}))
    watched = needed(LaunchConfig(1, 1, 100, hang_timeout=60))
    assert teed - plain == 100 * 4  # a pipe and a log file for each of 2 streams
    assert one_stream - plain == 2
    assert watched == teed  # hang detection reads every stream
    # Off a terminal, several workers' streams are copied by relaunch; one worker's are its own.
    assert needed(LaunchConfig(1, 1, 100), Std.NONE) == teed
    assert needed(LaunchConfig(1, 1, 1), Std.NONE) == needed(LaunchConfig(1, 1, 1))
