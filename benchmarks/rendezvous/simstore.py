"""What the simulated nodes of measurements 3 and 4 share: the store server they connect to
(a TcpStoreServer in a process of its own, or the etcd member) and the interpreter settings
that thousands of node threads need."""

from __future__ import annotations

import contextlib
import functools
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from benchmarks.harness import BenchError
from benchmarks.rendezvous.shared import Bench, proc_cpu
from relaunch.runtime import raise_open_file_limit

#: Simulating N nodes as threads of one process: with the default switch interval (5 ms)
#: every thread waiting for the GIL wakes each 5 ms and CPython's hand-off thrashes (etcd,
#: 1,024 nodes: 46 s and 82 CPU-seconds, against 5.5 s at 0.1 s). Real nodes are processes.
SIM_SWITCH_S = 0.1
SIM_SWITCH_NOTE = (
    f"The simulation runs with sys.setswitchinterval({SIM_SWITCH_S:g}): with thousands of"
    " threads in one process the GIL's 5 ms\n   hand-off thrashes; real nodes are separate"
    " processes."
)
#: Processes the simulated nodes are spread over (at once; one by one: 1), N / SIM_PROCS threads
#: each: fewer threads per interpreter fight less for its GIL, and the store server sees its
#: clients at a pace nearer real nodes' (etcd, 4,096 nodes: 7.6 s and 7.6 etcd CPU-seconds
#: from 8 processes, 47 s and 33 CPU-seconds from one).
SIM_PROCS = 8
SIM_STACK = 1 << 20  # thread stacks of the simulated nodes (and their heartbeat threads)
SIM_LOCAL_WORLD_SIZE = 2
#: How long a simulated node waits for its round before it gives up (a stalled round fails).
SIM_JOIN_TIMEOUT = {"c10d": 120.0, "etcd": 600.0}


@functools.cache
def counted_etcd_class() -> type:
    """EtcdStore, counting its HTTP requests by path; a watch stream counts as one request
    (``/v3/watch``). Nothing else changes."""
    from relaunch.store import EtcdStore

    class CountedEtcdStore(EtcdStore):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.requests: Counter[str] = Counter()
            call = self._gateway.call

            def counted(path: str, body: dict[str, Any]) -> Any:
                self.requests[path] += 1
                return call(path, body)

            setattr(self._gateway, "call", counted)  # noqa: B010 - an instance's method, wrapped

        def open_watch(self, *args: Any) -> Any:
            self.requests["/v3/watch"] += 1
            return super().open_watch(*args)

    return CountedEtcdStore


def raise_nofile() -> tuple[int, int]:
    """The open-file limit raised as far as the hard limit allows: ``(soft, hard)``."""
    return raise_open_file_limit(sys.maxsize)


@contextlib.contextmanager
def simulation() -> Iterator[None]:
    """What simulating many nodes as threads of one process needs: a GIL switch interval of
    SIM_SWITCH_S (see SIM_SWITCH_NOTE) and smaller thread stacks; both restored after."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(SIM_SWITCH_S)
    stack = threading.stack_size(SIM_STACK)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
        threading.stack_size(stack)


#: The built-in store's server as a process of its own, so that its CPU is measured apart from
#: the simulated nodes': it prints its port, and serves until its stdin closes.
SERVER_SCRIPT = """
import sys
from relaunch.store import TcpStoreServer
server = TcpStoreServer(port=0, expected_clients=int(sys.argv[1])).start()
print(server.port, flush=True)
sys.stdin.read()
server.stop()
"""


@contextlib.contextmanager
def store_server(bench: Bench, clients: int) -> Iterator[tuple[int, int]]:
    """A TcpStoreServer in a process of its own, expecting ``clients`` connections: ``(port,
    pid)``; stopped after."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER_SCRIPT, str(clients)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=bench.env,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = proc.stdout.readline()
        if not line.strip().isdigit():
            raise BenchError(f"the store server did not start (printed {line!r})")
        yield int(line), proc.pid
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def sim_store(
    bench: Bench, on_etcd: bool, run: str, server_clients: int, counted: bool = True
) -> Iterator[tuple[Callable[[], Any], Callable[[], float]]]:
    """Connections to one store server: ``(connect, server CPU seconds so far)``. On etcd the
    bench's member (``counted``: EtcdStores that count their HTTP requests); else a
    TcpStoreServer in a process of its own, expecting ``server_clients`` connections."""
    if on_etcd:
        assert bench.cluster is not None
        endpoints = bench.cluster.endpoints
        etcd_store: Any
        if counted:
            etcd_store = counted_etcd_class()
        else:
            from relaunch.store import EtcdStore as etcd_store

        def make_etcd_store() -> Any:
            store = etcd_store(endpoints, timeout=60.0)
            store.get(f"relaunch/{run}/news/closed")  # connects (create_etcd_handler reads it too)
            if counted:
                store.requests.clear()
            return store

        yield make_etcd_store, bench.etcd_cpu
        return
    from relaunch.store import TcpStore

    with store_server(bench, server_clients) as (port, pid):

        def make_tcp_store() -> Any:
            return TcpStore("127.0.0.1", port, timeout=60, connect_timeout=60)

        yield make_tcp_store, functools.partial(proc_cpu, pid)
