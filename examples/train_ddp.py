"""Data-parallel training with real torch.distributed, checkpointed every step.

    relaunch --nproc-per-node 4 examples/train_ddp.py --steps 50 --checkpoint-dir /tmp/ckpt

A small model on synthetic data: gloo on CPU, NCCL when GPUs are present. Gradients are
averaged with one all-reduce of a flat buffer in a fixed order, so the sums are bitwise the same
in every run (DDP re-buckets its gradients after its first step, which changes the last bits of
the sums after a resume). Rank 0 saves a
checkpoint after every step, atomically (a temporary file, then ``os.replace``), and every rank
resumes from it when relaunch restarts the group after a failure or a membership change, so the
final weights do not depend on where the job was interrupted. The data of step ``s`` on rank
``r`` is a pure function of ``(seed, s, r)``: the same world size gives the same weights, on one
node or on several.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import relaunch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--checkpoint-dir", default="checkpoints")
    parser.add_argument(
        "--step-time",
        type=float,
        default=0.0,
        help="seconds each step also takes (to watch it, or to interrupt it)",
    )
    parser.add_argument("--out", default="", help="where rank 0 writes the final weights")
    return parser.parse_args()


def batch(
    seed: int, step: int, rank: int, size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    inputs = torch.randn(size, 16, generator=generator)
    truth = torch.arange(16, dtype=torch.float32) / 16
    targets = inputs @ truth + 0.01 * torch.randn(size, generator=generator)
    return inputs.to(device), targets.unsqueeze(1).to(device)


def average_gradients(parameters: list[torch.Tensor], world_size: int) -> None:
    """Data parallelism: every rank ends the step with the mean of all ranks' gradients."""
    grads = [p.grad for p in parameters]
    flat = torch.cat([g.reshape(-1) for g in grads])  # type: ignore[union-attr]
    dist.all_reduce(flat)
    flat /= world_size
    offset = 0
    for grad in grads:
        assert grad is not None
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def save_atomically(obj: object, path: str) -> None:
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)  # a reader sees the old file or the new one, never half


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)).to(device)
    # Before the process group: building an optimizer imports torch._dynamo, which in torch
    # 2.13 binds a group that exists by then into torch.distributed.nn's default arguments,
    # so that destroy_process_group could never free it (its threads would run to the exit).
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    checkpoint = os.path.join(args.checkpoint_dir, "checkpoint.pt")
    start = 0
    if os.path.exists(checkpoint):
        state = torch.load(checkpoint, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        if rank == 0:
            print(f"resuming from step {start} (world size {world_size})", flush=True)
    parameters = list(model.parameters())
    for parameter in parameters:  # every rank starts from rank 0's weights
        dist.broadcast(parameter.data, src=0)

    for step in range(start, args.steps):
        inputs, targets = batch(args.seed, step, rank, args.batch_size, device)
        loss = nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        average_gradients(parameters, world_size)
        optimizer.step()
        if args.step_time:
            time.sleep(args.step_time)
        relaunch.report_progress(step + 1, args.steps, "train")
        if rank == 0:
            save_atomically(
                {
                    "step": step + 1,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                },
                checkpoint,
            )
            print(f"step {step + 1} loss {loss.item():.6f}", flush=True)
        if relaunch.stop_requested():  # a preemption: the checkpoint is saved, leave cleanly
            break
    dist.barrier()
    if rank == 0 and args.out:
        save_atomically(
            {name: tensor.cpu() for name, tensor in model.state_dict().items()}, args.out
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
