"""Roles, and torch's shape of a rendezvous' answer, through relaunch beside torch.

Nodes of different ``WorkerSpec.role`` (a master/trainer job) each count their own
``ROLE_RANK`` 0.. and ``ROLE_WORLD_SIZE``, as torch 2.13's agent gives them: relaunch's join
carries the role, and the round's record says the members' roles only when they differ. A
user's own handler written for torch returns torch's ``RendezvousInfo`` (node rank, number of
nodes, a store): relaunch's agent then assigns the ranks the torch way, through that store.
relaunch's ``RendezvousInfo`` and ``RendezvousStoreInfo`` take torch's constructor and names.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from compat_ranks_nodes import check_rule, run_nodes, table_of, tasks_for, torch_rule
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relaunch.agent import WorkerSpec
from relaunch.agent.spec import WorkerGroup
from relaunch.core.rendezvous import rounds as plan
from relaunch.core.workers.ranks import places, role_place, role_runs
from relaunch.endpoints import find_free_port
from relaunch.rendezvous import RendezvousInfo, RendezvousStoreInfo
from relaunch.rendezvous.dynamic import DynamicRendezvousHandler
from relaunch.store.memory import MemoryStore

MASTER_AND_TRAINERS = [("master", 1), ("trainer", 2), ("trainer", 2)]
#: torch is the reference here: its classes are built beside relaunch's.
pytestmark = pytest.mark.xdist_group("torch")
torch_api = pytest.importorskip("torch.distributed.elastic.rendezvous.api")

# -- the rule, in core -----------------------------------------------------------------------

nodes_strategy = st.lists(
    st.tuples(st.sampled_from(["master", "trainer", "ps"]), st.integers(1, 4)),
    min_size=1,
    max_size=9,
)


@given(nodes=nodes_strategy)
def test_places_and_role_runs_give_torchs_rule(nodes: list[tuple[str, int]]) -> None:
    expected = torch_rule(nodes)
    runs = role_runs(nodes)
    for group_rank, place in enumerate(places(nodes)):
        first = expected[(group_rank, 0)]
        assert place.rank_offset == int(first["RANK"])
        assert place.world_size == int(first["WORLD_SIZE"])
        assert place.role_rank_offset == int(first["ROLE_RANK"])
        assert place.role_world_size == int(first["ROLE_WORLD_SIZE"])
        own = nodes[group_rank][0]
        assert role_place(runs, group_rank, own) == (place.role_rank_offset, place.role_world_size)
    assert len(runs) <= len(nodes)


def test_a_node_placed_under_another_role_is_an_error() -> None:
    runs = role_runs([("master", 1), ("trainer", 2)])
    with pytest.raises(ValueError, match="role 'trainer', not 'master'"):
        role_place(runs, 1, "master")


@given(nodes=nodes_strategy)
def test_the_join_counter_knows_when_every_node_has_one_role(nodes: list[tuple[str, int]]) -> None:
    total = sum(plan.join_increment(workers, role) for role, workers in nodes)
    joined = plan.unpack_join(total)
    assert joined.ticket == len(nodes)
    assert joined.through == sum(workers for _, workers in nodes)
    assert joined.one_role() == (len({role for role, _ in nodes}) == 1)


def test_roles_that_average_to_another_are_not_taken_for_one() -> None:
    """Cauchy-Schwarz: n * sum(x**2) == sum(x)**2 only when all x are equal. Fingerprints 3
    and 5 sum as two 4s do (the sum alone would be fooled); their squares do not."""
    assert not plan.JoinTotal(2, 2, 3 + 5, 3**2 + 5**2).one_role()
    assert plan.JoinTotal(2, 2, 4 + 4, 4**2 + 4**2).one_role()
    assert plan.unpack_join(plan.join_increment(3, "x") * 4).one_role()


# -- the dynamic rendezvous carries the role -------------------------------------------------


def join_together(handlers: list[DynamicRendezvousHandler]) -> list[RendezvousInfo]:
    infos: list[Any] = [None] * len(handlers)

    def join(index: int) -> None:
        try:
            infos[index] = handlers[index].next_rendezvous()
        except Exception as exc:  # said below, with the test's failure
            infos[index] = exc

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(handlers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(isinstance(info, RendezvousInfo) for info in infos), infos
    return infos


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=nodes_strategy)
def test_a_round_of_the_built_in_store_gives_every_node_its_role_ranks(
    nodes: list[tuple[str, int]],
) -> None:
    store = MemoryStore()
    rules = plan.Settings(len(nodes), len(nodes), join_timeout=20, keep_alive_interval=0.5)
    handlers = [
        DynamicRendezvousHandler.on_counters("roles", store, rules, "127.0.0.1", store)
        for _ in nodes
    ]
    for handler, (role, workers) in zip(handlers, nodes, strict=True):
        handler.job.set_workers(role, workers)
    try:
        infos = join_together(handlers)
    finally:
        for handler in handlers:
            handler.shutdown()
    check_infos(infos, nodes)
    final = store.get("relaunch/roles/news/r0/final").value or b""
    assert (b'"roles"' in final) == (len({role for role, _ in nodes}) > 1)


def check_infos(infos: list[RendezvousInfo], nodes: list[tuple[str, int]]) -> None:
    """Each handler's answer is torch's rule for the group ranks the round gave."""
    order: list[tuple[str, int]] = [("", 0)] * len(nodes)
    for info, node in zip(infos, nodes, strict=True):
        order[info.rank] = node
    expected = torch_rule(order)
    for info in infos:
        first = expected[(info.rank, 0)]
        assert info.world_size == info.group_world_size == len(nodes)
        assert (
            info.rank_offset,
            info.global_world_size,
            info.role_rank_offset,
            info.role_world_size,
        ) == tuple(
            int(first[name]) for name in ("RANK", "WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE")
        )


@pytest.mark.timeout(60)
def test_a_round_on_etcd_gives_every_node_its_role_ranks(etcd) -> None:
    from relaunch.rendezvous.kinds_etcd import handler_on_etcd
    from relaunch.store.etcd import EtcdStore

    nodes = [("trainer", 2), ("master", 1), ("trainer", 3), ("ps", 1)]
    rules = plan.Settings(len(nodes), len(nodes), join_timeout=20, keep_alive_interval=0.5)
    run_id = f"roles-{uuid.uuid4().hex[:6]}"
    handlers = [
        handler_on_etcd(
            run_id,
            EtcdStore(etcd.endpoints),
            rules,
            "127.0.0.1",
            EtcdStore(etcd.endpoints),
            backend="etcd",
        )
        for _ in nodes
    ]
    for handler, (role, workers) in zip(handlers, nodes, strict=True):
        handler.job.set_workers(role, workers)
    try:
        check_infos(join_together(handlers), nodes)
    finally:
        for handler in handlers:
            handler.shutdown()


# -- torch's RendezvousInfo and RendezvousStoreInfo ------------------------------------------


def test_rendezvous_info_takes_torchs_constructor_and_names() -> None:
    store = object()
    master = RendezvousStoreInfo("10.0.0.1", 29501)
    theirs = torch_api.RendezvousInfo(store, 2, 3, torch_api.RendezvousStoreInfo("10.0.0.1", 29501))
    ours = RendezvousInfo(store, 2, 3, master)
    for name in ("store", "rank", "world_size"):
        assert getattr(ours, name) == getattr(theirs, name)
    assert ours.bootstrap_store_info == master
    assert vars(theirs.bootstrap_store_info) == vars(ours.bootstrap_store_info)
    # relaunch's names for the same: the node's rank and the number of nodes, and the master
    assert (ours.group_rank, ours.group_world_size) == (2, 3)
    assert (ours.master_addr, ours.master_port) == ("10.0.0.1", 29501)
    assert ours.rank_offset is None and ours.global_world_size is None
    by_keywords = RendezvousInfo(store=store, rank=2, world_size=3, bootstrap_store_info=master)
    assert by_keywords == ours
    assert (
        RendezvousInfo(
            store, group_rank=2, group_world_size=3, master_addr="10.0.0.1", master_port=29501
        )
        == ours
    )


def test_rendezvous_info_refuses_what_contradicts_itself() -> None:
    with pytest.raises(TypeError, match="rank=1 and group_rank=2"):
        RendezvousInfo(None, 1, 2, group_rank=2)
    with pytest.raises(TypeError, match="needs world_size"):
        RendezvousInfo(None, 0)
    with pytest.raises(TypeError, match="not both"):
        RendezvousInfo(None, 0, 1, RendezvousStoreInfo("h", 1), master_addr="h")
    with pytest.raises(TypeError, match="together"):
        RendezvousInfo(None, 0, 1, rank_offset=0)


def test_rendezvous_store_info_is_torchs() -> None:
    assert RendezvousStoreInfo.MASTER_ADDR_KEY == torch_api.RendezvousStoreInfo.MASTER_ADDR_KEY
    assert RendezvousStoreInfo.MASTER_PORT_KEY == torch_api.RendezvousStoreInfo.MASTER_PORT_KEY
    assert RendezvousStoreInfo("a", 1) == RendezvousStoreInfo(master_addr="a", master_port=1)


def test_rendezvous_store_info_build_publishes_rank_zeros_address() -> None:
    """Built over relaunch's store and over torch's, the nodes agree on rank 0's address."""
    from torch.distributed import HashStore

    for store in (MemoryStore(), HashStore()):
        first = RendezvousStoreInfo.build(0, store, "127.0.0.1", server_port=4242)
        second = RendezvousStoreInfo.build(1, store, "10.9.9.9")
        assert first == second == RendezvousStoreInfo("127.0.0.1", 4242)
    theirs = HashStore()
    torch_api.RendezvousStoreInfo.build(0, theirs, "127.0.0.1", server_port=4243)
    assert RendezvousStoreInfo.build(1, theirs, None) == RendezvousStoreInfo("127.0.0.1", 4243)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("store_kind", ["relaunch", "torch"])
