"""Prepared loaders behave as Accelerate 1.15's: DataLoader attributes, skip_first_batches, end_of_dataloader /
remainder, the shuffle order after a `break`, and how a stream is split between processes.

The expected values are what real Accelerate printed for the same script (tests/scripts/accelerate_loaders.py
with `from accelerate import ...`), run as:
  ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 accelerate_loaders.py OUT
"""

import json

import pytest

from helpers import run_launch

ATTRS = {"sampler": "SequentialSampler", "batch_sampler": "BatchSamplerShard", "collate_fn": "function",
         "num_workers": "int", "pin_memory": "bool", "generator": "NoneType", "persistent_workers": "bool",
         "dataset": "list", "batch_size": "int", "drop_last": "bool"}   # Accelerate: batch_size None (see
# PreparedDataLoader: cadence keeps the per-process batch size, which cadence's split_batches scripts read)
# per rank, from the Accelerate run named above
ACCELERATE = [
    {"values": [None, 0, False, False, 8, 2, 2, 0, 2, 4, "RandomSampler"],
     "skip": [[[6, 7, 8], [9]], 1, [[6, 7, 8]], 2, [[0, 1, 2], [6, 7, 8]]],
     "skip_too_many": [[], [[0, 1, 2], [6, 7, 8]]],
     "eod": [False, -1, [[False, 3], [True, 3]], True, 3],
     "shuffle_break": [[[6, 0], [5, 9]], [[7, 0], [10, 8], [4, 6]], [[8, 5], [7, 11], [9, 3]]],
     "stream": {"7/2": [[[0, 1], [4, 5]], [0, 1, 2, 3, 4, 5, 6], 3], "8/2": [[[0, 1], [4, 5]], list(range(8)), 4],
                "7/3": [[[0, 1, 2], [6]], [0, 1, 2, 3, 4, 5, 6], 1], "3/2": [[[0, 1]], [0, 1, 2], 3]}},
    {"values": [None, 0, False, False, 8, 2, 2, 1, 2, 4, "RandomSampler"],
     "skip": [[[6, 7, 8], [9]], 1, [[9, 0, 1]], 2, [[3, 4, 5], [9, 0, 1]]],
     "skip_too_many": [[], [[3, 4, 5], [9, 0, 1]]],
     "eod": [False, -1, [[False, 3], [True, 3]], True, 3],
     "shuffle_break": [[[1, 2], [4, 10]], [[11, 5], [2, 1], [9, 3]], [[10, 1], [4, 2], [6, 0]]],
     "stream": {"7/2": [[[2, 3], [6, 0]], [0, 1, 2, 3, 4, 5, 6], 3], "8/2": [[[2, 3], [6, 7]], list(range(8)), 4],
                "7/3": [[[3, 4, 5], [0]], [0, 1, 2, 3, 4, 5, 6], 1], "3/2": [[[2, 0]], [0, 1, 2], 3]}},
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("loaders_qa")
    run_launch("accelerate_loaders.py", out, timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_prepared_loader_has_accelerates_dataloader_attributes(ranks):
    for r, got in enumerate(ranks):
        assert got["attrs"] == ATTRS
        assert got["values"] == [2, *ACCELERATE[r]["values"][1:]]   # batch_size: Accelerate's None; its shard, ...


def test_skip_first_batches_counts_the_rest_and_takes_plain_loaders(ranks):
    for r, got in enumerate(ranks):
        assert got["skip"] == ACCELERATE[r]["skip"]            # plain loader skipped; len() is what is left
        assert got["skip_too_many"] == ACCELERATE[r]["skip_too_many"]   # past the end: no batches, no error


def test_end_of_dataloader_and_remainder_stay_after_the_loop(ranks):
    for r, got in enumerate(ranks):
        assert got["eod"] == ACCELERATE[r]["eod"]   # (before, remainder before) ... True and 11 % 8 after


def test_shuffle_after_a_break_is_accelerates(ranks):
    for r, got in enumerate(ranks):
        assert got["shuffle_break"] == ACCELERATE[r]["shuffle_break"]


def test_stream_is_split_as_accelerate_and_gathered_in_order(ranks):
    for r, got in enumerate(ranks):
        assert got["stream"] == ACCELERATE[r]["stream"]
