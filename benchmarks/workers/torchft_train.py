"""A torchft training program for the replicas benchmark and the replica-group tests:
python torchft_train.py [--steps N] [--pace S] [--kill-group G --kill-step K].

One replica group's worker of torchft 0.2.0's data-parallel training (its ``train_ddp.py``
pattern, on CPU): a small ``nn.Linear`` model in torchft's ``DistributedDataParallel``, SGD in
its ``Optimizer`` wrapper, a ``Manager`` over a ``ProcessGroupGloo`` with ``min_replica_size=1``
and ``replica_id`` from ``REPLICA_GROUP_ID``, so that a failed group heals from a live one (the
model and the optimizer are its state dict). It reads what a launcher gives a worker:
``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``, ``TORCHFT_LIGHTHOUSE``, ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` (torchft's Manager connects to the store there) and
``TORCHELASTIC_RESTART_COUNT``.

It trains until ``manager.current_step()`` reaches ``--steps`` at a step every group took part
in (``NUM_REPLICA_GROUPS`` participants: a group that finished while another was still
restarting would leave it to start over alone), or ``10 * --steps``; it sleeps ``--pace``
seconds a step (the compute of a real step). Every line goes to stdout, flushed, as
``KIND key=value ...``:

- ``ft-start group=G rank=R attempt=A time=T pid=P``: first thing;
- ``ft-step group=G rank=R step=S time=T participants=P``: after every ``optimizer.step()``
  (S is ``manager.current_step()``, P ``manager.num_participants()``, T ``time.time()``);
- ``ft-kill group=G rank=R step=S time=T``: just before it SIGKILLs itself, which it does in
  group ``--kill-group`` (rank ``--kill-rank``) at step ``--kill-step``, on its first attempt
  only (a restarted worker heals past that step);
- ``ft-done group=G rank=R step=S sha256=H``: the end; H digests the model's weights. Every
  group ends at the same step (the quorum's participants are the same for all) with the same
  weights (they all-reduce the same gradients, and a healed group loads a live group's).

Each group trains on its own batches (seeded by group and step), as a data-parallel replica does.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time
from datetime import timedelta

import torch
from torch import nn
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="train until this step")
    parser.add_argument("--pace", type=float, default=0.05, help="seconds of 'compute' a step")
    parser.add_argument("--kill-group", type=int, default=-1, help="the group that dies")
    parser.add_argument("--kill-rank", type=int, default=0, help="its rank that dies")
    parser.add_argument("--kill-step", type=int, default=-1, help="at this step")
    parser.add_argument("--width", type=int, default=64, help="the Linear's in/out features")
    return parser.parse_args(argv)


def say(kind: str, **fields: object) -> None:
    """One line on stdout in one write: the groups' workers share the launcher's stdout, and a
    line written in pieces (print's, unbuffered) can be cut by another group's."""
    line = " ".join([kind, *(f"{key}={value}" for key, value in fields.items())])
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def digest(model: nn.Module) -> str:
    """sha256 of the model's parameters, in their order."""
    sha = hashlib.sha256()
    for tensor in model.state_dict().values():
        sha.update(tensor.detach().contiguous().numpy().tobytes())
    return sha.hexdigest()


def main(argv: list[str]) -> int:
    opts = parse(argv)
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    groups = int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    now = repr(time.time())
    say("ft-start", group=group, rank=rank, attempt=attempt, time=now, pid=os.getpid())
    torch.manual_seed(0)
    module = nn.Linear(opts.width, opts.width)

    def state_dict() -> dict[str, object]:
        return {"model": module.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict[str, object]) -> None:
        module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"torchft_train_{group}",
        timeout=timedelta(seconds=30),
    )
    model = DistributedDataParallel(manager, module)
    optimizer = Optimizer(manager, torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9))
    kills = group == opts.kill_group and rank == opts.kill_rank and attempt == 0
    try:
        while manager.current_step() < opts.steps * 10:
            batch = torch.Generator().manual_seed(group * 1_000_003 + manager.current_step())
            inputs = torch.randn(16, opts.width, generator=batch)
            optimizer.zero_grad()
            loss = (model(inputs) - inputs).pow(2).mean()
            loss.backward()
            time.sleep(opts.pace)
            optimizer.step()
            step = manager.current_step()
            say(
                "ft-step",
                group=group,
                rank=rank,
                step=step,
                time=repr(time.time()),
                participants=manager.num_participants(),
            )
            if kills and step >= opts.kill_step:
                say("ft-kill", group=group, rank=rank, step=step, time=repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            if step >= opts.steps and manager.num_participants() >= groups:
                break
        say("ft-done", group=group, rank=rank, step=manager.current_step(), sha256=digest(module))
    finally:
        manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