def test_a_torch_shaped_answer_is_placed_through_its_store(store_kind) -> None:
    """Three nodes told only their rank, the number of nodes and a shared store (torch's or
    relaunch's) agree on every worker's ranks through it, as torch's agents do."""
    if store_kind == "torch":
        from torch.distributed import HashStore

        store: Any = HashStore()
    else:
        store = MemoryStore()
    nodes = [("master", 1), ("trainer", 2), ("trainer", 3)]
    groups = [
        WorkerGroup(WorkerSpec(role, workers, rdzv_handler=None, entrypoint="true"))  # type: ignore[arg-type]
        for role, workers in nodes
    ]
    master = torch_api.RendezvousStoreInfo("127.0.0.1", 29500)
    errors: list[BaseException] = []

    def join(rank: int) -> None:
        try:
            groups[rank].join(torch_api.RendezvousInfo(store, rank, len(nodes), master))
        except BaseException as exc:  # said by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(len(nodes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    expected = torch_rule(nodes)
    for rank, group in enumerate(groups):
        assert group.group_rank == rank and group.group_world_size == len(nodes)
        assert (group.master_addr, group.master_port) == ("127.0.0.1", 29500)
        for worker in group.workers:
            env = expected[(rank, worker.local_rank)]
            assert (
                worker.global_rank,
                worker.role_rank,
                worker.world_size,
                worker.role_world_size,
            ) == tuple(int(env[n]) for n in ("RANK", "ROLE_RANK", "WORLD_SIZE", "ROLE_WORLD_SIZE"))


