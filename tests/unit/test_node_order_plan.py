"""Group ranks where the scheduler put the nodes, and where they were
(``core.rendezvous.node_order``)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relaunch.core.rendezvous import node_order
from relaunch.core.rendezvous.node_order import Claim, Joiner, Placing


def joiner(ticket: int, last: tuple[int, int] | None = None, rank: int | None = None) -> Joiner:
    return Joiner(ticket, 1, "default", Claim(last, rank, "h", 1000 + ticket))


def tickets(placed: list[Joiner]) -> list[int]:
    return [j.ticket for j in placed]


def test_without_claims_the_arrival_order_stands_and_the_record_says_nothing() -> None:
    placed = node_order.place([joiner(t) for t in (1, 2, 3)])
    assert tickets(placed) == [1, 2, 3]
    assert node_order.placing_of(placed) is None


def test_a_first_round_started_in_reverse_follows_the_node_ranks() -> None:
    arrived = [joiner(1, rank=2), joiner(2, rank=1), joiner(3, rank=0)]
    placed = node_order.place(arrived)
    assert tickets(placed) == [3, 2, 1]
    # By ticket: ticket 1 has group rank 2, ticket 3 group rank 0.
    assert node_order.placing_of(placed) == Placing((2, 1, 0), (2, 1, 0))


def test_survivors_keep_their_ranks_and_the_replacement_takes_the_lost_one() -> None:
    # Round 4 had three members; the one of group rank 1 was lost. The spare arrived first.
    arrived = [joiner(1), joiner(2, last=(4, 2)), joiner(3, last=(4, 0))]
    assert tickets(node_order.place(arrived)) == [3, 1, 2]


def test_rank_0_moves_only_when_its_node_left() -> None:
    # Rank 0 left; the survivor of rank 2 no longer fits a round of two and fills the gap.
    arrived = [joiner(1, last=(4, 2)), joiner(2, last=(4, 1))]
    assert tickets(node_order.place(arrived)) == [1, 2]
    arrived = [joiner(1, last=(4, 1)), joiner(2, last=(4, 0))]
    assert tickets(node_order.place(arrived)) == [2, 1]


def test_a_claim_from_a_later_round_wins_and_node_ranks_order_the_rest() -> None:
    arrived = [joiner(1, last=(2, 0), rank=5), joiner(2, last=(3, 0), rank=9), joiner(3, rank=1)]
    assert tickets(node_order.place(arrived)) == [2, 3, 1]


def test_a_node_whose_record_was_never_read_comes_last() -> None:
    arrived = [Joiner(1, 1, None, None), joiner(2), joiner(3, rank=0)]
    assert tickets(node_order.place(arrived)) == [3, 2, 1]


def test_assign_gives_each_node_its_rank_and_contiguous_global_ranks() -> None:
    # Tickets 3, 1, 2 in group-rank order, with 2, 1 and 4 workers.
    placed = [Joiner(3, 2, "a", None), Joiner(1, 1, "a", None), Joiner(2, 4, "a", None)]
    placing = node_order.placing_of(placed)
    # (group rank, base global rank); the arrival order's ``through`` is not used then.
    assert node_order.assign(placing, 3, 0, 2) == (0, 0)
    assert node_order.assign(placing, 1, 0, 1) == (1, 2)
    assert node_order.assign(placing, 2, 0, 4) == (2, 3)
    assert node_order.assign(None, 3, 13, 3) == (2, 10)  # by tickets
    with pytest.raises(ValueError, match="ticket 4"):
        node_order.assign(placing, 4, 0, 1)


claims = st.builds(
    Claim,
    st.none() | st.tuples(st.integers(0, 5), st.integers(0, 6)),
    st.none() | st.integers(0, 6),
)


@given(st.lists(claims, min_size=1, max_size=7))
def test_any_claims_give_each_member_one_rank_and_keep_every_fitting_unique_claim(
    made: list[Claim],
) -> None:
    arrived = [Joiner(t, 1, "default", claim) for t, claim in enumerate(made, start=1)]
    placed = node_order.place(arrived)
    assert sorted(tickets(placed)) == list(range(1, len(arrived) + 1))
    placing = node_order.placing_of(placed)
    if placing is not None:  # what each member reads back places it where the lead put it
        fields = node_order.encode_placing(placing)
        again = node_order.decode_placing(fields, len(arrived), len(arrived))
        assert again == placing
        assert [again.ranks[j.ticket - 1] for j in placed] == list(range(len(placed)))
    newest: dict[int, int] = {}
    for j in arrived:
        if j.claim is not None and j.claim.last is not None and j.claim.last[1] < len(arrived):
            newest[j.claim.last[1]] = max(newest.get(j.claim.last[1], -1), j.claim.last[0])
    for rank, round_ in newest.items():
        holder = placed[rank].claim
        assert holder is not None and holder.last == (round_, rank), "a fitting claim is kept"


def test_claims_round_trip_and_bad_ones_are_refused() -> None:
    claim = Claim((3, 1), 7, "10.0.0.2", 29500)
    assert node_order.decode_claim(json.loads(json.dumps(node_order.encode_claim(claim)))) == claim
    assert node_order.decode_claim({}) == Claim()
    for bad, why in [
        ({"last": [1]}, "'last'"),
        ({"last": [1, -1]}, "'last'"),
        ({"node_rank": True}, "'node_rank'"),
        ({"node_rank": 1 << 40}, "'node_rank'"),
        ({"port": 70000}, "'port'"),
        ({"addr": "x" * 300}, "'addr'"),
    ]:
        with pytest.raises(ValueError, match=why):
            node_order.decode_claim(bad)


def test_a_final_record_whose_placing_does_not_add_up_is_refused() -> None:
    good = Placing((1, 0), (3, 0))
    assert node_order.decode_placing(node_order.encode_placing(good), 2, 4) == good
    assert node_order.decode_placing({}, 2, 4) is None
    for placing, count, world in [
        (Placing((0, 0), (0, 1)), 2, 2),  # a group rank twice
        (Placing((0, 2), (0, 1)), 2, 2),  # a group rank beyond the count
        (Placing((0, 1), (0, 2)), 2, 2),  # a worker beyond the world
        (Placing((0,), (0,)), 2, 2),  # not every member placed
    ]:
        with pytest.raises(ValueError):
            node_order.decode_placing(node_order.encode_placing(placing), count, world)
    for fields in [{"ranks": "!!", "bases": ""}, {"ranks": 5, "bases": ""}, {"ranks": "AAA="}]:
        with pytest.raises(ValueError, match="placing"):
            node_order.decode_placing(fields, 1, 1)
