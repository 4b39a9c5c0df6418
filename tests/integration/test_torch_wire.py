"""torch's store served by relaunch (``store.torch_wire``), asked by torch 2.13's own
``TCPStore`` client: every operation torch and torchft use, wait timeouts and their cancel,
concurrent waiters, and jobs whose workers find it at ``MASTER_ADDR:MASTER_PORT``.

The clients run in a child process: some of torch's store calls (queues, ``list_keys``) hold
the interpreter's lock while they wait for the reply, which a server thread of the same process
could never send.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from conftest import LeakCheck, relaunch_cli, wait_until

import relaunch.store.torch_wire_shapes as wire
from relaunch.agent.hook_torch_store import TorchStoreHook
from relaunch.endpoints import find_free_port
from relaunch.store.torch_wire import TorchWireServer, listen

pytestmark = [pytest.mark.xdist_group("torch")]

CLIENT = r"""
import sys, threading, time
from datetime import timedelta
import torch
import torch.distributed as dist

port = int(sys.argv[1])

def client(seconds=10):
    return dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=seconds))

store = client()
store.set("key", b"value")
assert store.get("key") == b"value"
assert (store.add("count", 3), store.add("count", -1)) == (3, 2)
assert store.compare_set("key", b"value", b"new") == b"new"
assert store.compare_set("key", b"other", b"x") == b"new"
assert store.compare_set("fresh", b"", b"made") == b"made"
assert store.compare_set("absent", b"hoped", b"x") == b"hoped"
assert store.check(["key", "count"]) and not store.check(["key", "nothing"])
assert store.num_keys() == 3, store.num_keys()
assert store.delete_key("fresh") and not store.delete_key("fresh")
store.append("log", b"a"); store.append("log", b"b")
assert store.multi_get(["log", "count"]) == [b"ab", b"2"]
store.multi_set(["m1", "m2"], [b"1", b"2"])
assert sorted(store.list_keys()) == ["count", "key", "log", "m1", "m2"], store.list_keys()
big = bytes(range(256)) * 4096  # 1 MiB: a pickled object, say
store.set("big", big)
assert store.get("big") == big

# a wait that times out is cancelled, and the connection goes on
started = time.monotonic()
try:
    store.wait(["never"], timedelta(seconds=0.3))
    raise AssertionError("the wait did not time out")
except dist.DistStoreError:
    pass
assert 0.25 < time.monotonic() - started < 5
assert store.get("key") == b"new"

# concurrent waiters, woken by one set from another client
others = [client() for _ in range(4)]
woken = []
def wait(other):
    other.wait(["go", "count"])
    woken.append(other.get("go"))
threads = [threading.Thread(target=wait, args=(other,)) for other in others]
for thread in threads:
    thread.start()
store.wait(["parked"])  # set by the test once the server holds the five waits
store.set("go", b"now")
for thread in threads:
    thread.join(10)
assert woken == [b"now"] * 4, woken

# queues and barriers
store.queue_push("q", b"first"); store.queue_push("q", b"second")
assert store.queue_len("q") == 2
assert store.queue_pop("q") == b"first" and store.queue_pop("q", block=False) == b"second"
try:
    store.queue_pop("q", block=False)
    raise AssertionError("an empty queue popped")
except dist.QueueEmptyError:
    pass
later = threading.Thread(target=lambda: (time.sleep(0.2), others[0].queue_push("late", b"x")))
later.start()
assert store.queue_pop("late") == b"x"
later.join()
arrived = threading.Thread(target=lambda: others[1].barrier("barrier", 2))
arrived.start()
store.barrier("barrier", 2)
arrived.join(10)
assert not arrived.is_alive()

