"""Each rank's I/O, planned once: log files, tees, error file and console prefix."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from relaunch.core.workers.rank_io import RankIO, plan_rank_io
from relaunch.core.workers.streams import Std

stds = st.sampled_from([Std.NONE, Std.OUT, Std.ERR, Std.ALL])


def test_a_rank_logs_the_streams_it_redirects_or_tees() -> None:
    plan = plan_rank_io("w", "/logs", 3, redirects={0: Std.OUT}, tee={1: Std.ERR})
    assert plan[0] == RankIO(
        local_rank=0,
        log_dir="/logs/0",
        stdout="/logs/0/stdout.log",
        stderr="",
        tee=Std.NONE,
        error_file="/logs/0/error.json",
        prefix="[w0]:",
    )
    assert (plan[1].stdout, plan[1].stderr) == ("", "/logs/1/stderr.log")
    assert plan[1].tee_stderr and not plan[1].tee_stdout
    assert (plan[2].stdout, plan[2].stderr, plan[2].tee) == ("", "", Std.NONE)
    assert plan[2].error_file == "/logs/2/error.json", "every rank may report a failure"


def test_given_prefixes_replace_the_default_one() -> None:
    plan = plan_rank_io("w", "/logs/", 2, prefixes={1: "[node3 rank7]:"})
    assert [plan[rank].prefix for rank in (0, 1)] == ["[w0]:", "[node3 rank7]:"]
    assert plan[0].log_dir == "/logs/0"


@given(st.integers(1, 6), stds | st.dictionaries(st.integers(0, 7), stds), stds)
def test_a_teed_stream_always_has_a_log_file(
    nprocs: int, redirects: Std | dict[int, Std], tee: Std
) -> None:
    for rank, io in plan_rank_io("w", "/d", nprocs, redirects, tee).items():
        assert io.local_rank == rank and io.tee == tee
        assert not io.tee_stdout or io.stdout.endswith(f"/{rank}/stdout.log")
        assert not io.tee_stderr or io.stderr.endswith(f"/{rank}/stderr.log")
        logged = (redirects.get(rank, Std.NONE) if isinstance(redirects, dict) else redirects) | tee
        assert bool(io.stdout) == bool(logged & Std.OUT)
        assert bool(io.stderr) == bool(logged & Std.ERR)


def test_a_relayed_stream_is_logged_and_a_logged_one_not_relayed() -> None:
    plan = plan_rank_io("w", "/logs", 2, redirects={0: Std.ERR, 1: Std.NONE}, relay=Std.ALL)
    assert plan[0].relay == Std.OUT and plan[0].stdout == "/logs/0/stdout.log"
    assert plan[1].relay == Std.ALL and plan[1].stderr == "/logs/1/stderr.log"
