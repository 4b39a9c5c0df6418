"""Recovery: a DDP job's worker or node SIGKILLed -> its next step, and the steps lost (issue 27).

The state kept in relaunch's memory, in checkpoint files under relaunch and torchrun, and in
DLRover's Flash Checkpoint, side by side.

Run by hand (not part of the test suite): ``python -m benchmarks recovery [--quick] [--reps N]
[--only a --only b ...] [--kills worker node] [--dlrover-python PYTHON] [--logs DIR]``.

**The job** (benchmarks/workers/ddp_recovery.py): torch gloo DDP, 2 nodes x 2 ranks on loopback:
two agents of ``--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint
127.0.0.1:PORT --rdzv-id ID --max-restarts 3``, the same flags for relaunch and torchrun. Six
``nn.Linear(2048, 2048)`` (100.7 MB of parameters) and SGD's momentum (as much again): 201 MB
of state a rank; steps padded to 0.1 s (the worker says how that fits 2 cores). Each worker
appends its pid, its resume and every completed step (its save included) with ``time.time()``
and a checksum of its state to one file, which the benchmark follows. Where ``unshare`` works
(root), each node runs in a mount namespace of its own with a fresh ``/dev/shm``: what a
machine of its own has (DLRover names its shared memory and sockets by the job alone, so two of
its nodes on one machine would share them), and a killed node's shared memory goes with it.

**A job per variant and repetition, killed once per ``--kills`` in turn** (default: a worker,
then, once the job has resumed, a node), each kill 3 steps or more after the (re)start, at the
step given by a random remainder of the save interval (a kill anywhere in a checkpoint period),
at a random point of the next step:

- *worker*: one rank, chosen at random, SIGKILLed by its pid;
- *node*: node B (not the first, which hosts the store) SIGKILLed whole, its agent, workers and
  helpers at once (every process carrying its mark), and a fresh agent started in its place, so
  that the job goes on with 2 nodes (``--nnodes 2``: a lost machine replaced, the case of a
  fixed-size job; the rendezvous benchmark measures ``1:2`` survivors going on alone).

relaunch gets ``--restart-backoff 0:1`` when a job is killed twice: its second kill comes within
a minute of the first restart, which would otherwise be a crash loop's and wait 1 s (torchrun
has no such pause). torchrun runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (unless
``--torch-shared-store``): with torch's default, the rendezvous' TCP store is shared by every
attempt's workers, the restarted workers read the gloo addresses of the killed attempt's from
it (connection refused), the nodes' restart counts drift apart, and an agent gives up after
``--max-restarts``: it recovered from no worker kill here.

**The figures**, for each variant and kill (medians of ``--reps`` runs):

- *kill -> next step*: from the kill to the first step completed by the resumed job (any rank;
  workers started after the kill), and on the way there, to the last worker of the resumed job
  started (*started*: its first line), with torch imported (*torch*), in the process group
  (*joined*), with its state in place (*loaded*); *fork*, the slowest resumed worker's own
  start, from its process's creation (``/proc``'s start time, in 10 ms ticks) to torch
  imported: the warm start that ``--preload torch`` buys; *load*, the longest rank's own load;
- *3rd step*: from the kill to the resumed job's third step done by every rank: back to
  speed, the cost of a restart that the first step does not show (work a load put off, as
  copying the kept state's pages, is paid by then);
- *steps lost*: the highest step the killed job's workers completed (before the kill, or while
  it was in flight) minus the step the job resumed from, each run's;
- *resumed from*: where the ranks' state came from (their own load, received from a rank that
  had it, none); *moved*: ranks that resumed on another node than before;
- *step*, *save*: the killed job's step interval and the time a save held the loop (rank 0; in
  memory mode without each worker's first two saves, which fill new slots);
- *consistent*: every checksum logged for a step is the same (ranks, jobs), and the resumed
  state's is the one logged at that step before the kill; the final loss.

**The variants**: (a) relaunch, ``relaunch.save_state`` every step, ``load_state`` at the start,
``--preload torch,torch._dynamo`` (torch, and what building its optimizer imports); (g) the same
with the training in a ``@relaunch.restart_in_place`` function: the surviving ranks keep their
processes and go on from the model they hold (``relaunch.resumes_from``), and only the killed
rank (or the lost node's) starts and loads; (b) relaunch,
``torch.save`` every step, (c) every 10 steps (global rank 0 writes, every rank reads); (d), (e) the
same under torchrun (``python -m torch.distributed.run``); (f) DLRover 0.6.1's Flash Checkpoint
(``DdpCheckpointer.save_checkpoint(..., StorageType.MEMORY)`` every step, ``load_checkpoint()``)
under ``dlrover-run`` with a local DLRover master for the 2 nodes, where ``--dlrover-python``
(default: this interpreter) imports dlrover 0.6.1 with the same torch and mount namespaces work;
benchmarks/workers/dlrover_run.py gives torch 2.13's ``SubprocessHandler`` the ``numa_options`` that
0.6.1 does not pass.

**Budgets** (variants a and g; the next step's, g's alone: relaunch's fastest recovery, a's
figure is printed beside it): worker kill -> next step <= 1.0 s, a restarted rank's warm start (its
fork -> its first line, torch imported: *fork*) <= 0.2 s, steps lost 0 after a worker kill and
<= 1 after a node kill (worst run), ``save_state`` of the 201 MB state <= 2 x copying as many
bytes (a 100 MB ``bytearray`` copy timed in the same worker beside its saves, scaled), and every
run of every relaunch variant recovered with consistent state. The others' figures are for
comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import itertools
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from benchmarks import harness
from benchmarks.harness import RELAUNCH, TORCHRUN, BenchError, Check, fmt, log, median
from relaunch.endpoints import find_free_port
from tests.support.procs import kill_pid, pid_alive

QUICK = {"reps": 1}
DLROVER = "dlrover"
NODES, NPROC = 2, 2
RANKS = NODES * NPROC
NEXT_STEP_BUDGET_S = 1.0
RESTART_BUDGET_S = 0.2
SAVE_BUDGET_COPIES = 2.0  # save_state <= this many copies of the state's bytes
STATE_BYTES = 2 * 6 * (2048 * 2048 + 2048) * 4  # a rank's parameters and momentum
WORKER_LOST_BUDGET = 0
NODE_LOST_BUDGET = 1
MIN_STEPS = 3  # a kill comes at least this many steps after the (re)start
AFTER_STEPS = 3  # steps of the resumed job before it is told to stop
RUN_TIMEOUT_S = 120.0  # a job, from its start to every agent gone, per kill
PORT_TIMEOUT_S = 60.0
POLL_S = 0.01
DLROVER_SOCKETS = "/tmp/ckpt_sock"  # DLRover's fixed socket directory
TORCH_OWN_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
NODE_VAR = "RECOVERY_NODE"  # every process of a node carries NODE_VAR=<run tag><node>
KILLS = ("worker", "node")
IN_PLACE = "g"  # the variant whose next step the budget is for: relaunch's fastest recovery
#: A worker's ID in its events: its pid, plus this times the calls before of a process that
#: restarts in place (benchmarks/workers/ddp_recovery.py).
PID_SPAN = 1 << 22


@dataclass(frozen=True)
class Variant:
    key: str
    launcher: str  # RELAUNCH, TORCHRUN or DLROVER
    mode: str  # the worker's: memory, disk or flash
    every: int  # save after every this many steps
    what: str
    flags: tuple[str, ...] = ()
    worker_args: tuple[str, ...] = ()  # after the worker's OUT MODE EVERY


VARIANTS = (
    Variant(
        "a",
        RELAUNCH,
        "memory",
        1,
        "relaunch, save_state every step",
        ("--preload", "torch,torch._dynamo"),
    ),
    Variant("b", RELAUNCH, "disk", 1, "relaunch, torch.save every step"),
    Variant(
        "g",
        RELAUNCH,
        "memory",
        1,
        "relaunch, save_state every step, in place",
        ("--preload", "torch,torch._dynamo"),
        ("in-place",),
    ),
    Variant("c", RELAUNCH, "disk", 10, "relaunch, torch.save every 10 steps"),
    Variant("d", TORCHRUN, "disk", 1, "torchrun, torch.save every step"),
    Variant("e", TORCHRUN, "disk", 10, "torchrun, torch.save every 10 steps"),
    Variant("f", DLROVER, "flash", 1, "DLRover 0.6.1, Flash Checkpoint every step"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=3, help="runs of each variant and kill")
    parser.add_argument(
        "--only",
        action="append",
        choices=[v.key for v in VARIANTS],
        help="run only these variants (repeat the option; default: all)",
    )
    parser.add_argument(
        "--kills", nargs="+", choices=KILLS, default=list(KILLS), help="what is killed"
    )
    parser.add_argument("--seed", type=int, default=27, help="seed of the kills' steps and ranks")
    parser.add_argument(
        "--logs", metavar="DIR", help="keep each job's agent logs and worker events in DIR"
    )
    parser.add_argument(
        "--torch-shared-store",
        action="store_true",
        help="torchrun as torch has it: without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (then it "
        "does not recover from a worker kill here)",
    )
    parser.add_argument(
        "--dlrover-python",
        default=sys.executable,
        help="an interpreter that imports dlrover 0.6.1 and the same torch (default: %(default)s)",
    )


# -- the processes of a run ---------------------------------------------------------------------


def last_line_of(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:160] if lines else "no output"


def private_mounts(directories: tuple[str, ...]) -> list[str]:
    """The command prefix that runs the rest (after a name for ``$0``) in a mount namespace of
    its own, a fresh tmpfs on each of ``directories``."""
    mounts = " && ".join(f"mkdir -p {d} && mount -t tmpfs tmpfs {d}" for d in directories)
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"']


def namespaces_work() -> str | None:
    """None when ``private_mounts`` works here (root, unshare); else why not."""
    try:
        probe = subprocess.run(
            [*private_mounts(("/dev/shm",)), "probe", "true"], capture_output=True, text=True
        )
    except OSError as exc:
        return str(exc)
    return None if probe.returncode == 0 else last_line_of(probe.stderr)


def tagged(prefix: str) -> list[int]:
    """Live processes whose environment has NODE_VAR starting with ``prefix``."""
    needle = f"{NODE_VAR}={prefix}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as file:
                environ = file.read().split(b"\0")
        except OSError:
            continue
        if any(item.startswith(needle) for item in environ) and pid_alive(int(entry)):
            found.append(int(entry))
    return found


@dataclass
class Event:
    kind: str
    at: float
    rank: int
    fields: list[str]


@dataclass
class Job:
    """The agents of one run (each a node, its processes marked ``tag + node``), and the events
    its workers wrote."""

    dir: str
    env: dict[str, str]
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    agents: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    pids: dict[int, tuple[int, str]] = field(default_factory=dict)  # pid -> (rank, node)
    shm: dict[str, set[str]] = field(default_factory=dict)  # node -> relaunch's /dev/shm files
    _offset: int = 0
    _partial: bytes = b""
    _files: list[IO[bytes]] = field(default_factory=list)

    def start(
        self,
        node: str,
        argv: list[str],
        extra: dict[str, str] | None = None,
        private: tuple[str, ...] = (),
    ) -> None:
        """Start ``node``'s agent; with ``private``, in a mount namespace of its own with a
        fresh tmpfs on each of these directories (a machine of its own)."""
        out = open(os.path.join(self.dir, f"agent-{node}.log"), "wb")  # noqa: SIM115
        self._files.append(out)
        env = {**self.env, NODE_VAR: self.tag + node, **(extra or {})}
        if private:
            argv = [*private_mounts(private), node, *argv]
        self.agents[node] = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env
        )

    def poll(self) -> None:
        """Read the workers' new lines."""
        path = os.path.join(self.dir, "events")
        with contextlib.suppress(FileNotFoundError), open(path, "rb") as file:
            file.seek(self._offset)
            data = file.read()
            self._offset += len(data)
            *lines, self._partial = (self._partial + data).split(b"\n")
            for line in lines:
                kind, at, rank, *rest = line.decode().split()
                self.events.append(Event(kind, float(at), int(rank), rest))
                if kind == "start":
                    self.pids[int(rest[0])] = (int(rank), rest[2])
                    self.shm[rest[2]] = {*self.shm.get(rest[2], ()), *rest[3:5]} - {"-"}

    def of(self, kind: str, pids: Callable[[int], bool] | None = None) -> list[Event]:
        """Events of ``kind`` (of the workers whose pid ``pids`` accepts)."""
        found = [e for e in self.events if e.kind == kind]
        if pids is not None:
            found = [e for e in found if pids(self.pid_of(e))]
        return found

    def pid_of(self, event: Event) -> int:
        """The pid of the worker that wrote ``event``: the newest start of its rank before it."""
        pid = -1
        for e in self.events:
            if e is event:
                break
            if e.kind == "start" and e.rank == event.rank:
                pid = int(e.fields[0])
        return pid

    def tail(self) -> str:
        """The last line of every agent's output."""
        return "; ".join(
            f"{node}: {harness.last_line(os.path.join(self.dir, f'agent-{node}.log'))}"
            for node in self.agents
        )

    def kill_node(self, node: str) -> list[int]:
        """SIGKILL every process of ``node`` at once (its agent, workers and helpers); their
        pids. Its shared memory goes too, as with a machine lost: a private tmpfs (see
        ``start``) with its last process, otherwise relaunch's files, which its guardian,
        killed with the rest, would have removed."""
        pids = tagged(self.tag + node)
        for pid in pids:
            kill_pid(pid)
        for pid in pids:
            while pid_alive(pid):
                time.sleep(POLL_S)
        for path in self.shm.get(self.tag + node, ()):
            if path.startswith("/dev/shm/"):
                shutil.rmtree(path, ignore_errors=True)
                for name in glob.glob(glob.escape(path) + "*"):
                    with contextlib.suppress(OSError):
                        os.unlink(name)
        return pids

    def close(self) -> None:
        """Kill whatever of the run is left (by pid), reap the agents, close their logs."""
        for pid in tagged(self.tag):
            kill_pid(pid)
        for proc in self.agents.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for out in self._files:
            out.close()


