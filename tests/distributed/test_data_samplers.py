"""DistributedDL over any sampler or batch sampler, in one process with explicit ranks."""

import random

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, Sampler, SubsetRandomSampler, WeightedRandomSampler

from cadence.distributed.data import DistributedDL


class Bucketing(Sampler):
    """Batches of similar lengths: shuffle with Python's `random`, sort chunks by length, cut, shuffle the batches."""

    def __init__(self, lengths, batch_size):
        self.lengths, self.batch_size = lengths, batch_size

    def __iter__(self):
        idxs = list(range(len(self.lengths)))
        random.shuffle(idxs)
        idxs.sort(key=lambda i: self.lengths[i])
        batches = [idxs[i:i + self.batch_size] for i in range(0, len(idxs), self.batch_size)]
        random.shuffle(batches)
        return iter(batches)

    def __len__(self):
        return -(-len(self.lengths) // self.batch_size)


def shards(make, world_size, seed=5):
    return [DistributedDL(make(), rank=r, world_size=world_size, seed=seed) for r in range(world_size)]


def ids(batches):
    return [b.tolist() for b in batches]


def test_weighted_sampler_draw_is_shared_cut_like_a_permutation_and_leaves_global_rng_alone():
    weights = torch.tensor([0.0] * 10 + [1.0] * 30)            # ids 0..9 are never drawn
    make = lambda: DataLoader(torch.arange(40), batch_size=4, sampler=WeightedRandomSampler(weights, 25))
    torch.manual_seed(3)
    before = torch.rand(1)
    torch.manual_seed(3)
    ddls = shards(make, 2)
    outs = [ids(d) for d in ddls]
    assert torch.equal(torch.rand(1), before)                  # drawing the epoch did not touch torch's RNG
    assert [len(o) for o in outs] == [len(d) for d in ddls] == [4, 4]     # 13 per rank: 4, 4, 4, 1
    drawn = sum(outs[0], []) + sum(outs[1], [])
    assert len(drawn) == 26 and all(i >= 10 for i in drawn)    # 25 draws + 1 padding repeat
    real = [i for r, d in enumerate(ddls) for i, keep in zip(sum(outs[r], []), d.real_mask(r, 0, 13)) if keep]
    assert real == ddls[0].order() and len(real) == 25         # both ranks cut one shared draw
    again = shards(make, 2)
    assert [ids(d) for d in again] == outs                     # the same seed and epoch: the same draw
    assert ids(again[0]) != outs[0]                            # the next epoch draws again


def test_subset_sampler_and_random_sampler_with_replacement():
    make = lambda: DataLoader(torch.arange(100), batch_size=5, sampler=SubsetRandomSampler(range(50, 70)))
    got = sorted(i for d in shards(make, 2) for b in d for i in b.tolist())
    assert got == list(range(50, 70))
    ds = torch.arange(8)
    make = lambda: DataLoader(ds, batch_size=3, sampler=RandomSampler(ds, replacement=True, num_samples=12))
    ddls = shards(make, 3)
    assert [len(d) for d in ddls] == [2, 2, 2] and sum(len(b) for d in ddls for b in d) == 12


def test_bucketing_batch_sampler_batches_dealt_in_turn_with_equal_counts():
    lengths = [random.Random(0).randint(1, 50) for _ in range(30)]
    make = lambda: DataLoader(torch.arange(30), batch_sampler=Bucketing(lengths, 4))   # 8 batches: 7 of 4, 1 of 2
    ddls = shards(make, 3)
    outs = [ids(d) for d in ddls]
    assert [len(o) for o in outs] == [len(d) for d in ddls] == [3, 3, 3]  # 8 batches padded to 9
    dealt = [outs[t % 3][t // 3] for t in range(9)]
    assert sorted(i for b in dealt[:8] for i in b) == list(range(30))     # the sampler's batches, each once
    assert dealt[8] == dealt[0]                                           # padding repeats the first batch
    assert all(max(lengths[i] for i in b) - min(lengths[i] for i in b) <= 10 for b in dealt[:8] if len(b) == 4)
    state = ddls[1].state_dict()
    resumed = shards(make, 3)
    for d in resumed:
        d.load_state_dict({**ddls[0].state_dict(), "epoch": 0, "batches_done": 1, "epoch_complete": False})
    assert [ids(d) for d in resumed] == [o[1:] for o in outs]              # mid-epoch: the same batches
    assert state["epoch_complete"]


def test_bucketing_resumed_on_fewer_ranks_keeps_each_step():
    lengths = list(range(40))
    make = lambda: DataLoader(torch.arange(40), batch_sampler=Bucketing(lengths, 5))
    ref = shards(make, 4)
    full = [[b.tolist() for b in step] for step in zip(*ref)]             # 8 batches: 2 steps of 4
    two = shards(make, 2)
    state = {**ref[0].state_dict(), "epoch": 0, "batches_done": 1, "epoch_complete": False}
    with pytest.warns(UserWarning, match="saved with one batch of the batch sampler to each of 4 processes on 2"):
        for d in two:
            d.load_state_dict(state)
    after = [[b.tolist() for b in step] for step in zip(*two)]
    assert len(after) == 1 and [len(b) for b in after[0]] == [10, 10]
    assert sorted(sum(after[0], [])) == sorted(sum(full[1], []))


def test_unbatched_loader_and_a_sampler_with_set_epoch():
    class Epochs(Sampler):
        def __init__(self):
            self.epoch = 0

        def set_epoch(self, epoch):
            self.epoch = epoch

        def __iter__(self):
            return iter([self.epoch, self.epoch + 1, self.epoch + 2])

        def __len__(self):
            return 3

    ddl = DistributedDL(DataLoader(torch.arange(10) * 10, sampler=Epochs(), batch_size=None), rank=0, world_size=1,
                        seed=0)
    ddl.set_epoch(4)
    assert [int(b) for b in ddl] == [40, 50, 60]


def test_gather_for_metrics_drops_a_padding_batch_of_a_batch_sampler():
    from cadence.distributed.ops import gather_for_metrics

    lengths = list(range(30))
    make = lambda: DataLoader(torch.arange(30), batch_sampler=Bucketing(lengths, 4))   # 8 batches: 7 of 4, 1 of 2
    ddls = shards(make, 3)
    kept = [[gather_for_metrics(b, d).tolist() for b in d] for d in ddls]
    assert [len(k) for k in kept] == [3, 3, 3]
    assert kept[2][2] == []                                   # the 9th batch repeats the 1st: padding, dropped
    assert sorted(i for k in kept for b in k for i in b) == list(range(30))


def test_batch_sampler_given_as_sampler_with_batch_size_none_is_dealt_like_a_batch_sampler():
    """Accelerate's pattern: DataLoader(ds, sampler=BatchSampler(...), batch_size=None) fetches dataset[indices]."""
    from torch.utils.data import BatchSampler, SequentialSampler, TensorDataset

    ds = TensorDataset(torch.arange(10) * 10)
    plain = DataLoader(ds, sampler=BatchSampler(SequentialSampler(ds), batch_size=4, drop_last=False), batch_size=None)
    assert [b[0].tolist() for b in plain] == [[0, 10, 20, 30], [40, 50, 60, 70], [80, 90]]
    got = [[b[0].tolist() for b in DistributedDL(plain, rank=r, world_size=2)] for r in range(2)]
    # batches dealt in turn; rank 1's missing last batch is padding (the first batch again)
    assert got == [[[0, 10, 20, 30], [80, 90]], [[40, 50, 60, 70], [0, 10, 20, 30]]]
    make = lambda: DataLoader(ds, sampler=BatchSampler(RandomSampler(ds), batch_size=3, drop_last=True), batch_size=None)
    one, two = shards(make, 1), shards(make, 3)
    seen = [sorted(x for b in dl for x in b[0].tolist()) for dl in two]
    assert all(len(s) == 3 for s in seen)                       # three full batches of 3: one per rank, no padding
    assert sorted(sum(seen, [])) == sorted(x for b in one[0] for x in b[0].tolist())   # the same 9 items as 1 process
