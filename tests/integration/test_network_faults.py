"""Real network faults: three hosts, each a network namespace, on one bridge; one node a host.

The bridge lives in a "switch" namespace of its own, wired to each host's namespace by a veth
pair, so the test network has no leg in the machine's own namespace: there it has no interface,
no address and no route, and traffic stays among the namespaces. Every process that talks to
those addresses (the relaunch agents, and through them their workers) runs inside a host's
namespace (``ip netns exec``); nothing started from the machine's own namespace connects to them.

A host is cut off by taking its port on the switch down (its cable pulled), mid-job.
"""

from __future__ import annotations

import os
import pathlib
import re
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO

import pytest
from conftest import LeakCheck, wait_until

#: Fast rendezvous: a lost node is noticed in ~0.6 s; a node's own store operations give up
#: after 2 s, so a host that is cut off notices it soon too.
FAST = (
    "keep_alive_interval=0.2,keep_alive_max_attempt=3,last_call_timeout=0.5,"
    "join_timeout=20,timeout=2"
)
#: For h2 and h3, started one after the other, to join h1 in one world of 3: once two of them
#: joined (the minimum, 2), the last call outlasts the third's start on a loaded machine (0.5 s
#: did not: a world of 2 formed, then grew).
THREE = FAST.replace("last_call_timeout=0.5", "last_call_timeout=3")
PORT = 29400  # a fresh namespace: nothing else listens there
TOKEN = "network-faults-token"
ROUND = re.compile(r"rendezvous round (\d+) complete: group rank (\d+) of (\d+)")
#: A worker's report of its world (``WORKER``), as the agent relays it: ``[default0]:world 3 ...``.
WORLD = re.compile(r":world (\d+) group_rank \d+$")

WORKER = """
    import os, sys, time
    print("world", os.environ["WORLD_SIZE"], "group_rank", os.environ["GROUP_RANK"], flush=True)
    while not os.path.exists(sys.argv[1]):  # the workload: run until the test says stop
        time.sleep(0.05)
"""


def ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)