# a process group over it, as init_process_group makes one
dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=0, world_size=1)
value = torch.ones(2)
dist.all_reduce(value)
dist.destroy_process_group()
print("ok")
"""


@pytest.fixture
def server() -> Iterator[TorchWireServer]:
    listener, why = listen(0, "127.0.0.1")
    assert listener is not None, why
    served = TorchWireServer(listener, 64).start()
    try:
        yield served
    finally:
        served.stop()


@pytest.mark.timeout(120)
def test_torchs_own_client_gets_every_operation_it_uses(
    server: TorchWireServer, tmp_path: pathlib.Path
) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    with subprocess.Popen(
        [sys.executable, str(script), str(server.port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as client:
        try:
            wait_until(lambda: server.waiting == 5, 60, "five clients to wait")
            raw_set(server.port, b"/parked", b"1")
            out, err = client.communicate(timeout=60)
        finally:
            client.kill()
    assert client.returncode == 0, err
    assert out.strip() == "ok"
    assert server.running()


def raw_set(port: int, key: bytes, value: bytes) -> None:
    """``SET`` over torch's wire protocol, by hand (no torch in this process)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(
            bytes([wire.VALIDATE]) + wire.nonce(wire.MAGIC) + bytes([wire.SET])
            + wire.blob(key) + wire.blob(value)
        )  # fmt: skip
        sock.sendall(bytes([wire.PING]) + wire.nonce(7))
        assert sock.recv(4) == wire.nonce(7)


def test_the_port_is_free_again_once_stopped_and_a_taken_one_is_said() -> None:
    """Stopped, the server lets its port go (the next attempt binds it again); a port taken
    cannot be served, and why is said."""
    listener, _ = listen(0, "127.0.0.1")
    assert listener is not None
    port = listener.getsockname()[1]
    server = TorchWireServer(listener, 8).start()
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    taken, why = listen(port, "127.0.0.1")
    assert taken is None and why == "Address already in use"
    server.stop()
    again, _ = listen(port, "127.0.0.1")
    assert again is not None
    again.close()


def _rank_0_of_one_node(port: int) -> SimpleNamespace:
    """What ``TorchStoreHook`` reads of an attempt: group rank 0 of one node, one worker."""
    spec = SimpleNamespace(local_world_size=1)
    group = SimpleNamespace(
        group_rank=0, group_world_size=1, master_addr="127.0.0.1", master_port=port, spec=spec
    )
    return SimpleNamespace(group=group, agent_store=None)


@pytest.mark.timeout(60)
def test_a_rank_that_connects_before_the_store_is_served_is_answered_once_it_is() -> None:
    """The agent binds the port before its workers start and serves it once they started (its
    imports are off their way): a rank that connects in between waits in the backlog, and its
    requests are answered as the server starts; an attempt whose workers never started lets
    the port go."""
    port = find_free_port()
    hook, run = TorchStoreHook(), _rank_0_of_one_node(port)
    hook.starting(run)  # type: ignore[arg-type]
    assert run.agent_store is True
    with socket.create_connection(("127.0.0.1", port), timeout=5) as early:
        early.sendall(
            bytes([wire.VALIDATE]) + wire.nonce(wire.MAGIC) + bytes([wire.SET])
            + wire.blob(b"early") + wire.blob(b"1") + bytes([wire.PING]) + wire.nonce(7)
        )  # fmt: skip
        hook.started(run)  # type: ignore[arg-type]
        assert early.recv(4) == wire.nonce(7)
    raw_set(port, b"later", b"2")
    hook.starting(run)  # type: ignore[arg-type]  # the next attempt: a new store, not served
    hook.close()
    again, _ = listen(port, "127.0.0.1")
    assert again is not None
    again.close()


def test_one_node_listens_on_loopback_and_several_on_every_address() -> None:
    alone, _ = listen(0, "127.0.0.1")
    assert alone is not None
    with alone:
        assert alone.getsockname()[0] == "127.0.0.1"
    listener, _ = listen(0)
    assert listener is not None
    with listener:
        port = listener.getsockname()[1]
        assert listener.getsockname()[0] in ("::", "0.0.0.0")
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # in the backlog