# -- one run ------------------------------------------------------------------------------------


@dataclass
class Run:
    killed: str  # what was killed: "rank R" or "node (ranks R, S)"
    next_s: float  # kill -> the resumed job's first completed step
    third_s: float | None  # kill -> the resumed job's third step, done by every rank
    last: int  # the highest step the first job completed
    resumed: int  # the step the resumed job started from
    started_s: float  # kill -> the resumed job's last worker started (its first line)
    restarted_s: float | None  # kill -> the resumed job's last worker with torch imported
    warm_s: float | None  # the slowest resumed worker's own start: created -> torch imported
    joined_s: float  # kill -> the resumed job's process group formed (the last worker)
    loaded_s: float  # kill -> the resumed job's last worker with its state in place
    load_s: float  # the longest of the resumed ranks' own loads
    step_s: float  # the first job's step interval (rank 0, median)
    save_s: float | None  # a save's hold on the loop (rank 0, median of the steps that saved)
    memcpy_s: float | None  # one 100 MB bytearray copy by rank 0 (memory mode), median
    sources: str  # where the resumed ranks' state came from
    moved: int  # ranks that resumed on another node than before (a replacement: the same)
    consistent: bool
    loss: float | None  # the last step's loss

    @property
    def lost(self) -> int:
        return self.last - self.resumed


