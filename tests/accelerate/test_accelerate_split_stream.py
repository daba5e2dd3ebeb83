"""`split_batches=True` with an IterableDataset: each process takes its part of every global batch, as Accelerate
1.15 does (its IterableDatasetShard); `prepare` used to fail on the stream (torch refuses a sampler for it).

Expected: what real Accelerate printed for the same script (`from accelerate import Accelerator`), on 1 process
and under `ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2`: rank 0 the first half of each
global batch, rank 1 the second, the last step completed from the start of the stream; gathered, every item once.
"""

import json

import pytest

from helpers import run_launch

ACCELERATE = {1: [[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12]]],
              2: [[[0, 1], [4, 5], [8, 9], [12]], [[2, 3], [6, 7], [10, 11], [0]]]}


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_stream_is_split_per_global_batch_as_accelerate_splits_it(nproc):
    out = run_launch("accelerate_split_stream.py", nproc=nproc, timeout=180).stdout
    ranks = {int(line.split()[1]): json.loads(line.split(" ", 2)[2]) for line in out.splitlines()
             if line.startswith("RANK ")}
    assert [ranks[r]["batches"] for r in range(nproc)] == ACCELERATE[nproc]
    assert all(ranks[r]["gathered"] == list(range(13)) for r in range(nproc))