GLOO_WORKER = """
import os, pathlib, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
seen = f"{os.environ['TORCHELASTIC_USE_AGENT_STORE']} {value.item():g}"
pathlib.Path(sys.argv[1], os.environ["RANK"]).write_text(seen)
dist.destroy_process_group()
"""

CLIENT_ONLY_WORKER = """
import os, pathlib, sys
from datetime import timedelta
import torch.distributed as dist
# What torchft's Manager does: a client of the store at MASTER_ADDR:MASTER_PORT, never a server.
store = dist.TCPStore(
    os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
    timeout=timedelta(seconds=30),
)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store.set(f"rank{rank}", os.environ["TORCHELASTIC_USE_AGENT_STORE"])
store.wait([f"rank{other}" for other in range(world)])
seen = " ".join(store.get(f"rank{other}").decode() for other in range(world))
pathlib.Path(sys.argv[1], str(rank)).write_text(seen)
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("worker", ["gloo", "client-only"])
def test_a_standalone_job_finds_the_agents_store(
    leaks: LeakCheck, tmp_path: pathlib.Path, worker: str
) -> None:
    """Four ranks: ``init_process_group("gloo")`` by ``env://`` on the agent's store, or
    clients only (torchft's way), which hung before the agent served it. The ranks fork from
    a zygote that imported torch once (``--preload``), not four imports of it."""
    pytest.importorskip("torch")
    script = tmp_path / "worker.py"
    script.write_text(GLOO_WORKER if worker == "gloo" else CLIENT_ONLY_WORKER)
    out = tmp_path / "out"
    out.mkdir()
    done = relaunch_cli(
        leaks,
        *("--standalone", "--nproc-per-node", "4", "--preload", "torch.distributed"),
        *(str(script), str(out)),
        cwd=str(tmp_path),
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    expected = "True 10" if worker == "gloo" else "True True True True"
    assert [(out / str(rank)).read_text() for rank in range(4)] == [expected] * 4


@pytest.mark.timeout(240)
def test_two_nodes_find_the_store_of_group_rank_0(
    leaks: LeakCheck, tmp_path: pathlib.Path, request: pytest.FixtureRequest
) -> None:
    """Two agents over loopback (c10d): the ranks of both nodes reach group rank 0's store."""
    pytest.importorskip("torch")
    from test_state import run_two_nodes

    script = tmp_path / "worker.py"
    script.write_text(GLOO_WORKER)
    out = tmp_path / "out"
    out.mkdir()
    run_two_nodes(leaks, request, "c10d", f"torch-wire-{os.getpid()}", [str(script), str(out)])
    assert [(out / str(rank)).read_text() for rank in range(2)] == ["True 3"] * 2


ENV_WORKER = """
import os, pathlib, sys
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
pathlib.Path(sys.argv[1], attempt).write_text(os.environ["TORCHELASTIC_USE_AGENT_STORE"])
raise SystemExit(1 if attempt == "0" else 0)
"""


@pytest.mark.timeout(60)
def test_a_port_taken_is_said_once_and_left_to_worker_rank_0(
    leaks: LeakCheck, tmp_path: pathlib.Path
) -> None:
    """``MASTER_PORT`` already taken: one line says so, through a restart, and the workers
    are told to serve the store themselves (rank 0, as torch does without an agent's)."""
    script = tmp_path / "worker.py"
    script.write_text(ENV_WORKER)
    out = tmp_path / "out"
    out.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = relaunch_cli(
            leaks,
            *("--rdzv-backend", "static", "--master-port", str(port)),
            *("--nproc-per-node", "1", "--max-restarts", "1", str(script), str(out)),
            cwd=str(tmp_path),
        )
    assert done.returncode == 0, done.stderr
    assert [(out / attempt).read_text() for attempt in ("0", "1")] == ["False", "False"]
    said = (
        f"relaunch: cannot serve torch's store on port {port} (Address already in use): "
        "worker rank 0 serves it (TORCHELASTIC_USE_AGENT_STORE=False)\n"
    )
    assert done.stderr.count(said) == 1, done.stderr