def wait_port(port: int, job: Job, deadline: float) -> None:
    """Until something listens on 127.0.0.1:``port`` (the first agent's store)."""
    while True:
        with socket.socket() as sock, contextlib.suppress(OSError):
            sock.settimeout(0.2)
            sock.connect(("127.0.0.1", port))
            return
        check(job, deadline, "the store's port to open")
        time.sleep(0.05)


def check(job: Job, deadline: float, what: str, gone: frozenset[str] = frozenset()) -> None:
    """Raise when the run is over time or an agent (other than ``gone``) ended too early."""
    ended = {n: p.poll() for n, p in job.agents.items() if n not in gone and p.poll() is not None}
    if ended:
        raise BenchError(f"an agent ended ({ended}) waiting for {what}: {job.tail()}")
    if time.monotonic() > deadline:
        raise BenchError(f"timed out waiting for {what}: {job.tail()}")


def await_events(
    job: Job, ready: Callable[[], bool], deadline: float, what: str, gone: frozenset[str]
) -> None:
    job.poll()
    while not ready():
        check(job, deadline, what, gone)
        time.sleep(POLL_S)
        job.poll()


def one_job(ctx: harness.Context, variant: Variant, rep: int, launch: Launch) -> dict[str, Any]:
    """Start the job; for each of ``--kills`` in turn, kill a worker or a node at a random
    step and follow the job until ``AFTER_STEPS`` steps after its resume; stop it. A ``Run``
    for each kill measured (or why it could not be), by kill."""
    rng = random.Random(f"{ctx.opts.seed}-{variant.key}-{rep}")
    run_dir = os.path.join(ctx.tmp, f"{variant.key}-{rep}")
    os.makedirs(run_dir)
    job = Job(run_dir, ctx.env)
    deadline = time.monotonic() + RUN_TIMEOUT_S * len(ctx.opts.kills)
    gone: frozenset[str] = frozenset()
    results: dict[str, Any] = {}
    current: Callable[[int], bool] = lambda pid: True  # noqa: E731  the workers running now
    resumed = 0
    kill = "start"
    try:
        launch.start(job, variant, deadline)
        for kill in ctx.opts.kills:
            # After the 3rd step from the resume, at the step given by a random remainder of
            # the save interval: a kill anywhere in a checkpoint period.
            target = resumed + MIN_STEPS
            target += (rng.randrange(variant.every) - target) % variant.every

            def reached(target: int = target, now: Callable[[int], bool] = current) -> bool:
                return max((int(e.fields[0]) for e in job.of("step", now)), default=-1) >= target

            await_events(job, reached, deadline, f"step {target}", gone)
            ours = sorted((int(e.fields[0]), e.at) for e in job.of("step", current) if e.rank == 0)
            intervals = [b[1] - a[1] for a, b in itertools.pairwise(ours) if b[0] == a[0] + 1]
            intervals = intervals[2:] or intervals  # after a (re)start's first, slower, steps
            step_s = median(intervals) if intervals else 0.1
            time.sleep(rng.uniform(0.0, step_s))
            job.poll()
            old = set(job.pids)
            if kill == "worker":
                rank = rng.randrange(RANKS)
                pid = max((e.at, int(e.fields[0])) for e in job.of("start") if e.rank == rank)[1]
                killed = f"rank {rank}"
                killed_at = time.time()
                kill_pid(pid % PID_SPAN)
            else:
                ranks = sorted(
                    {
                        r
                        for p, (r, n) in job.pids.items()
                        if n == job.tag + "B" and pid_alive(p % PID_SPAN)
                    }
                )
                killed = f"node (ranks {', '.join(map(str, ranks))})"
                killed_at = time.time()
                job.kill_node("B")
                job.agents["B"].wait()
                gone = frozenset({"B"})
                launch.replace(job, variant, "B2")

            def new(pid: int, old: set[int] = old) -> bool:
                return pid not in old

            await_events(job, lambda: bool(job.of("step", new)), deadline, "the resumed job", gone)
            resumed = min(int(e.fields[0]) for e in job.of("resume", new))

            def done(resumed: int = resumed, new: Callable[[int], bool] = new) -> bool:
                """Every rank of the resumed job did its third step."""
                there = resumed + AFTER_STEPS
                return (
                    len({e.rank for e in job.of("step", new) if int(e.fields[0]) >= there}) == RANKS
                )

            await_events(job, done, deadline, "the resumed job's steps", gone)
            results[kill] = measure(job, variant, old, killed, killed_at, step_s, current)
            current = new
        kill = "end"
        with open(os.path.join(run_dir, "stop"), "w"):
            pass
        ending = {
            node: proc
            for node, proc in job.agents.items()
            if node not in gone and node != "master"  # DLRover's master: a service
        }
        while any(proc.poll() is None for proc in ending.values()):
            if time.monotonic() > deadline:
                raise BenchError(f"timed out waiting for the job's end: {job.tail()}")
            time.sleep(POLL_S)
        failed = {node: proc.returncode for node, proc in ending.items() if proc.returncode}
        if failed:
            raise BenchError(f"agents exited {failed}: {job.tail()}")
        job.poll()
    except BenchError as exc:
        if not results:
            raise
        for later in ctx.opts.kills:
            results.setdefault(later, f"{kill}: {exc}")
        log(f"  {variant.key}: {kill}: {exc}")
    finally:
        job.close()
        if ctx.opts.logs:
            shutil.copytree(
                run_dir,
                os.path.join(ctx.opts.logs, os.path.basename(run_dir)),
                ignore=shutil.ignore_patterns("ckpt"),
                dirs_exist_ok=True,
            )
    if consistent_steps(job) is False:
        for measured in results.values():
            if isinstance(measured, Run):
                measured.consistent = False
    return results


