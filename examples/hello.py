"""A tiny job: each worker says who it is, does a little work, and reports its share."""

import os
import time


def main() -> None:
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    print(f"hello from rank {rank} of {world_size} (pid {os.getpid()})")
    started = time.perf_counter()
    total = sum(i * i for i in range(rank, 2_000_000, world_size))
    print(f"rank {rank}: my share of the sum of squares is {total}")
    print(f"rank {rank}: done in {time.perf_counter() - started:.2f}s")


if __name__ == "__main__":
    main()
