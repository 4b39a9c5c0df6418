"""``core.rendezvous.store_roles``: which part a node takes in serving the job's built-in store."""

from __future__ import annotations

import pytest

from relaunch.core.rendezvous.store_roles import StoreRole, StoreSetup, store_roles

STANDALONE, HOST, STANDBY, FOLLOWER = (
    StoreRole.STANDALONE,
    StoreRole.HOST,
    StoreRole.STANDBY,
    StoreRole.FOLLOWER,
)

# endpoints, port, max_nodes, is_host, serving elsewhere -> roles to try, in order
ROWS = [
    # --standalone: one node, a port nobody knows, one endpoint
    ((1, 0, 1, None, False), (STANDALONE,)),
    ((1, 0, 1, True, False), (STANDALONE,)),
    ((1, 0, 1, False, False), (FOLLOWER,)),
    # port 0 but more nodes, or several endpoints: a real store
    ((1, 0, 2, None, False), (HOST, FOLLOWER)),
    ((2, 0, 1, None, False), (HOST, STANDBY, FOLLOWER)),
    # one endpoint: host it if this node can bind it, else follow
    ((1, 29400, 4, None, False), (HOST, FOLLOWER)),
    ((1, 29400, 4, True, False), (HOST,)),
    ((1, 29400, 4, False, False), (FOLLOWER,)),
    # several endpoints, nobody serving yet: host, else a standby, else follow
    ((3, 29400, 4, None, False), (HOST, STANDBY, FOLLOWER)),
    ((3, 29400, 4, True, False), (HOST,)),
    ((3, 29400, 4, False, False), (FOLLOWER,)),
    # several endpoints, a store serving the job already: a standby of it, else follow
    ((3, 29400, 4, None, True), (STANDBY, FOLLOWER)),
    ((3, 29400, 4, True, True), (STANDBY, FOLLOWER)),
    ((3, 29400, 4, False, True), (FOLLOWER,)),
    ((1, 29400, 4, None, True), (FOLLOWER,)),
]


@pytest.mark.parametrize(("inputs", "roles"), ROWS)
def test_each_setup_tries_its_roles_in_order(
    inputs: tuple[int, int, int, bool | None, bool], roles: tuple[StoreRole, ...]
) -> None:
    assert store_roles(StoreSetup(*inputs)) == roles


def test_serving_elsewhere_defaults_to_none_serving() -> None:
    assert store_roles(StoreSetup(2, 29400, 4, None)) == (HOST, STANDBY, FOLLOWER)