def consistent_steps(job: Job) -> bool:
    """Every checksum logged for a step is the same (any rank, any job of the run)."""
    sums: dict[int, set[str]] = {}
    for e in job.of("step"):
        sums.setdefault(int(e.fields[0]), set()).add(e.fields[1])
    return all(len(s) == 1 for s in sums.values())


def measure(
    job: Job,
    variant: Variant,
    old: set[int],
    killed: str,
    killed_at: float,
    step_s: float,
    before: Callable[[int], bool],
) -> Run:
    """The figures of a kill: ``old``, every worker pid at the kill; ``before``, those of the
    job that was killed."""

    def new(pid: int) -> bool:
        return pid not in old

    first = job.of("step", lambda pid: pid in old and before(pid))
    last = max(int(e.fields[0]) for e in first)
    resumes = job.of("resume", new)
    resumed = min(int(e.fields[0]) for e in resumes)
    later = job.of("step", new)
    next_s = min(e.at for e in later) - killed_at
    third = [e.at for e in later if int(e.fields[0]) == resumed + AFTER_STEPS]
    third_s = max(third) - killed_at if len(third) == RANKS else None
    resumed_pids = {job.pid_of(e) for e in resumes}
    imported = [e.at for e in job.of("torch") if job.pid_of(e) in resumed_pids]
    restarted_s = max(imported) - killed_at if imported else None
    created = {int(e.fields[0]): e.at - float(e.fields[5]) for e in job.of("start")}
    own_starts = [
        e.at - created[pid]
        for e in job.of("torch")
        if (pid := job.pid_of(e)) in resumed_pids and pid in created
    ]
    started = [e.at for e in job.of("start") if int(e.fields[0]) in resumed_pids]
    # A save's hold on the loop: rank 0's saves; in memory mode but each worker's first two
    # (relaunch's two slots of a rank, filled for the first time on a node: page faults).
    saving: list[float] = []
    for pid in {job.pid_of(e) for e in first if e.rank == 0}:
        mine = sorted((int(e.fields[0]), float(e.fields[3])) for e in first if job.pid_of(e) == pid)
        saving += [s for _, s in mine if s > 1e-4][2 if variant.mode == "memory" else 0 :]
    # Ranks that changed nodes (a replacement node counts as the node it replaces).
    nodes_before = {r: n for p, (r, n) in job.pids.items() if p in old and before(p)}
    nodes_after = {r: n for p, (r, n) in job.pids.items() if p in resumed_pids}
    moved = sum(
        nodes_before.get(r, "").rstrip("2") != n.rstrip("2") for r, n in nodes_after.items()
    )
    memcpy = [float(e.fields[0]) for e in job.of("memcpy", lambda pid: pid in old and before(pid))]
    # Consistency: one checksum per step, whoever logged it; a resume's is its step's.
    sums: dict[int, set[str]] = {}
    for e in job.of("step"):
        sums.setdefault(int(e.fields[0]), set()).add(e.fields[1])
    for e in job.of("resume", lambda pid: pid in old):  # the earlier jobs' resumes
        sums.setdefault(int(e.fields[0]), set()).add(e.fields[1])
    consistent = all(len(s) == 1 for s in sums.values()) and all(
        {e.fields[1]} == sums.get(int(e.fields[0]), {e.fields[1]}) for e in resumes
    )
    sources = sorted({e.fields[2] for e in resumes})
    return Run(
        killed=killed,
        next_s=next_s,
        third_s=third_s,
        last=last,
        resumed=resumed,
        started_s=max(started) - killed_at,
        restarted_s=restarted_s,
        warm_s=max(own_starts) if own_starts else None,
        joined_s=max(e.at for e in job.of("joined") if job.pid_of(e) in resumed_pids) - killed_at,
        loaded_s=max(e.at for e in resumes) - killed_at,
        load_s=max(float(e.fields[3]) for e in resumes),
        step_s=step_s,
        save_s=median(saving) if saving else None,
        memcpy_s=median(memcpy) if memcpy else None,
        sources="+".join(sources),
        moved=moved,
        consistent=consistent and len(resumes) == RANKS,
        loss=float(later[-1].fields[2]) if later else None,
    )


