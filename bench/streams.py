"""What agreeing on the end of an epoch costs: a DistributedDL over a stream with and without __len__.

Run on 2 processes: `cadence launch --cpu --num_processes 2 bench/streams.py [--work N]`.
Prints the time per batch (best of 3 epochs) of iterating 2000 batches of 16 per rank; a stream
without __len__ adds one all-gather of one int per batch. `--work N` does N small matmuls per
batch, as a training step would.
"""

import argparse
import time

import torch
from torch.utils.data import DataLoader, IterableDataset

from cadence.distributed import DistributedDL, setup_distrib, teardown_distrib
from cadence.distributed.env import rank


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


class SizedStream(Stream):
    def __len__(self):
        return self.n


def time_per_batch(ddl, work):
    a = torch.randn(160, 160)
    best = float("inf")
    for _ in range(3):
        t, n = time.perf_counter(), 0
        for _ in ddl:
            for _ in range(work):
                torch.mm(a, a)
            n += 1
        best = min(best, (time.perf_counter() - t) / n)
    return n, best


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--work", type=int, default=0)
    args = p.parse_args()
    setup_distrib()
    try:
        for name, ds in (("with __len__", SizedStream(64000)), ("without __len__", Stream(64000))):
            n, t = time_per_batch(DistributedDL(DataLoader(ds, batch_size=16)), args.work)
            if rank() == 0:
                print(f"{name:16s} {n} batches/rank  {t * 1e6:7.0f} us/batch", flush=True)
    finally:
        teardown_distrib()


if __name__ == "__main__":
    main()
