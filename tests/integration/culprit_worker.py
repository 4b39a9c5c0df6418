"""A job with one rank stuck where the others wait, for the culprit verdict.

``python culprit_worker.py KIND CULPRIT``: the rank ``CULPRIT`` is stuck in ``load_next_batch``
while the others wait: in a gloo collective (KIND ``all_reduce``, ``barrier``, ``broadcast``:
torch's), or on a socket (KIND ``socket``: plain Python, no torch). Every rank says it is ready,
then the job falls silent: ``--hang-timeout`` finds it.
"""

import os
import socket
import sys
import threading
import time

STARTED = threading.Event()


def load_next_batch():
    while True:  # a data loader that never yields
        time.sleep(0.01)


def starting():
    """Say so while torch loads (seconds, on a loaded machine): only the wait is silent."""
    while not STARTED.wait(0.5):
        print("starting", flush=True)


def ready(rank):
    STARTED.set()
    print("ready", rank, flush=True)


def wait_in_torch(kind, rank):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    tensor = torch.ones(4)
    dist.barrier()
    ready(rank)
    if kind == "all_reduce":
        dist.all_reduce(tensor)
    elif kind == "barrier":
        dist.barrier()
    else:
        dist.broadcast(tensor, src=int(sys.argv[2]))


def wait_on_socket(rank):
    # a helper thread beside the main one, as a real worker has: the verdict reads the main one
    threading.Thread(target=threading.Event().wait, daemon=True).start()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    ready(rank)
    listener.accept()  # a peer that never connects


def main():
    kind, culprit = sys.argv[1], int(sys.argv[2])
    rank = int(os.environ["RANK"])
    threading.Thread(target=starting, daemon=True).start()
    if rank == culprit:
        if kind != "socket":
            import torch.distributed as dist

            dist.init_process_group("gloo")
            dist.barrier()
        ready(rank)
        load_next_batch()
    elif kind == "socket":
        wait_on_socket(rank)
    else:
        wait_in_torch(kind, rank)


if __name__ == "__main__":
    main()
