"""The pure parts of resilience: crash-loop backoff and progress, section bounds, overdue
deadlines, straggler rates, and the stacks flag of a membership change."""

from __future__ import annotations

import pytest

from relaunch.core import channel
from relaunch.core.rendezvous import rounds as plan
from relaunch.core.rendezvous.membership import MembershipChange, decode_change, encode_change
from relaunch.core.run.restart import (
    Backoff,
    CrashLoop,
    Mark,
    made_progress,
    stalled_out,
    startup_failure,
)
from relaunch.core.sections import (
    LEARN_AFTER,
    LEARN_FLOOR,
    Learned,
    decode_learned,
    encode_learned,
    learned_bound,
    merge,
)
from relaunch.core.workers.liveness import Liveness, next_due, overdue, read_liveness
from relaunch.core.workers.stragglers import RankRates, flag, interval
from relaunch.rendezvous.dynamic import DynamicRendezvousHandler
from relaunch.store.memory import MemoryStore


def test_backoff_doubles_from_the_second_restart_up_to_its_cap() -> None:
    backoff = Backoff(base=1.0, cap=5.0)
    assert [backoff.delay(n) for n in range(1, 7)] == [0.0, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert Backoff(base=0.0, cap=0.0).delay(9) == 0.0
    with pytest.raises(ValueError, match="base <= cap"):
        Backoff(base=2.0, cap=1.0)


def test_a_healthy_run_ends_the_loop() -> None:
    backoff = Backoff(base=1.0, cap=5.0, healthy=10.0)
    loop = CrashLoop().after_failure(1.0, Mark(), backoff)
    loop = loop.after_failure(1.0, Mark(), backoff)
    assert loop.in_a_row == 2
    assert loop.after_failure(10.0, Mark(), backoff).in_a_row == 1


@pytest.mark.parametrize(
    ("best", "mark", "progressed"),
    [
        (None, Mark(step=0), True),  # the first attempt that reports
        (10, Mark(step=11), True),
        (10, Mark(step=10), False),  # resumed and died at the same step
        (10, Mark(), False),  # it reports steps, and this time none came
        (None, Mark(signs=3), True),  # sections, no steps
        (None, Mark(), None),  # says nothing: nothing to judge
    ],
)
def test_progress_is_a_step_beyond_every_earlier_attempt(
    best: int | None, mark: Mark, progressed: bool | None
) -> None:
    assert made_progress(best, mark) is progressed


def test_stalled_restarts_in_a_row_stop_the_job() -> None:
    backoff = Backoff()
    loop = CrashLoop().after_failure(1.0, Mark(step=50), backoff)
    assert loop.stalled == 0 and loop.best_step == 50
    for _ in range(2):
        loop = loop.after_failure(1.0, Mark(step=50), backoff)
    assert loop.stalled == 2
    assert stalled_out(loop, 3) is None
    assert stalled_out(loop, 0) is None  # 0: never
    reason = stalled_out(loop, 2)
    assert reason is not None and "2 restarts in a row" in reason and "step reached: 50" in reason
    assert loop.after_failure(1.0, Mark(step=51), backoff).stalled == 0  # progress resets it
    # Workers that say nothing are never counted as stalled.
    assert CrashLoop().after_failure(1.0, Mark(), backoff).stalled == 0


def test_a_start_up_failure() -> None:
    assert startup_failure(rank_spoke=False, workers_speak=True)
    assert not startup_failure(rank_spoke=True, workers_speak=True)
    assert not startup_failure(rank_spoke=False, workers_speak=False)  # nothing to tell by


def test_a_section_bound_is_learned_after_enough_runs() -> None:
    assert learned_bound(LEARN_AFTER - 1, 100.0) is None
    assert learned_bound(LEARN_AFTER, 0.01) == LEARN_FLOOR
    assert learned_bound(LEARN_AFTER, 4.0) == 20.0


def _live(**fields: float) -> Liveness:
    values: dict[str, object] = {
        "beat_at": 0.0,
        "beat_due": 0.0,
        "section": "step",
        "entered": 0.0,
        "section_due": 0.0,
        "sections_done": 0,
        "beats": 0,
        "section_bound": "given",
        "beat_bound": "learned",
    }
    values.update(fields)
    return Liveness(**values)  # type: ignore[arg-type]


def test_overdue_sections_and_heartbeats_at_now() -> None:
    lives = {
        0: _live(entered=100.0, section_due=101.0),
        1: _live(beat_at=100.0, beat_due=103.0, beats=1),
        2: None,
    }
    assert next_due(lives) == 101.0
    assert overdue(lives, 100.5) == []
    (late,) = overdue(lives, 101.0)
    assert late.rank == 0 and late.what == "section 'step'"
    assert late.describe(101.5) == (
        "section 'step' overdue: entered 1.5s ago, its bound is 1s (given)"
    )
    assert [o.rank for o in overdue(lives, 103.0)] == [0, 1]
    assert overdue(lives, 103.0)[1].describe(104.0).startswith("no heartbeat for 4.0s")


def test_the_liveness_block_reads_back_and_a_torn_one_is_skipped() -> None:
    buffer = bytearray(channel.size(2))
    assert read_liveness(buffer, 1) is None
    offset = channel.slot_offset(1) + channel.LIVE_OFFSET
    channel.LIVE_FIELDS.pack_into(
        buffer, offset + 8, 5.0, 6.0, 7.0, 8.0, 3, 2, channel.BOUND_LEARNED, channel.BOUND_GIVEN
    )
    name_at = channel.slot_offset(1) + channel.NAME_OFFSET
    buffer[name_at : channel.slot_offset(1) + channel.SLOT] = channel.encode_desc(
        "é" * 40, channel.NAME
    )
    channel.SEQ.pack_into(buffer, offset, 3)  # odd: being written
    assert read_liveness(buffer, 1) is None
    channel.SEQ.pack_into(buffer, offset, 4)
    live = read_liveness(buffer, 1)
    assert live is not None
    assert (live.beat_at, live.beat_due, live.entered, live.section_due) == (5.0, 6.0, 7.0, 8.0)
    assert (live.sections_done, live.beats) == (3, 2)
    assert (live.section_bound, live.beat_bound) == ("learned", "given")
    assert live.section == "é" * 32  # cut to the field, on a character boundary
    assert read_liveness(buffer, 0) is None


def test_rates_count_a_silent_ranks_silence() -> None:
    rates = RankRates()
    for rank, step in ((0, 0), (1, 0)):
        rates.add(rank, 100.0, step)
    rates.add(0, 110.0, 100)
    rates.add(1, 110.0, 20)
    assert rates.rates(110.0) == {0: 10.0, 1: 2.0}
    assert rates.rates(120.0)[0] == 5.0  # nothing since: the rate falls


def test_a_rank_below_the_median_over_the_factor_is_flagged() -> None:
    median, slow = flag({0: 10.0, 1: 9.0, 2: 11.0, 3: 2.0}, 1.5)
    assert median == 9.5
    assert [(s.rank, s.rate) for s in slow] == [(3, 2.0)]
    assert flag({0: 1.0}, 1.5) == (None, [])
    assert slow[0].describe(1.5).startswith("rank 3 is a straggler: 2 steps/s")


def test_a_change_carries_the_request_for_stacks() -> None:
    change = MembershipChange.restarting("node7: local rank 1 is hung", stacks=True)
    decoded, expected = decode_change(encode_change(change, 4))
    assert decoded.stacks and expected == 4 and decoded.reason == change.reason
    plain, _ = decode_change(encode_change(MembershipChange.restarting(), 2))
    assert not plain.stacks


def test_a_large_job_posts_less_often_to_bound_the_stores_load() -> None:
    assert interval(2) == interval(300) == 3.0
    assert interval(4096) == 40.96  # 100 posts a second for the whole job


# -- learned bounds kept by the job ------------------------------------------------------------


def test_learned_tables_merge_to_the_most_observations_and_the_longest() -> None:
    one = Learned({"step": (5, 0.5), "eval": (9, 2.0)}, beats=(6, 1.0))
    other = Learned({"step": (20, 0.4)})
    assert merge(one, other) == Learned({"step": (20, 0.5), "eval": (9, 2.0)}, beats=(6, 1.0))
    assert merge(Learned(), one) == one and not Learned()
    assert decode_learned(encode_learned(one)) == one
    # A worker's own table never holds what the store's reader refuses: those names stay out.
    many = Learned({f"s{n}": (5, 1.0) for n in range(300)} | {"x" * 200: (5, 1.0)})
    assert len(decode_learned(encode_learned(many)).sections) == 256


def test_a_table_of_bounds_not_relaunch_wrote_is_refused_and_unlearned_entries_dropped() -> None:
    assert decode_learned('{"sections": {"step": [2, 0.5]}}') == Learned()
    for bad in [
        "[]",
        "{",
        '{"sections": {"step": [5]}}',
        '{"sections": {"step": [5, -1]}}',
        '{"sections": {"step": [5, NaN]}}',
        '{"sections": {"step": [true, 1.0]}}',
        '{"beats": [5, "x"]}',
        '{"sections": {"' + "x" * 200 + '": [5, 1.0]}}',
    ]:
        with pytest.raises(ValueError):
            decode_learned(bad)


def test_the_job_keeps_what_every_node_learned_in_its_store() -> None:
    store = MemoryStore()
    settings = plan.Settings(1, 1, join_timeout=10, last_call_timeout=0.1)
    handler = DynamicRendezvousHandler.on_counters("job", store, settings, "127.0.0.1", store)
    try:
        job = handler.job
        assert job.share_learned(Learned({"step": (5, 0.5)})) == Learned({"step": (5, 0.5)})
        # Another node's workers learned more: the job keeps both, and gives both.
        kept = job.share_learned(Learned({"step": (7, 0.2), "eval": (5, 3.0)}))
        assert kept == Learned({"step": (7, 0.5), "eval": (5, 3.0)})
        assert job.share_learned(Learned()) == kept  # a node that learned nothing gets them
        store.set("relaunch/job/learned", b"not relaunch's")
        assert job.share_learned(Learned({"step": (5, 1.0)})) == Learned({"step": (5, 1.0)})
    finally:
        handler.shutdown()
