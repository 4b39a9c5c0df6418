"""A torch gloo DDP worker for tests/integration/test_state.py: ``state_ddp.py OUT STEPS
KILL_AT [in-place]``. Saves model and optimizer with ``relaunch.save_state`` after every step and
resumes from ``load_state()``; in attempt 0 the last rank SIGKILLs itself after saving step
KILL_AT (-1: never). Writes ``OUT/weights.{rank}``: a digest of the final weights,
``OUT/resumed.{attempt}.{rank}`` and ``OUT/pids.{rank}`` (a line a call). ``in-place``: the
training runs in a ``@relaunch.restart_in_place`` function, and a rank kept across the restart
goes on from the model it holds (``relaunch.resumes_from``; it writes the step to
``OUT/kept.{attempt}.{rank}``) rather than loading it. With ``STATE_DDP_STEP_SECONDS`` set, each
step waits that long and writes ``OUT/step.{rank}`` (the step it begins), and
``OUT/agent.{rank}`` names the agent."""

from __future__ import annotations

import hashlib
import os
import pathlib
import signal
import sys
import time

import torch
import torch.distributed as dist

import relaunch

out, steps, kill_at = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])


def publish(name: str, text: str) -> None:
    """Write OUT/``name`` whole (beside it, then renamed): the test never reads half of it."""
    (out / f".{name}").write_text(text)
    os.replace(out / f".{name}", out / name)


in_place = sys.argv[4:] == ["in-place"]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
# Before the group, which destroy_process_group could otherwise never free (examples/train_ddp.py).
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
held = None  # the step whose state model and optimizer hold (None: none to go on from)


def train() -> None:
    global held
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    world = int(os.environ["WORLD_SIZE"])
    with open(out / f"pids.{rank}", "a") as pids:
        pids.write(f"{os.getpid()}\n")
    dist.init_process_group("gloo")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    start = 0
    if relaunch.resumes_from(held):
        assert held is not None
        start = held + 1
        publish(f"kept.{attempt}.{rank}", str(held))
    else:
        got = relaunch.load_state()
        if got is not None:
            start = got[0] + 1
            model.load_state_dict(got[1]["model"])
            optimizer.load_state_dict(got[1]["optim"])
    publish(f"resumed.{attempt}.{rank}", str(start - 1))
    publish(f"agent.{rank}", str(os.getppid()))
    pause = float(os.environ.get("STATE_DDP_STEP_SECONDS", "0"))
    for step in range(start, steps):
        if pause:
            time.sleep(pause)
            publish(f"step.{rank}", str(step))
        data = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 32, generator=data), torch.randn(16, 1, generator=data)
        loss = ((ddp(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        held = None  # the update below changes what the model holds
        optimizer.step()
        relaunch.save_state({"model": model.state_dict(), "optim": optimizer.state_dict()}, step)
        held = step
        if step == kill_at and attempt == 0 and rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)
    weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    publish(f"weights.{rank}", hashlib.sha256(weights).hexdigest())
    del ddp
    dist.destroy_process_group()


(relaunch.restart_in_place(train) if in_place else train)()