def test_an_answer_with_no_store_takes_every_node_as_this_one() -> None:
    """relaunch's static handler, or a torch-shaped answer with no store: torch's
    ``TORCH_ELASTIC_WORKER_IDENTICAL`` layout."""
    group = WorkerGroup(WorkerSpec("trainer", 2, rdzv_handler=None, entrypoint="true"))  # type: ignore[arg-type]
    group.join(RendezvousInfo(None, 1, 3, RendezvousStoreInfo("h", 1)))
    assert [(w.global_rank, w.world_size, w.role_rank) for w in group.workers] == [
        (2, 6, 2),
        (3, 6, 3),
    ]


def test_an_answer_with_no_master_says_what_to_give() -> None:
    group = WorkerGroup(WorkerSpec("trainer", 1, rdzv_handler=None, entrypoint="true"))  # type: ignore[arg-type]
    with pytest.raises(Exception, match="bootstrap_store_info"):
        group.join(RendezvousInfo(None, 0, 1))


# -- whole jobs, side by side with torch -----------------------------------------------------


@pytest.mark.timeout(400)
def test_a_master_and_trainers_job_gets_torchs_role_ranks(leaks) -> None:
    """One master node of one worker, two trainer nodes of two: through torch's agents and
    relaunch's, each on the recipe's c10d rendezvous, every worker's ROLE_RANK and
    ROLE_WORLD_SIZE follow torch's rule for the group ranks the nodes got."""
    tables = {}
    for kind in ("torch", "relaunch"):
        port = find_free_port()
        tasks = tasks_for(kind, "c10d", f"127.0.0.1:{port}", MASTER_AND_TRAINERS, 3, 3)
        tables[kind] = check_rule(run_nodes(tasks, leaks, 300), MASTER_AND_TRAINERS)
    for table in tables.values():
        roles = {(env["ROLE_NAME"], env["ROLE_WORLD_SIZE"]) for env in table.values()}
        assert roles == {("master", "1"), ("trainer", "4")}


@pytest.mark.timeout(120)
def test_a_master_and_trainers_job_on_etcd(etcd, leaks) -> None:
    tasks = tasks_for("relaunch", "etcd", etcd.endpoints, MASTER_AND_TRAINERS, 3, 3)
    check_rule(run_nodes(tasks, leaks, 100), MASTER_AND_TRAINERS)


@pytest.mark.timeout(300)
def test_a_users_handler_written_for_torch_gives_the_same_ranks_in_both(leaks) -> None:
    """A handler of torch's classes that returns torch's ``RendezvousInfo`` (a fixed rank, a
    torch TCPStore): torch's agent and relaunch's give every worker the same variables."""
    from torch.distributed import TCPStore

    nodes = [("ps", 1), ("trainer", 2)]
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    tables = {}
    try:
        for kind in ("torch", "relaunch"):
            tasks = tasks_for(kind, "fixed", "", nodes, 2, 2)
            for rank, task in enumerate(tasks):
                task.update(rank=rank, store_port=server.port)
            tables[kind] = table_of(run_nodes(tasks, leaks, 240))
    finally:
        del server
    assert tables["relaunch"] == tables["torch"] == torch_rule(nodes)
