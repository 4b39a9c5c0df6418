"""One worker of the chaos job (run by relaunch as ``python -u tests/chaos/worker.py``).

``STEPS`` steps of an all-reduce over TCP among the ranks, a checkpoint after each (rank 0),
one line per step on stdout and in a ground-truth file of its own, the result in
``results/<rank>``; and a child process that never exits by itself. The value it computes does
not depend on failures or world sizes (see ``expected_value`` in harness.py). Standard library
only: no import of the harness, so that it runs as a plain script.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any

ITEMS = 64  # items summed per step, split between the ranks


def item(i: int) -> int:
    return (i * 2654435761) % 4294967291


def advance(value: int, total: int) -> int:
    return (value * 6364136223846793005 + total + 1442695040888963407) % (1 << 64)


def _hang(reason: str) -> None:
    """What a collective does when a peer dies: never return (relaunch must stop us)."""
    os.write(2, f"chaos worker {os.getpid()}: {reason}; waiting to be stopped\n".encode())
    while True:
        time.sleep(3600)


class _Peers:
    """A blocking all-reduce among the ranks of one world, over TCP: rank 0 serves on a free
    port of ``MASTER_ADDR`` (``MASTER_PORT`` is the agent's: torch's store) and names it in the
    file ``meeting`` (one for each world: its ``MASTER_PORT``), and sums what each rank sends."""

    def __init__(self, rank: int, world: int, addr: str, meeting: str) -> None:
        self.rank, self.world = rank, world
        self.files: dict[int, Any] = {}
        self._keep: list[socket.socket] = []
        if world == 1:
            return
        if rank == 0:
            server = socket.create_server((addr, 0), backlog=world)
            write_atomic(meeting, str(server.getsockname()[1]))
            self._keep.append(server)
            while len(self.files) < world - 1:
                conn, _ = server.accept()
                self._keep.append(conn)
                file = conn.makefile("rwb")
                hello = file.readline().split()
                if len(hello) == 2 and hello[0] == b"hello":
                    self.files[int(hello[1])] = file
            return
        while True:  # rank 0 may not listen yet
            try:
                with open(meeting) as named:
                    port = int(named.read())
                conn = socket.create_connection((addr, port))
                break
            except OSError:
                time.sleep(0.01)
        self._keep.append(conn)
        self.files[0] = conn.makefile("rwb")
        self._send(0, f"hello {rank}")

    def _send(self, rank: int, text: str) -> None:
        try:
            self.files[rank].write(text.encode() + b"\n")
            self.files[rank].flush()
        except OSError as exc:
            _hang(f"lost rank {rank}: {exc}")

    def _recv(self, rank: int) -> list[str]:
        try:
            line = self.files[rank].readline()
        except OSError as exc:
            _hang(f"lost rank {rank}: {exc}")
        if not line:
            _hang(f"lost rank {rank}")
        words: list[str] = line.decode().split()
        return words

    def start(self, step: int, value: int) -> tuple[int, int]:
        """Rank 0's checkpoint, for every rank."""
        if self.rank == 0:
            for rank in self.files:
                self._send(rank, f"{step} {value}")
            return step, value
        fields = self._recv(0)
        return int(fields[0]), int(fields[1])

    def allreduce(self, step: int, part: int) -> int:
        if self.rank == 0:
            total = part
            for rank in sorted(self.files):
                fields = self._recv(rank)
                if int(fields[0]) != step:
                    _hang(f"rank {rank} is at step {fields[0]}, not {step}")
                total += int(fields[1])
            for rank in self.files:
                self._send(rank, str(total))
            return total
        self._send(0, f"{step} {part}")
        return int(self._recv(0)[0])


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as file:
        file.write(text)
    os.replace(tmp, path)


def worker_main() -> int:
    """The worker's life: see the module's docstring."""
    env = os.environ
    top = env["CHAOS_DIR"]
    steps, step_s = int(env["CHAOS_STEPS"]), float(env["CHAOS_STEP_S"])
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    pid = os.getpid()
    meta = {
        "node": int(env["CHAOS_NODE"]),
        "attempt": int(env["TORCHELASTIC_RESTART_COUNT"]),
        "local_rank": int(env["LOCAL_RANK"]),
        "rank": rank,
        "world": world,
        "group_rank": int(env["GROUP_RANK"]),
        "pid": pid,
        "log_dir": os.path.dirname(env["TORCHELASTIC_ERROR_FILE"]),
    }
    write_atomic(os.path.join(top, "workers", f"{pid}.json"), json.dumps(meta))
    if os.fork() == 0:  # a helper, like a data loader, that relaunch must stop with the worker
        while True:  # it keeps the worker's stdout and stderr open, and outlives the worker
            time.sleep(3600)
    truth = os.open(os.path.join(top, "lines", str(pid)), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    trigger = os.path.join(top, "triggers", str(pid))
    checkpoint = os.path.join(top, "checkpoint")
    meeting = os.path.join(top, f"meeting-{env['MASTER_ADDR']}-{env['MASTER_PORT']}")
    peers = _Peers(rank, world, env["MASTER_ADDR"], meeting)
    step, value = 0, 0
    if rank == 0 and os.path.exists(checkpoint):
        with open(checkpoint) as file:
            step, value = map(int, file.read().split())
    step, value = peers.start(step, value)
    while step < steps:
        if os.path.exists(trigger):  # an injected exit code
            with open(trigger) as file:
                return int(file.read())
        part = sum(item(i) for i in range(step * ITEMS, (step + 1) * ITEMS) if i % world == rank)
        value = advance(value, peers.allreduce(step, part))
        step += 1
        if rank == 0:
            write_atomic(checkpoint, f"{step} {value}")
        line = f"rank {rank} pid {pid} step {step} value {value}\n".encode()
        os.write(1, line)  # stdout first: a line in the truth file is a line printed
        os.write(truth, line)
        time.sleep(step_s)
    write_atomic(os.path.join(top, "results", str(rank)), f"{value} {world} {pid}")
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
