"""PyTorch Lightning data-parallel training on CPU, resumed from Lightning's own checkpoint.

    relaunch --nproc-per-node 2 --max-restarts 1 examples/lightning_ddp.py OUTDIR

A few linear layers learn a fixed linear map from synthetic data (seeded, no dropout), with
``Trainer(strategy="ddp", devices=2, accelerator="cpu")``: Lightning sees that it runs under an
elastic launcher (``TORCHELASTIC_RUN_ID``) and takes its ranks from the environment instead of
starting processes itself. ``ModelCheckpoint(save_last=True)`` writes ``OUTDIR/checkpoints/
last.ckpt`` after every epoch; when that file exists at start-up (relaunch restarted the group),
training resumes from it. Rank 0 writes the final weights to ``OUTDIR/weights.pt`` and prints
their SHA-256, so that two runs can be compared bit for bit.

``KILL_RANK_AT=R:E`` makes rank R SIGKILL itself at the start of epoch E (counted from 0), on
the first attempt only, once every rank has passed the checkpoint of epoch E-1: a test of the
restart.
"""

import argparse
import gc
import hashlib
import os
import signal

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, TQDMProgressBar
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


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


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = nn.functional.mse_loss(self.net(inputs), targets)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class KillOnce(Callback):
    """Rank ``rank`` SIGKILLs itself at the start of epoch ``epoch`` on the first attempt."""

    def __init__(self, rank, epoch):
        self.rank, self.epoch = rank, epoch

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch != self.epoch:
            return
        dist.barrier()  # every rank has finished writing the previous epoch's checkpoint
        if trainer.global_rank == self.rank:
            print(f"rank {self.rank}: killing myself at epoch {self.epoch}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class PrintEpochs(Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            loss = trainer.callback_metrics["loss"].item()
            print(f"epoch {trainer.current_epoch} loss {loss:.6f}", flush=True)


def weights_digest(state_dict):
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        digest.update(name.encode())
        digest.update(state_dict[name].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def train(args):
    L.seed_everything(args.seed, verbose=False)
    checkpoints = os.path.join(args.outdir, "checkpoints")
    callbacks = [
        ModelCheckpoint(dirpath=checkpoints, save_last=True),
        TQDMProgressBar(),  # the classic bar, whether or not rich is installed
        PrintEpochs(),
    ]
    kill_at = os.environ.get("KILL_RANK_AT")
    if kill_at and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        rank, epoch = map(int, kill_at.split(":"))
        callbacks.append(KillOnce(rank, epoch))
    trainer = L.Trainer(
        strategy="ddp",
        devices=2,
        accelerator="cpu",
        max_epochs=args.epochs,
        callbacks=callbacks,
        logger=False,
        enable_model_summary=False,
        deterministic=True,
    )
    print(f"rank {trainer.global_rank}/{trainer.world_size} local {trainer.local_rank}", flush=True)
    last = os.path.join(checkpoints, "last.ckpt")
    resume = last if os.path.exists(last) else None
    if resume and trainer.is_global_zero:
        print(f"resumed from {resume}", flush=True)
    data = DataLoader(
        synthetic_data(args.seed, args.samples), batch_size=args.batch_size, shuffle=True
    )
    model = Regressor()
    trainer.fit(model, train_dataloaders=data, ckpt_path=resume)
    if trainer.is_global_zero:
        state = model.state_dict()
        torch.save(state, os.path.join(args.outdir, "weights.pt"))
        print(f"final weights sha256 {weights_digest(state)}", flush=True)
        print("finished", flush=True)


def leave_process_group():
    """Destroy the gloo group once nothing but torch's own handles hold it.

    The DDP wrapper's ``Reducer`` holds the group too, and a ``Reducer`` is freed holding the
    GIL: were it the group's last holder (the wrapper freed after ``destroy_process_group``), the
    group's destructor would join gloo's threads holding the GIL while one of them waits for the
    GIL to free the tensors of the last collective, and the rank would never exit (seen under
    load, under torchrun as under relaunch). So Lightning's Trainer and its wrapper go first
    (``train`` has returned; ``gc`` collects their cycles), and ``destroy_process_group`` drops
    the last handles, which release the GIL while the threads are joined. Left up until
    interpreter exit, the group's threads may abort the rank instead ("terminate called without
    an active exception").
    """
    if not dist.is_initialized():
        return
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    train(parse_args())
    leave_process_group()