def must(*args: str) -> None:
    done = ip(*args)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class Agent:
    """A relaunch agent started in a host's namespace, its output gathered line by line."""

    def __init__(self, name: str, namespace: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        # ``ip netns exec`` enters the namespace and execs the command: the pid is the agent's.
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", namespace, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(stream, into), daemon=True)
            for stream, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream: IO[str], into: list[str]) -> None:
        for line in stream:
            into.append(line.rstrip("\n"))

    def worlds(self) -> list[str]:
        """The world sizes this node's workers reported, one per round they ran in (a worker
        stopped in the middle of its line leaves a part of it, which reports nothing)."""
        return [m[1] for m in map(WORLD.search, self.out) if m]

    def rounds(self) -> list[tuple[int, int, int]]:
        """(round, group rank, node count) of each rendezvous round this node completed."""
        return [(int(m[1]), int(m[2]), int(m[3])) for m in map(ROUND.search, self.err) if m]

    def said(self, text: str) -> bool:
        return any(text in line for line in self.err)

    def report(self) -> str:
        return (
            f"--- {self.name} (pid {self.proc.pid}, exit {self.proc.poll()}) stdout:\n"
            + "\n".join(self.out)
            + f"\n--- {self.name} stderr:\n"
            + "\n".join(self.err)
        )

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        for reader in self._readers:
            reader.join(timeout)
        return code

    def stop(self) -> None:
        """Stop the agent (SIGTERM, then SIGKILL): its session holds nothing else of ours."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        for reader in self._readers:
            reader.join(10)


@dataclass
class Network:
    """Three hosts h1..h3 at 10.213.N.1..3 on a bridge in the switch namespace."""

    leaks: LeakCheck
    tag: str
    subnet: str
    created: list[str] = field(default_factory=list)
    agents: list[Agent] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"rl-{self.tag}-sw"

    def namespace(self, host: str) -> str:
        return f"rl-{self.tag}-{host}"

    def addr(self, host: str) -> str:
        return f"{self.subnet}.{host[1:]}"

    def build(self) -> None:
        for name in (self.switch, *(self.namespace(h) for h in ("h1", "h2", "h3"))):
            done = ip("netns", "add", name)
            if done.returncode != 0:
                pytest.skip(
                    f"cannot create network namespaces (ip netns add: {done.stderr.strip()})"
                )
            self.created.append(name)  # ours from here on: deleted after the test
            must("-n", name, "link", "set", "lo", "up")
        must("-n", self.switch, "link", "add", "br0", "type", "bridge")
        must("-n", self.switch, "link", "set", "br0", "up")
        for host in ("h1", "h2", "h3"):
            ns = self.namespace(host)
            # Both ends are made where they belong: none ever exists in the machine's namespace.
            must(
                "-n",
                ns,
                "link",
                "add",
                "eth0",
                "type",
                "veth",
                "peer",
                "name",
                host,
                "netns",
                self.switch,
            )
            must("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
            must("-n", ns, "link", "set", "eth0", "up")
            must("-n", self.switch, "link", "set", host, "master", "br0")
            must("-n", self.switch, "link", "set", host, "up")

    def assert_isolated(self) -> None:
        """The machine's own namespace has no address, no route and no link to the test network
        (a veth there with its peer in one of ours would show ``link-netns rl-...``)."""
        for args, text in (
            (("-4", "-o", "addr", "show"), f"{self.subnet}."),
            (("-4", "route", "show", "table", "all"), f"{self.subnet}."),
            (("-o", "link", "show"), f"rl-{self.tag}-"),
        ):
            done = ip(*args)
            assert done.returncode == 0, done.stderr
            assert text not in done.stdout, f"ip {' '.join(args)} shows {text}"

    def cut(self, host: str) -> None:
        must("-n", self.switch, "link", "set", host, "down")

    def restore(self, host: str) -> None:
        must("-n", self.switch, "link", "set", host, "up")

    def start(self, host: str, *argv: str) -> Agent:
        agent = Agent(
            host,
            self.namespace(host),
            [sys.executable, *argv],
            # Failover (several hosts in --rdzv-endpoint) needs the job's token on every node.
            self.leaks.process_env(LOGLEVEL="INFO", RELAUNCH_RDZV_TOKEN=TOKEN),
        )
        self.agents.append(agent)
        # The premise of stopping it by pid: the process is the agent itself, not ``ip``; and
        # the premise of the whole test: it runs in the host's namespace, not the machine's.
        wait_until(
            lambda: (
                _cmdline(agent.proc.pid)[:3] == [sys.executable, "-m", "relaunch"]
                or agent.proc.poll() is not None
            ),
            what=f"ip netns exec to run {host}'s agent",
        )
        assert agent.proc.poll() is None, agent.report()
        mine = os.stat(f"/run/netns/{self.namespace(host)}").st_ino
        assert os.stat(f"/proc/{agent.proc.pid}/ns/net").st_ino == mine
        return agent

    def relaunch(
        self,
        host: str,
        endpoint: str,
        run_id: str,
        nnodes: str,
        tmp_path: pathlib.Path,
        job: pathlib.Path,
        stop: pathlib.Path,
        conf: str = FAST,
    ) -> Agent:
        """A relaunch agent on ``host``: one worker running ``job`` until ``stop`` exists,
        rendezvous on c10d at ``endpoint`` with ``conf``, its logs under ``tmp_path/host``."""
        return self.start(
            host,
            "-m",
            "relaunch",
            *("--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id),
            *("--nnodes", nnodes, "--nproc-per-node", "1", "--local-addr", self.addr(host)),
            *("--rdzv-conf", conf, "--tee", "1", "--shutdown-timeout", "5"),
            *("--log-dir", str(tmp_path / host), str(job), str(stop)),
        )

    def teardown(self) -> None:
        for agent in self.agents:
            agent.stop()
        for name in reversed(self.created):  # deleting a namespace deletes its veth ends
            ip("netns", "delete", name)


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return [arg.decode() for arg in file.read().split(b"\0") if arg]
    except OSError:
        return []


def listening(pid: int, addr: str, port: int) -> bool:
    """Whether a TCP socket listens on addr:port in the namespace of ``pid`` (read from its
    /proc/PID/net/tcp: nothing connects, so nothing leaves this machine's namespace)."""
    try:
        with open(f"/proc/{pid}/net/tcp") as file:
            rows = file.read().splitlines()[1:]
    except OSError:
        return False
    for row in rows:
        local, state = row.split()[1], row.split()[3]
        host_hex, port_hex = local.split(":")
        host = socket.inet_ntoa(struct.pack("<I", int(host_hex, 16)))
        if state == "0A" and host == addr and int(port_hex, 16) == port:
            return True
    return False


@pytest.fixture
def net(leaks: LeakCheck) -> Iterator[Network]:
    """Three hosts on a switch; every process started on them and every namespace made for
    them is gone after the test, however it ended."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's ip is not installed")
    network = Network(leaks, secrets.token_hex(3), f"10.213.{secrets.randbelow(256)}")
    try:
        try:
            network.build()
        except RuntimeError as exc:
            pytest.skip(f"cannot build the virtual network: {exc}")
        network.assert_isolated()
        yield network
    finally:
        network.teardown()
        left = ip("netns", "list").stdout
        assert not [n for n in network.created if n in left], f"namespaces left: {left}"


def for_each(
    agents: list[Agent], condition: Callable[[Agent], bool], what: str, timeout: float = 20.0
) -> None:
    def report() -> str:
        return "\n".join(agent.report() for agent in agents)

    for agent in agents:
        try:
            wait_until(
                lambda agent=agent: condition(agent) or agent.proc.poll() is not None,
                timeout,
                what=f"{agent.name}: {what}",
            )
        except BaseException:
            print(report())
            raise
        assert condition(agent), f"{agent.name} exited before {what}\n{report()}"


@pytest.mark.timeout(60)
def test_a_host_cut_off_leaves_the_others_to_re_form_and_rejoins_once_back(
    tmp_path, net: Network
) -> None:
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(WORKER))
    stop = tmp_path / "stop"
    endpoint = f"{net.addr('h1')}:{PORT}"
    run_id = uuid.uuid4().hex

    def start(host: str) -> Agent:
        return net.relaunch(host, endpoint, run_id, "2:3", tmp_path, job, stop, THREE)

    h1 = start("h1")  # hosts the store: h1 can bind the endpoint's address
    wait_until(
        lambda: listening(h1.proc.pid, net.addr("h1"), PORT) or h1.proc.poll() is not None,
        what="h1's agent to host the store",
    )
    assert h1.proc.poll() is None, h1.report()
    h2, h3 = start("h2"), start("h3")
    everyone = [h1, h2, h3]
    survivors = [h1, h2]

    # 1. One world of three.
    for_each(everyone, lambda a: a.worlds() == ["3"], "a world of 3")
    first = [a.rounds() for a in everyone]
    assert {len(rounds) for rounds in first} == {1}, first
    assert len({(r[0][0], r[0][2]) for r in first}) == 1 and first[0][0][2] == 3, first
    first_round, h3_rank = first[0][0][0], first[2][0][1]

    # 2. h3's cable is pulled: h1 and h2 miss its heartbeats and re-form a world of two.
    net.cut("h3")
    for_each(survivors, lambda a: a.worlds() == ["3", "2"], "a world of 2 without h3")
    assert any(a.said(f"node of group rank {h3_rank} lost") for a in survivors), "\n".join(
        a.report() for a in survivors
    )
    reformed = {(a.rounds()[-1][0], a.rounds()[-1][2]) for a in survivors}
    assert len(reformed) == 1, reformed
    reformed_round, count = next(iter(reformed))
    assert count == 2 and reformed_round > first_round, (reformed_round, first_round)
    # h3, on its side, finds its store operations stalled and stops its workers to rejoin.
    for_each([h3], lambda a: a.said("restarting the worker group"), "h3 to notice it is cut off")
    # It cannot tell a cut cable from the store host's death, and says so: it does not give up
    # (a store whose host refuses the connection is gone: tests/hostile/test_store_host_death.py).
    assert h3.said("this node may be cut off from its host"), h3.report()

    # 3. The cable is back: h3 joins a later round, and the three run as one world again.
    net.restore("h3")
    for_each(survivors, lambda a: a.worlds() == ["3", "2", "3"], "a world of 3 with h3 again")
    for_each([h3], lambda a: a.worlds() == ["3", "3"], "h3 to run in a world of 3 again")
    last = {(a.rounds()[-1][0], a.rounds()[-1][2]) for a in everyone}
    assert len(last) == 1, last
    last_round, count = next(iter(last))
    assert count == 3 and last_round > reformed_round, (last_round, reformed_round)

    # The job finishes, every node cleanly.
    stop.touch()
    codes = {a.name: a.wait(30) for a in everyone}
    assert codes == {"h1": 0, "h2": 0, "h3": 0}, "\n".join(a.report() for a in everyone)