# -- the launchers ------------------------------------------------------------------------------


@dataclass
class Launch:
    """How each launcher starts a node of the job."""

    ctx: harness.Context
    relaunch: list[str]
    torchrun: list[str]
    dlrover_python: str
    relaunch_flags: list[str] = field(default_factory=list)  # relaunch's own, beside the common
    torchrun_env: dict[str, str] = field(default_factory=dict)
    namespaces: bool = False  # each node in a mount namespace with a /dev/shm of its own
    port: int = 0

    def flags(self, job: Job) -> list[str]:
        return [
            "--nnodes",
            str(NODES),
            "--nproc-per-node",
            str(NPROC),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{self.port}",
            "--rdzv-id",
            f"recovery-{job.tag}",
            "--max-restarts",
            "3",
        ]

    def argv(self, job: Job, variant: Variant) -> list[str]:
        job_args = [
            harness.worker("ddp_recovery.py"),
            job.dir,
            variant.mode,
            str(variant.every),
            *variant.worker_args,
        ]
        if variant.launcher == RELAUNCH:
            return [
                *self.relaunch,
                *self.flags(job),
                *self.relaunch_flags,
                *variant.flags,
                *job_args,
            ]
        if variant.launcher == TORCHRUN:
            return [*self.torchrun, *self.flags(job), *job_args]
        return [
            self.dlrover_python,
            harness.worker("dlrover_run.py"),
            "--nnodes",
            str(NODES),
            "--nproc-per-node",
            str(NPROC),
            "--max-restarts",
            "3",
            *job_args,
        ]

    def dlrover_env(self, job: Job, node_rank: int, node_id: int) -> dict[str, str]:
        return {
            "DLROVER_MASTER_ADDR": f"127.0.0.1:{self.port}",
            "NODE_RANK": str(node_rank),
            "NODE_ID": str(node_id),
            "NODE_NUM": str(NODES),
            "ELASTIC_JOB_NAME": f"recovery-{job.tag}",
        }

    def node(self, job: Job, variant: Variant, node: str, rank: int, node_id: int) -> None:
        """Start the agent of ``node`` (DLRover's node rank ``rank``, id ``node_id``)."""
        extra: dict[str, str] = {}
        private: tuple[str, ...] = ("/dev/shm",) if self.namespaces else ()
        if variant.launcher == TORCHRUN:
            extra = self.torchrun_env
        elif variant.launcher == DLROVER:
            extra = self.dlrover_env(job, rank, node_id)
            private += (DLROVER_SOCKETS,)
        else:  # relaunch copies kept state to the other node only with the job's token
            extra = {"RELAUNCH_RDZV_TOKEN": f"recovery-{job.tag}"}
        job.start(node, self.argv(job, variant), extra, private)

    def start(self, job: Job, variant: Variant, deadline: float) -> None:
        """The job's two nodes: A first (it hosts the store, or DLRover's master is started),
        then B once the port is open."""
        self.port = find_free_port()
        if variant.launcher == DLROVER:
            master = [
                self.dlrover_python,
                "-u",
                "-m",
                "dlrover.python.master.main",
                "--port",
                str(self.port),
                "--node_num",
                str(NODES),
                "--job_name",
                f"recovery-{job.tag}",
                "--platform",
                "local",
            ]
            job.start("master", master)
            wait_port(self.port, job, deadline)
            self.node(job, variant, "A", 0, 0)
            self.node(job, variant, "B", 1, 1)
            return
        self.node(job, variant, "A", 0, 0)
        wait_port(self.port, job, deadline)
        self.node(job, variant, "B", 1, 1)

    def replace(self, job: Job, variant: Variant, node: str) -> None:
        """A fresh agent, ``node``, in the place of node B (DLRover: its rank, a new id)."""
        self.node(job, variant, node, 1, 2)


