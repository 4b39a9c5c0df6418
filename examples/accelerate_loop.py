"""Hugging Face accelerate on CPU: a plain training loop, resumed with ``load_state``.

    relaunch --nproc-per-node 2 --max-restarts 1 examples/accelerate_loop.py OUTDIR

``Accelerator(cpu=True)`` reads its ranks from the launcher's environment and wraps a few
linear layers in DDP over gloo; its data loader shards and shuffles synthetic data (seeded, no
dropout).
``accelerator.save_state`` writes the model, optimizer, RNG states and the epoch counter after
every epoch, first to a temporary folder that the main process renames to
``OUTDIR/checkpoints/epoch_<n>`` once every rank is done, so a half-written checkpoint is never
taken for the latest. When one exists at start-up (relaunch restarted the group),
``accelerator.load_state`` goes on from the latest. Rank 0 writes the final weights to
``OUTDIR/weights.pt`` and prints their SHA-256, so that two runs can be compared bit for bit.

``KILL_RANK_AT=R:E`` makes rank R SIGKILL itself at the start of epoch E (counted from 0), on
the first attempt only, once every rank has passed the checkpoint of epoch E-1: a test of the
restart.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import argparse
import gc
import hashlib
import signal

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm.auto import tqdm


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", help="checkpoints and final weights go here")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args()


def synthetic_data(seed, samples):
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, 8, generator=generator)
    targets = inputs @ torch.linspace(-1, 1, 8).unsqueeze(1)
    return TensorDataset(inputs, targets + 0.01 * torch.randn(samples, 1, generator=generator))


class Progress:
    """The epochs done: saved and restored with the rest of the state."""

    def __init__(self):
        self.epochs_done = 0

    def state_dict(self):
        return {"epochs_done": self.epochs_done}

    def load_state_dict(self, state):
        self.epochs_done = state["epochs_done"]


def latest_checkpoint(checkpoints):
    if not os.path.isdir(checkpoints):
        return None
    names = os.listdir(checkpoints)
    epochs = [int(name[6:]) for name in names if name[:6] == "epoch_" and name[6:].isdigit()]
    return os.path.join(checkpoints, f"epoch_{max(epochs)}") if epochs else None


def weights_digest(state_dict):
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        digest.update(name.encode())
        digest.update(state_dict[name].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main():
    args = parse_args()
    set_seed(args.seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    # Before the accelerator makes the process group: building an optimizer imports
    # torch._dynamo, which in torch 2.13 would otherwise hold that group for good (see
    # examples/train_ddp.py).
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # cpu=True: without it, on a machine with no GPU, accelerate ignores the launcher's ranks
    # and every worker trains alone as "rank 0 of 1".
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)
    )
    rank, world_size = accelerator.process_index, accelerator.num_processes
    print(f"rank {rank}/{world_size} local {accelerator.local_process_index}", flush=True)
    data = DataLoader(synthetic_data(args.seed, args.samples), args.batch_size, shuffle=True)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    checkpoints = os.path.join(args.outdir, "checkpoints")
    resume = latest_checkpoint(checkpoints)
    if resume:
        accelerator.load_state(resume)
        if accelerator.is_main_process:
            print(f"resumed from {resume}", flush=True)
    kill_rank = kill_epoch = None
    if os.environ.get("KILL_RANK_AT") and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        kill_rank, kill_epoch = map(int, os.environ["KILL_RANK_AT"].split(":"))

    for epoch in range(progress.epochs_done, args.epochs):
        if epoch == kill_epoch:
            accelerator.wait_for_everyone()  # every rank has finished the previous checkpoint
            if rank == kill_rank:
                print(f"rank {rank}: killing myself at epoch {epoch}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        data.set_epoch(epoch)
        model.train()
        total = torch.zeros(())
        for inputs, targets in tqdm(data, disable=not accelerator.is_main_process):
            loss = nn.functional.mse_loss(model(inputs), targets)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            total += loss.detach()
        mean_loss = accelerator.reduce(total, reduction="mean") / len(data)
        if accelerator.is_main_process:
            print(f"epoch {epoch} loss {mean_loss.item():.6f}", flush=True)

        progress.epochs_done = epoch + 1
        final = os.path.join(checkpoints, f"epoch_{epoch + 1}")
        accelerator.save_state(final + ".tmp")
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            os.replace(final + ".tmp", final)
        accelerator.wait_for_everyone()

    if accelerator.is_main_process:
        state = accelerator.unwrap_model(model).state_dict()
        torch.save(state, os.path.join(args.outdir, "weights.pt"))
        print(f"final weights sha256 {weights_digest(state)}", flush=True)
        print("finished", flush=True)
    # The DDP wrapper goes before the process group: freed after it, it would be the group's
    # last holder, and the group's destructor can deadlock with a gloo thread that waits for
    # the GIL (tests/hostile/test_gloo_exit.py). The accelerator holds it too.
    del model, optimizer, data
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()


if __name__ == "__main__":
    main()
