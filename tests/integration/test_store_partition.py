"""A network partition around the built-in store's host (issue 28, item 1; docs/store-failover.md):
three hosts in network namespaces on one switch (``test_network_faults``), ``--rdzv-endpoint``
naming all three. The host's cable is pulled mid-job: the two others, a majority of the last
round, move the store to the first standby and go on; the host's side fences its store and
stops, and never runs the job again."""

from __future__ import annotations

import textwrap
import time
import uuid

import pytest
from conftest import wait_until
from test_network_faults import PORT, WORKER, Agent, Network, for_each, listening, net

__all__ = ["net"]  # the fixture, used by name


@pytest.mark.timeout(90)
@pytest.mark.parametrize("nnodes", ["2:3", "1:3"])  # 1:3: the host alone could form a round
def test_the_majority_side_of_a_partition_moves_the_store_and_the_hosts_side_stops(
    tmp_path, net: Network, nnodes: str
) -> None:
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(WORKER))
    stop = tmp_path / "stop"
    endpoint = ",".join(f"{net.addr(host)}:{PORT}" for host in ("h1", "h2", "h3"))
    run_id = uuid.uuid4().hex

    def start(host: str) -> Agent:
        return net.relaunch(host, endpoint, run_id, nnodes, tmp_path, job, stop)

    host = start("h1")
    wait_until(lambda: listening(host.proc.pid, net.addr("h1"), PORT), 20, "h1 hosting the store")
    others = [start("h2"), start("h3")]
    agents = [host, *others]
    for_each(agents, lambda agent: "3" in agent.worlds(), "a world of 3")
    # Every named host serves: h1 the store, h2 and h3 their standbys.
    for name, agent in (("h2", others[0]), ("h3", others[1])):
        assert listening(agent.proc.pid, net.addr(name), PORT), agent.report()

    worlds_before = len(host.worlds())
    net.cut("h1")
    cut_at = time.monotonic()
    moved_to = f"the store moved to {net.addr('h2')}:{PORT}"
    for_each(others, lambda agent: agent.worlds()[-1:] == ["2"], "a world of 2 without h1")
    took = time.monotonic() - cut_at
    for agent in others:
        assert agent.said(moved_to), agent.report()
    # The host's side: nobody beats into its store any more; it fences it and stops. Under
    # load its own heartbeat judge may see a member lost first: it then re-forms, and ends at
    # the join timeout with no round formed (docs/store-failover.md: a race not closed yet).
    assert host.wait(30) == 1, host.report()
    fenced = host.said("lost the job's majority and serves nobody from now on")
    if fenced:
        assert host.said("relaunch: error: ") and host.said("majority"), host.report()
    else:
        assert host.said("node(s) to join (1 joined)"), host.report()
    assert host.worlds()[worlds_before:] == [], host.report()  # no world without them

    stop.touch()
    for agent in others:
        assert agent.wait(30) == 0, agent.report()
    assert not any(agent.said("Traceback") for agent in agents)
    ended = "fenced its store" if fenced else "re-formed first, ended at the join timeout"
    print(f"partition: h1 cut off -> h2, h3 in a world of 2 after {took:.2f}s; h1 {ended}")
