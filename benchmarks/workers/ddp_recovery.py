"""A DDP training job for the recovery benchmark: python ddp_recovery.py OUT MODE EVERY
[in-place].

A gloo DDP job of 2 x 2 (or any number of) ranks: six ``nn.Linear(2048, 2048)`` layers (100.7 MB
of parameters) and SGD with momentum (a buffer as large), so a rank's state is 201 MB. A step
is padded to ``STEP_S`` (0.1 s). To fit that with 4 ranks on 2 cores, where all-reducing 100 MB
of gradients alone takes ~0.5 s and a full backward and update ~0.1 s a rank:

- every rank trains on the same batch (seeded by the step), so the replicas stay equal without
  the gradients' all-reduce: DDP's communication hook all-reduces 16 values of the bucket instead
  (the ranks still meet in one collective a step, as under DDP, and a dead rank stops the rest);
- step ``s`` trains layer ``s % 6`` (the others run on detached weights): every parameter and
  momentum buffer changes within six steps, and the state saved is always all of it.

The state (``{"step", "model", "optim"}``) is saved after every ``EVERY``-th step, by MODE:

- ``memory``: ``relaunch.save_state(state, step)`` on every rank (``replicated=True`` where it
  takes it); ``relaunch.load_state()`` at the start;
- ``disk``: ``torch.save`` by global rank 0 to OUT/ckpt/latest.pt (written beside it, then
  renamed); every rank ``torch.load``s it at the start;
- ``flash``: DLRover's Flash Checkpoint, ``DdpCheckpointer(OUT/ckpt)``, ``save_checkpoint(step,
  state, path, storage_type=StorageType.MEMORY)``; ``load_checkpoint()`` at the start, its
  tensors copied (they are views of shared memory that the next save overwrites).

With ``in-place``, the training runs in a ``@relaunch.restart_in_place`` function, whose model
and optimizer outlive it: a rank kept across a restart goes on from them when
``relaunch.resumes_from`` says they hold the step resumed from (SOURCE ``kept``: nothing loaded).

At the start the ranks agree on the newest step any of them loaded. A rank that has it makes
its model on the meta device and assigns it the loaded tensors (no initialisation overwritten,
no copy: the resume a user wants, in every mode alike); the others build one and receive the
model and the momentum from a rank that has it (those of a replacement node, in memory mode).

Every line of OUT/events (appended whole) is ``KIND TIME RANK ...``, TIME from ``time.time()``:

- ``start T RANK ID ATTEMPT NODE STATE_DIR CHANNEL AGE``: first thing (STATE_DIR, CHANNEL:
  relaunch's shared-memory files, or -; AGE: seconds since the process was created, 0 in a
  process restarted in place). ID names the worker: its pid, plus ``PID_SPAN`` times the calls
  before this one of a process restarted in place (``ID % PID_SPAN`` is the pid);
- ``torch T RANK``: torch imported; ``joined T RANK``: the process group formed; ``built T
  RANK``: the model and optimizer made, from the loaded state where there is one;
- ``memcpy T RANK SECONDS``: in memory mode, rank 0, every step of the first attempt from its
  second, just before its save on odd steps and just after it on even ones (the saves' load
  either way, as often first as second): one 100 MB ``bytearray`` copy (its buffers, 200 MB,
  are made after the first step; never in a resumed job, whose steps they would slow);
- ``resume T RANK STEP CHECKSUM SOURCE LOAD_S``: the state in place (SOURCE ``own``,
  ``received`` or ``none``; LOAD_S the rank's own load);
- ``step T RANK STEP CHECKSUM LOSS SAVE_S``: the step done, its save (SAVE_S s) included;
- ``done T RANK STEP CHECKSUM``.

The checksum sums a strided sample of every parameter and momentum buffer: equal on every rank
at a step, and a resumed job's equal to the one logged at that step before. The job stops after
the first step that sees OUT/stop (agreed by an all-reduce every step).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

STARTED = time.time()


def _age() -> float:
    """Seconds since this process was created (its fork): the start time in /proc/self/stat,
    in clock ticks since boot (10 ms here)."""
    with open("/proc/self/stat") as file:
        fields = file.read().rpartition(")")[2].split()  # from the 3rd field on
    return time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")


AGE = _age()
LAYERS = 6
WIDTH = 2048
BATCH = 1
STEP_S = 0.1
MB = 100_000_000
PID_SPAN = 1 << 22  # Linux's largest pid_max: an ID above it is a pid's later call


def event(fd: int, *fields: object) -> None:
    os.write(fd, (" ".join(str(f) for f in fields) + "\n").encode())


def clone(obj):
    """``obj`` with every tensor in it (in dicts, lists, tuples) copied."""
    if hasattr(obj, "clone") and hasattr(obj, "storage_offset"):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone(v) for v in obj)
    return obj


class Copy:
    """One 100 MB ``bytearray`` copy, timed (the buffers made, and their pages touched, once)."""

    def __init__(self) -> None:
        self.src, self.dst = bytearray(b"\1" * MB), bytearray(MB)
        memoryview(self.dst)[:] = self.src

    def seconds(self) -> float:
        began = time.perf_counter()
        memoryview(self.dst)[:] = self.src
        return time.perf_counter() - began


#: What outlives a call restarted in place: the model, its optimizer, and the step they hold
#: (None: none to go on from); the calls this process made.
held: dict[str, Any] = {"step": None, "calls": 0}


def main() -> int:
    out, mode, every = sys.argv[1], sys.argv[2], int(sys.argv[3])
    in_place = sys.argv[4:] == ["in-place"]
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    fd = os.open(os.path.join(out, "events"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    node = os.environ.get("RECOVERY_NODE", "-")
    shm = [os.environ.get(name) or "-" for name in ("RELAUNCH_STATE_DIR", "RELAUNCH_CHANNEL")]
    calls = held["calls"]
    held["calls"] = calls + 1
    began, age = (STARTED, AGE) if not calls else (time.time(), 0.0)
    ident = os.getpid() + PID_SPAN * calls
    event(fd, "start", repr(began), rank, ident, attempt, node, *shm, repr(age))

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    event(fd, "torch", repr(time.time()), rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    event(fd, "joined", repr(time.time()), rank)
    copy: Copy | None = None  # made after the first attempt's first step: never on the way back

    class Net(nn.Module):  # type: ignore[misc]
        """Six layers; the forward trains layer ``k`` (the others run on detached weights)."""

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

        def forward(self, x, k):
            for i, layer in enumerate(self.layers):
                x = layer(x) if i == k else F.linear(x, layer.weight.detach(), layer.bias.detach())
                x = F.relu(x) if i < LAYERS - 1 else x
            return x

    def state(step: int) -> dict[str, object]:
        return {"step": step, "model": model.state_dict(), "optim": opt.state_dict()}

    def checksum() -> str:
        total = 0.0
        for p in params:
            total += p.detach().view(-1)[::997].double().sum().item()
            total += opt.state[p]["momentum_buffer"].view(-1)[::997].double().sum().item()
        return repr(total)

    ckpt_dir = os.path.join(out, "ckpt")
    latest = os.path.join(ckpt_dir, "latest.pt")
    checkpointer = storage_type = None
    if mode == "flash":
        import importlib

        flash = importlib.import_module("dlrover.trainer.torch.flash_checkpoint.ddp")
        checkpointer = flash.DdpCheckpointer(ckpt_dir)
        storage_type = flash.StorageType.MEMORY
    replicated: dict[str, bool] = {}
    if mode == "memory":
        import inspect

        import relaunch

        if "replicated" in inspect.signature(relaunch.save_state).parameters:
            replicated["replicated"] = True  # every rank's state is the same

    # -- resume: every rank loads what it has; all agree on the newest step ------------------
    began = time.perf_counter()
    loaded = None
    kept = in_place and relaunch.resumes_from(held["step"])
    if kept:
        loaded = {"step": held["step"]}  # in memory already: the model and optimizer held
    elif mode == "memory":
        got = relaunch.load_state()
        if got is not None:
            loaded = got[1]
    elif mode == "disk" and os.path.exists(latest):
        loaded = torch.load(latest, map_location="cpu", weights_only=False)
    elif mode == "flash":
        assert checkpointer is not None
        got = checkpointer.load_checkpoint()
        # Its tensors are views of the node's shared memory, which the next save overwrites:
        # kept by the optimizer as they are (load_state_dict does not copy a tensor of the
        # right dtype), the momentum would change under it. Copied here.
        loaded = clone(got) if got else None
    load_s = time.perf_counter() - began
    own = loaded["step"] if loaded else -1
    steps = torch.full((world,), -1, dtype=torch.int64)
    steps[rank] = own
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    best = int(steps.max())
    # A rank that holds the step resumed from makes its model of the loaded tensors (on the
    # meta device, then assigned: no initialisation to overwrite, no copy); the others build
    # one and receive the state from a rank that has it.
    if kept and own == best:
        model, opt = held["model"], held["opt"]
        params = list(model.parameters())
        source = "kept"
    elif best >= 0 and own == best:
        assert loaded is not None
        with torch.device("meta"):
            model = Net()
        model.load_state_dict(loaded["model"], assign=True)
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
        opt.load_state_dict(loaded["optim"])
        source = "own"
    else:
        torch.manual_seed(0)
        model = Net()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
        for p in params:  # the momentum exists from the start: every state has the same shape
            opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
        source = "none"
    if in_place:
        held.update(model=model, opt=opt)
    event(fd, "built", repr(time.time()), rank)
    if best >= 0 and bool((steps != best).any()):
        src = int((steps == best).nonzero()[0])
        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, src)
                dist.broadcast(opt.state[p]["momentum_buffer"], src)
        source = source if own == best else "received"
    del loaded
    step = max(best, 0)
    event(
        fd,
        "resume",
        repr(time.time()),
        rank,
        step,
        checksum(),
        source,
        repr(load_s),
    )

    def lockstep(_state, bucket):  # the replicas are equal: meet, but move 16 values, not MBs
        grads = bucket.buffer()
        probe = grads[:16].clone()
        return dist.all_reduce(probe, async_op=True).get_future().then(lambda _: grads)

    ddp = nn.parallel.DistributedDataParallel(
        model,
        find_unused_parameters=True,  # the layers not trained this step
        bucket_cap_mb=512,  # one bucket: one collective a step
        init_sync=False,  # the replicas are equal already (the resume above)
    )
    ddp.register_comm_hook(None, lockstep)
    stop = os.path.join(out, "stop")
    flag = torch.zeros(1)
    while True:
        step += 1
        began = time.perf_counter()
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(BATCH, WIDTH, generator=gen)
        y = torch.randn(BATCH, WIDTH, generator=gen)
        loss = F.mse_loss(ddp(x, step % LAYERS), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        held["step"] = None  # the update changes what the model holds
        opt.step()
        pad = STEP_S - (time.perf_counter() - began)
        if pad > 0:
            time.sleep(pad)
        # Where the saves are, and as often just before rank 0's as just after: under their load.
        if copy is not None and step % 2:
            event(fd, "memcpy", repr(time.time()), rank, repr(copy.seconds()))
        began = time.perf_counter()
        if step % every == 0:
            if mode == "memory":
                relaunch.save_state(state(step), step, **replicated)
            elif mode == "disk" and rank == 0:
                os.makedirs(ckpt_dir, exist_ok=True)
                torch.save(state(step), latest + ".tmp")
                os.replace(latest + ".tmp", latest)
            elif mode == "flash":
                assert checkpointer is not None
                path = os.path.join(ckpt_dir, f"{step}.pt")
                checkpointer.save_checkpoint(step, state(step), path, storage_type=storage_type)
        saved = time.perf_counter() - began
        if copy is not None and not step % 2:
            event(fd, "memcpy", repr(time.time()), rank, repr(copy.seconds()))
        if step % every == 0:
            held["step"] = step  # as saved: what a kept rank may go on from
        event(
            fd, "step", repr(time.time()), rank, step, checksum(), f"{loss.item():.6f}", repr(saved)
        )
        if copy is None and rank == 0 and mode == "memory" and attempt == 0:
            copy = Copy()
        flag.fill_(1.0 if os.path.exists(stop) else 0.0)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            break
    event(fd, "done", repr(time.time()), rank, step, checksum())
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    if sys.argv[4:] == ["in-place"]:
        import relaunch

        main = relaunch.restart_in_place(main)
    sys.exit(main())