def unavailable(ctx: harness.Context, variant: Variant, launch: Launch) -> str | None:
    """Why ``variant`` cannot run here (None: it can)."""
    if variant.launcher == TORCHRUN:
        reason: str | None = ctx.opts.no_torchrun_reason
        return None if reason is None else f"not run: {reason}"
    if variant.launcher == DLROVER:
        probe = subprocess.run(
            [
                launch.dlrover_python,
                "-c",
                "import torch, dlrover.trainer.torch.flash_checkpoint.ddp; "
                "from importlib.metadata import version; "
                "print(version('dlrover'), torch.__version__)",
            ],
            capture_output=True,
            text=True,
            env=ctx.env,
        )
        if probe.returncode != 0:
            return f"did not run: dlrover does not import ({last_line_of(probe.stderr)})"
        got = probe.stdout.split()
        if got[0] != "0.6.1" or got[1] != harness.torch_version():
            return f"did not run: dlrover {got[0]} with torch {got[1]} (wants 0.6.1, ours)"
        if not launch.namespaces:
            # Its sockets (/tmp/ckpt_sock/JOB) and shared memory (JOB_...) are named by the
            # job alone: two nodes on one machine would share them.
            return "did not run: two nodes on one machine need a mount namespace each (root)"
        return None
    if variant.mode == "memory":
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                "import relaunch; print(hasattr(relaunch, 'save_state') "
                "and hasattr(relaunch, 'load_state'))",
            ],
            capture_output=True,
            text=True,
            env=ctx.env,
        )
        if probe.stdout.strip() != "True":
            return "not available: relaunch has no save_state/load_state"
    if variant.flags:
        script = harness.worker("noop.py")
        dry = [*launch.relaunch, "--standalone", *variant.flags, "--dry-run", script]
        probe = subprocess.run(dry, capture_output=True, text=True, env=ctx.env)
        if probe.returncode != 0:
            line = last_line_of(probe.stderr)
            return f"not available: relaunch rejects {' '.join(variant.flags)} ({line})"
    return None


# -- the tables ---------------------------------------------------------------------------------


def spread(values: list[float], spec: str = ".2f") -> str:
    """The median, and the range when there are several."""
    if not values:
        return "-"
    if len(values) == 1:
        return format(values[0], spec)
    low, mid, high = (format(x, spec) for x in (min(values), median(values), max(values)))
    return f"{mid} [{low}-{high}]"


