"""How many members must beat into the built-in store's primary for it to go on serving
(``rendezvous.failover.quorum_needed``): the rule that keeps two stores from running one job."""

from __future__ import annotations

import pytest

from relaunch.rendezvous.failover import majority, quorum_needed


@pytest.mark.parametrize(("members", "needed"), [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3)])
def test_a_majority_is_more_than_half(members: int, needed: int) -> None:
    assert majority(members) == needed


@pytest.mark.parametrize(
    ("members", "previous", "needed"),
    [
        (2, [], 0),  # a round of two: nobody else can take over
        (1, [2], 0),  # nor after one of two
        (3, [], 2),
        (5, [3], 3),  # its own majority
        (2, [3], 2),  # a node lost from three: the two left are a majority of the three
        (1, [3], 2),  # a lone node after three: the other two may run the job elsewhere
        (1, [5], 3),
    ],
)
def test_a_round_needs_its_own_majority_and_that_of_the_round_before(
    members: int, previous: list[int], needed: int
) -> None:
    assert quorum_needed(members, previous) == needed
