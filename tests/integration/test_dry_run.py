"""``relaunch --dry-run``: the first attempt's plan printed, nothing started, for one node and for
a rendezvous (which stops before joining and says so)."""

from __future__ import annotations

import os

import pytest
from conftest import LeakCheck, relaunch_cli

pytestmark = pytest.mark.timeout(60)


def test_one_node_prints_each_ranks_command_and_environment(leaks: LeakCheck, tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text("raise SystemExit('a dry run must not start the worker')\n")
    logs = tmp_path / "logs"
    done = relaunch_cli(
        leaks,
        "--dry-run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--log-dir",
        str(logs),
        str(script),
        "--lr",
        "0.1",
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "nothing was started" in out
    assert out.count(f"{script} --lr 0.1") == 2
    for rank in (0, 1):
        assert f"local rank {rank} (rank {rank}):" in out
        assert f"    RANK={rank}\n" in out
    assert "    WORLD_SIZE=2\n" in out and "    LOCAL_WORLD_SIZE=2\n" in out
    # One node knows its ranks up front; only the port it picks at the start is left open.
    assert "RANK=<set at the join>" not in out
    assert not os.path.exists(logs), "a dry run made the log directory"


def test_a_rendezvous_stops_before_joining_and_says_what_the_join_gives(
    leaks: LeakCheck, tmp_path
) -> None:
    script = tmp_path / "job.py"
    script.write_text("pass\n")
    done = relaunch_cli(
        leaks,
        "--dry-run",
        "--nnodes",
        "1:2",
        "--rdzv-backend",
        "c10d",
        # Nothing listens here: a dry run that joined would wait, then fail.
        "--rdzv-endpoint",
        "127.0.0.1:9",
        "--nproc-per-node",
        "2",
        str(script),
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "the c10d rendezvous at 127.0.0.1:9" in out
    assert "    RANK=<set at the join>\n" in out and "    LOCAL_RANK=1\n" in out
    assert out.rstrip().splitlines()[-1].startswith("relaunch: stopped before joining")


def test_a_bad_flag_is_still_a_usage_error(leaks: LeakCheck, tmp_path) -> None:
    done = relaunch_cli(leaks, "--dry-run", "--nproc-per-node", "0", str(tmp_path / "job.py"))
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "--nproc-per-node" in done.stderr


def test_virtual_local_rank_gives_each_worker_local_rank_0_and_its_own_gpu(
    leaks: LeakCheck, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun 2.13's --virtual-local-rank: LOCAL_RANK=0 everywhere, the rank-th inherited GPU."""
    script = tmp_path / "job.py"
    script.write_text("pass\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    done = relaunch_cli(
        leaks, "--dry-run", "--nproc-per-node", "2", "--virtual-local-rank", str(script)
    )
    assert done.returncode == 0, done.stderr
    ranks = done.stdout.split("local rank 1 (rank 1):")
    assert len(ranks) == 2, done.stdout
    assert "    LOCAL_RANK=0\n" in ranks[0] and "    CUDA_VISIBLE_DEVICES=3\n" in ranks[0]
    assert "    LOCAL_RANK=0\n" in ranks[1] and "    CUDA_VISIBLE_DEVICES=5\n" in ranks[1]


@pytest.mark.parametrize("preload", ["torch", "json"])
def test_the_store_is_the_agents_whatever_preload_imports(
    leaks: LeakCheck, tmp_path, preload: str
) -> None:
    script = tmp_path / "job.py"
    script.write_text("raise SystemExit('a dry run must not start the worker')\n")
    done = relaunch_cli(
        leaks, "--dry-run", "--standalone", "--preload", preload, str(script), cwd=str(tmp_path)
    )
    assert done.returncode == 0, done.stderr
    assert "    TORCHELASTIC_USE_AGENT_STORE=True\n" in done.stdout