def row(variant: Variant, runs: list[Run], reps: int, error: str | None) -> str:
    if not runs:
        return f"  {variant.key}  {variant.what:<44} {error}"
    saves = [r.save_s for r in runs if r.save_s is not None]
    imported = [r.restarted_s for r in runs if r.restarted_s is not None]
    warm = [r.warm_s for r in runs if r.warm_s is not None]
    losses = [r.loss for r in runs if r.loss is not None]
    note = f"  ({len(runs)} of {reps}: {error})" if error else ""

    def mid(values: list[float], spec: str = ".2f") -> str:
        return fmt(median(values) if values else None, spec)

    return (
        f"  {variant.key}  {variant.what:<44} {mid([r.step_s for r in runs]):>5}"
        f" {mid(saves, '.3f'):>6} {mid([r.started_s for r in runs]):>7} {mid(imported):>6}"
        f" {mid(warm, '.3f'):>6}"
        f" {mid([r.joined_s for r in runs]):>6} {mid([r.load_s for r in runs]):>5}"
        f" {mid([r.loaded_s for r in runs]):>6}"
        f" {spread([r.next_s for r in runs]):>18}"
        f" {mid([r.third_s for r in runs if r.third_s is not None]):>8}"
        f" {','.join(str(r.lost) for r in runs):>6}"
        f" {'+'.join(sorted({r.sources for r in runs})):>13}"
        f" {','.join(str(r.moved) for r in runs):>5}"
        f" {sum(r.consistent for r in runs)} of {len(runs)}  {mid(losses, '.4f'):>6}{note}"
    )


HEADER = (
    f"  {'':1}  {'variant':<44} {'step':>5} {'save':>6} {'started':>7} {'torch':>6} {'fork':>6}"
    f" {'joined':>6} {'load':>5} {'loaded':>6} {'kill -> next step':>18} {'3rd step':>8}"
    f" {'lost':>6}"
    f" {'resumed from':>13} {'moved':>5} {'consistent':>6}  {'loss':>6}"
)


def run(ctx: harness.Context) -> list[Check]:
    opts = ctx.opts
    relaunch, torchrun = ctx.launchers(harness.Launcher)
    launch = Launch(ctx, relaunch.prefix, torchrun.prefix, opts.dlrover_python)
    namespaces = namespaces_work()
    launch.namespaces = namespaces is None
    if namespaces is not None:
        log(f"nodes share this machine's /dev/shm (no mount namespaces: {namespaces})")
    if not opts.torch_shared_store:
        launch.torchrun_env = TORCH_OWN_STORE
    if len(opts.kills) > 1:
        # Its second kill comes within a minute of the first restart: no crash-loop pause
        # (torchrun has none), so that it is measured as a first.
        launch.relaunch_flags = ["--restart-backoff", "0:1"]
    variants = [v for v in VARIANTS if not opts.only or v.key in opts.only]
    reasons = {v.key: unavailable(ctx, v, launch) for v in variants}
    for key, reason in reasons.items():
        if reason is not None:
            log(f"variant {key}: {reason}")
    log(f"{opts.reps} job(s) of each variant, alternating; kills in each: {', '.join(opts.kills)}")
    sides = {
        v.key: (lambda rep, v=v: one_job(ctx, v, rep, launch))
        for v in variants
        if reasons[v.key] is None
    }
    errors: dict[str, str] = {}

    def collect(side: str) -> None:
        ctx.collect()

    made_sockets = not os.path.exists(DLROVER_SOCKETS)  # the mount point private_mounts makes
    try:
        jobs = harness.run_alternating(sides, dict.fromkeys(sides, opts.reps), errors, collect)
    finally:
        if made_sockets:
            with contextlib.suppress(OSError):
                os.rmdir(DLROVER_SOCKETS)
    checks: list[Check] = []
    everything: dict[str, dict[str, list[Run]]] = {}
    for kill in opts.kills:
        what = (
            "a random rank SIGKILLed"
            if kill == "worker"
            else "the second node (agent and workers) SIGKILLed, a fresh agent started"
        )
        print(
            f"\n{kill} kill: {what} at a random step; 2 nodes x 2 ranks, 201 MB of state a rank"
            f"\n(s; median [min-max] of {opts.reps}; lost: each run's steps lost)"
        )
        print(
            "(started, torch, joined, loaded: kill -> the resumed job's last worker started, with"
            "\ntorch imported, in the process group, with its state in place; fork: the slowest"
            "\nresumed worker's own start, its fork -> torch imported; load: the longest rank's"
            "\nown load; 3rd step: kill -> the resumed job's third step, every rank; step, save:"
            "\nthe killed job's step interval and save, rank 0; moved: ranks that resumed on"
            "\nanother node)"
        )
        print(HEADER)
        samples: dict[str, list[Run]] = {}
        for v in variants:
            runs = [job[kill] for job in jobs.get(v.key, []) if isinstance(job.get(kill), Run)]
            failures = [job[kill] for job in jobs.get(v.key, []) if isinstance(job.get(kill), str)]
            error = reasons[v.key] or errors.get(v.key) or (failures[0] if failures else None)
            samples[v.key] = runs
            if error:
                errors[f"{kill}-{v.key}"] = error
            print(row(v, runs, opts.reps, error))
            for r in runs:
                log(f"  {v.key} {kill}: {r}")
            ctx.data[f"{kill}-{v.key}"] = {
                "unavailable": reasons[v.key],
                "error": error,
                "runs": [vars(r) | {"lost": r.lost} for r in runs],
            }
        checks += kill_checks(kill, variants, samples, reasons, opts.reps)
        everything[kill] = samples
    if "a" in reasons:
        checks.append(save_check([r for samples in everything.values() for r in samples["a"]]))
    checks.append(peer_copy_check(ctx))
    return checks


