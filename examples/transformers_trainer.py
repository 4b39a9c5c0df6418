"""Hugging Face transformers ``Trainer`` on CPU, resumed from the Trainer's own checkpoint.

    relaunch --nproc-per-node 2 --max-restarts 1 examples/transformers_trainer.py OUTDIR

A tiny Llama, built from a config (nothing is downloaded: the hub is kept offline), learns a
fixed next-token rule from synthetic sequences (seeded, no dropout). The Trainer reads its ranks
from the launcher's environment and trains with DDP over gloo. ``save_strategy="epoch"`` writes
``OUTDIR/checkpoint-<step>/`` after every epoch; when one exists at start-up (relaunch restarted
the group), ``trainer.train(resume_from_checkpoint=...)`` goes on from the latest. Rank 0 writes
the final weights to ``OUTDIR/weights.pt`` and prints their SHA-256, so that two runs can be
compared bit for bit.

``KILL_RANK_AT=R:E`` makes rank R SIGKILL itself at the start of epoch E (counted from 0), on
the first attempt only, once every rank has passed the checkpoint of epoch E-1: a test of the
restart.
"""

import os

# Nothing is downloaded: the hub stays offline, and reports nothing.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import argparse
import gc
import hashlib
import signal

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint

VOCAB = 32


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", help="checkpoints and final weights go here")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args()


class Sequences(Dataset):
    """Sequences that follow ``next = (3 * token + 1) % VOCAB`` from a random first token."""

    def __init__(self, seed, samples, length=16):
        generator = torch.Generator().manual_seed(seed)
        first = torch.randint(0, VOCAB, (samples,), generator=generator)
        tokens = [first]
        for _ in range(length - 1):
            tokens.append((3 * tokens[-1] + 1) % VOCAB)
        self.tokens = torch.stack(tokens, dim=1)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


class KillOnce(TrainerCallback):
    """Rank ``rank`` SIGKILLs itself at the start of epoch ``epoch`` on the first attempt."""

    def __init__(self, rank, epoch):
        self.rank, self.epoch = rank, epoch

    def on_epoch_begin(self, args, state, control, **kwargs):
        if round(state.epoch) != self.epoch:
            return
        dist.barrier()  # every rank has finished writing the previous epoch's checkpoint
        if args.process_index == self.rank:
            print(f"rank {self.rank}: killing myself at epoch {self.epoch}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def weights_digest(state_dict):
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        digest.update(name.encode())
        digest.update(state_dict[name].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def train(args):
    training = TrainingArguments(
        output_dir=args.outdir,
        use_cpu=True,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,
        num_train_epochs=args.epochs,
        per_device_train_batch_size=args.batch_size,
        learning_rate=3e-3,
        save_strategy="epoch",
        logging_strategy="epoch",
        report_to="none",
        seed=args.seed,
        data_seed=args.seed,
    )
    rank, world_size = training.process_index, training.world_size
    print(f"rank {rank}/{world_size} local {training.local_process_index}", flush=True)

    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        attention_dropout=0.0,
    )
    model = LlamaForCausalLM(config)
    callbacks = []
    kill_at = os.environ.get("KILL_RANK_AT")
    if kill_at and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        kill_rank, kill_epoch = map(int, kill_at.split(":"))
        callbacks.append(KillOnce(kill_rank, kill_epoch))
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Sequences(args.seed, args.samples),
        callbacks=callbacks,
    )
    resume = get_last_checkpoint(args.outdir) if os.path.isdir(args.outdir) else None
    if resume and rank == 0:
        print(f"resumed from {resume}", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    if trainer.is_world_process_zero():
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
    load, under torchrun as under relaunch). So the Trainer and its wrapper go first (``train``
    has returned; ``gc`` collects their cycles), and ``destroy_process_group`` drops the last
    handles, which release the GIL while the threads are joined. Left up until interpreter exit,
    the group's threads may abort the rank instead ("terminate called without an active
    exception").
    """
    if not dist.is_initialized():
        return
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    train(parse_args())
    leave_process_group()