def peer_copy_check(ctx: harness.Context) -> Check:
    """A node's state copied to another over loopback (``agent.state_peers``): a 100 MiB slot
    pushed to the successor, and pulled back, medians of 5; no budget, the note gives it."""
    import tempfile

    from relaunch.agent.state_peers import PeerLink
    from relaunch.core.workers import state as layout
    from relaunch.state.files import PEERS, SlotWriter, committed

    size = 100 << 20
    with (
        tempfile.TemporaryDirectory(dir="/dev/shm") as a_dir,
        tempfile.TemporaryDirectory(dir="/dev/shm") as b_dir,
    ):
        sender, receiver = (
            PeerLink(a_dir, "127.0.0.1", 2 * size, "bench"),
            PeerLink(b_dir, "127.0.0.1", 2 * size, "bench"),
        )
        try:
            fd = os.open(os.path.join(a_dir, layout.slot_name(0, 0)), os.O_RDWR | os.O_CREAT, 0o600)
            writer = SlotWriter(fd)
            data = memoryview(bytearray(os.urandom(1 << 20)) * 100)
            peer = receiver.address
            pushes, pulls = [], []
            for step in range(1, 6):
                writer.write(step, step, [data])  # a save not copied yet
                began = time.perf_counter()
                sender._push(0, peer, 0)  # never held
                pushes.append(time.perf_counter() - began)
                copies = committed(os.path.join(b_dir, PEERS), 0).values()
                assert step in {head.step for head in copies}, "the copy was not committed"
                began = time.perf_counter()
                assert sender.pull(peer, 0, step, os.path.join(a_dir, f"pulled{step}"))
                pulls.append(time.perf_counter() - began)
            writer.close()
            os.close(fd)
        finally:
            sender.close()
            receiver.close()
    push, pull = median(pushes), median(pulls)
    ctx.data["peer_copy"] = {"bytes": size, "push_s": pushes, "pull_s": pulls}
    mib = size / (1 << 20)
    return Check(
        "a node's state to another over loopback (100 MiB slot: push, pull)",
        f"{mib / push:.0f} MiB/s, {mib / pull:.0f} MiB/s",
        "-",
        None,
    )


def save_check(runs: list[Run]) -> Check:
    """save_state's hold on the loop against copying as many bytes with ``bytearray``s (the
    100 MB copy timed in the same worker, scaled to the state's size), medians over every run."""
    saves = [r.save_s for r in runs if r.save_s is not None]
    copies = [r.memcpy_s for r in runs if r.memcpy_s is not None]
    if not saves or not copies:
        return Check("a, save_state vs copying the state's bytes", "-", "<= 2x", None)
    save, copy = median(saves), median(copies) * STATE_BYTES / 100e6
    return Check(
        f"a, save_state of {STATE_BYTES / 1e6:.0f} MB vs copying it (rank 0)",
        f"{save * 1e3:.0f} ms / {copy * 1e3:.0f} ms = {save / copy:.2f}x",
        f"<= {SAVE_BUDGET_COPIES:g}x",
        save / copy <= SAVE_BUDGET_COPIES,
    )


def kill_checks(
    kill: str,
    variants: list[Variant],
    samples: dict[str, list[Run]],
    reasons: dict[str, str | None],
    reps: int,
) -> list[Check]:
    """The budgets of a kill: those of the next step for ``IN_PLACE``, relaunch's fastest
    recovery (a beside it, with no verdict), the others' for both."""
    checks = []
    keys = {v.key for v in variants}
    for key in ("a", IN_PLACE):
        if key not in keys:
            continue
        runs = samples.get(key, [])
        measured = bool(runs)
        if kill == "worker":
            next_s = median([r.next_s for r in runs]) if measured else None
            budgeted = key == IN_PLACE
            checks.append(
                Check(
                    f"{key}, worker kill -> next step (median)",
                    f"{fmt(next_s, '.2f')} s",
                    f"<= {NEXT_STEP_BUDGET_S:g} s" if budgeted else "-",
                    next_s <= NEXT_STEP_BUDGET_S if budgeted and next_s is not None else None,
                )
            )
            warm = [r.warm_s for r in runs if r.warm_s is not None]
            value = median(warm) if warm else None
            checks.append(
                Check(
                    f"{key}, warm start: a restarted rank's fork -> its first line, torch "
                    "imported (slowest rank, median)",
                    f"{fmt(value, '.3f')} s",
                    f"<= {RESTART_BUDGET_S:g} s",
                    value <= RESTART_BUDGET_S if value is not None else None,
                )
            )
        budget = WORKER_LOST_BUDGET if kill == "worker" else NODE_LOST_BUDGET
        worst = max((r.lost for r in runs), default=None)
        checks.append(
            Check(
                f"{key}, {kill} kill: steps lost (worst run)",
                fmt(worst, "d"),
                f"<= {budget}",
                worst <= budget if worst is not None else None,
            )
        )
    for v in variants:
        if v.launcher != RELAUNCH or reasons[v.key] is not None:
            continue
        runs = samples.get(v.key, [])
        good = sum(r.consistent for r in runs)
        checks.append(
            Check(
                f"{v.key}, {kill} kill: recovered, state consistent",
                f"{good} of {reps}",
                f"{reps} of {reps}",
                good == reps,
            )
        )
    return checks
