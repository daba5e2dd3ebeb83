"""DistributedDL positions resumed on another number of processes, in one process with explicit ranks."""

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from cadence.distributed.data import DistributedDL


class Ids(torch.utils.data.Dataset):
    """Item i is the sample id i."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def run_steps(ddls, steps):
    """Iterate all ranks in lock step for `steps` global steps; returns each step's ids, rank by rank."""
    its = [iter(d) for d in ddls]
    out = []
    for _ in range(steps):
        out.append([next(it).tolist() for it in its])
    return out


def rest(ddls):
    """Every remaining global step: the ids of each rank's batch."""
    per_rank = [[b.tolist() for b in d] for d in ddls]       # every rank to its end, as in a real run
    assert len({len(p) for p in per_rank}) == 1
    return [list(step) for step in zip(*per_rank)]


def make(n, world_size, bs, seed=11, **kw):
    return [DistributedDL(DataLoader(Ids(n), batch_size=bs, shuffle=True, **kw), rank=r, world_size=world_size,
                          seed=seed) for r in range(world_size)]


@pytest.mark.parametrize("new_ws", [1, 3, 4])
def test_two_to_m_continues_the_same_global_batches(new_ws):
    """100 ids, 2 ranks x 12: 5 steps; stop after 2; on M ranks the 3 remaining steps take the same ids."""
    ref = make(100, 2, 12)
    for d in ref:
        d.set_epoch(3)
    full = rest(ref)                                           # the uninterrupted epoch, 5 steps
    assert len(full) == 5
    run = make(100, 2, 12)
    for d in run:
        d.set_epoch(3)
    seen = run_steps(run, 2)
    state = run[0].state_dict()
    assert state == run[1].state_dict() and state["batches_done"] == 2

    resumed = make(100, new_ws, 12)
    with pytest.warns(UserWarning, match="saved with batch 12 x 2 processes .24 per step. on %d processes" % new_ws):
        for d in resumed:
            d.load_state_dict(state)
    assert all(len(d) == 5 and d.start_batch == 2 for d in resumed)  # steps per epoch unchanged
    after = rest(resumed)
    assert len(after) == 3
    ids = [i for step in seen + after for batch in step for i in batch]
    assert sorted(ids) == list(range(100))                     # each id exactly once in the epoch
    for mine, theirs in zip(after, full[2:]):                  # each step: the same samples as the original run
        assert sorted(sum(mine, [])) == sorted(sum(theirs, []))
    sizes = {len(b) for step in after[:-1] for b in step}
    assert max(sizes) - min(sizes) <= 1 and sum(len(b) for b in after[0]) == 24


def test_resumed_epoch_saved_again_resumes_on_a_third_world_size():
    run = make(100, 2, 12)
    run_steps(run, 1)
    on4 = make(100, 4, 12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for d in on4:
            d.load_state_dict(run[0].state_dict())
    seen = run_steps(on4, 2)                                   # steps 1 and 2 on 4 ranks
    state = on4[2].state_dict()
    assert (state["world_size"], state["batch_size"], state["batches_done"]) == (2, 12, 3)  # the epoch's layout
    on1 = make(100, 1, 12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        on1[0].load_state_dict(state)
    ref = make(100, 2, 12)
    full = rest(ref)
    first = full[0]
    after = rest(on1)
    ids = [i for step in [first] + seen + after for batch in step for i in batch]
    assert sorted(ids) == list(range(100))
    assert [sorted(sum(s, [])) for s in seen + after] == [sorted(sum(s, [])) for s in full[1:]]


def test_next_epoch_uses_the_new_layout_and_padding_is_not_repeated_on_resume():
    """10 ids on 3 ranks x 2: the last rank pads with 2 repeats; resumed on 2 ranks each remaining id comes once."""
    run = make(10, 3, 2)
    seen = run_steps(run, 1)
    on2 = make(10, 2, 2)
    with pytest.warns(UserWarning, match="later epochs use batch 2 x 2 processes"):
        for d in on2:
            d.load_state_dict(run[0].state_dict())
    after = rest(on2)
    assert len(after) == 1 and all(len(b) == 2 for b in after[0])    # step 1 of [2, 2, 0 real] -> 4 ids
    assert sorted(i for s in seen + after for b in s for i in b) == list(range(10))
    nxt = rest(on2)                                                  # epoch 1: this run's own layout
    assert len(nxt) == 3 and sorted(i for s in nxt for b in s for i in b) == list(range(10))


def test_more_ranks_than_a_step_has_samples_pads_and_says_so():
    run = make(5, 1, 4)                                   # steps of 4 and 1
    run_steps(run, 1)
    on3 = make(5, 3, 4)
    with pytest.warns(UserWarning, match="now 1 samples per process"):
        for d in on3:
            d.load_state_dict(run[0].state_dict())
    (step,) = rest(on3)
    assert [len(b) for b in step] == [1, 1, 1]            # every rank takes a batch: 2 are padding copies
    assert [d.real_mask(r, *d.last_batch).tolist() for r, d in enumerate(on3)] == [[True], [False], [False]]


def test_complete_epoch_and_old_dicts():
    run = make(20, 2, 4)
    rest(run)
    state = run[0].state_dict()
    assert state["epoch_complete"] and state["batches_done"] == 3
    on1 = make(20, 1, 4)[0]
    on1.load_state_dict(state)                            # complete: the next epoch, from its start
    assert on1.epoch == 1 and on1.start_batch == 0 and len(list(on1)) == 5
    fresh = make(20, 1, 4)[0]                             # the next epoch named with 0 batches done: its own layout
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.load_state_dict({**state, "epoch": 1, "batches_done": 0, "epoch_complete": False})
    assert fresh.epoch == 1 and len(fresh) == 5
    old = make(20, 2, 4)[1]
    old.load_state_dict({"seed": 11, "epoch": 2, "batches_done": 1})   # a dict from before world_size was saved
    ref = make(20, 2, 4)[1]
    ref.set_epoch(2)
    assert [b.tolist() for b in old] == [b.tolist() for b in ref][1:]


class Stream(IterableDataset):
    def __init__(self, n, sized):
        self.n, self.sized = n, sized

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        if not self.sized:
            raise TypeError("no length")
        return self.n


def test_sized_stream_resumes_after_the_items_consumed_on_another_world_size():
    run = [DistributedDL(DataLoader(Stream(23, True), batch_size=3), rank=r, world_size=2) for r in range(2)]
    seen = run_steps(run, 2)                                  # 12 items consumed
    state = run[0].state_dict()
    assert state["samples_done"] == 12
    on3 = [DistributedDL(DataLoader(Stream(23, True), batch_size=3), rank=r, world_size=3) for r in range(3)]
    with pytest.warns(UserWarning, match="after the 12 items already seen"):
        for d in on3:
            d.load_state_dict(state)
    assert all(len(d) == 4 and d.start_batch == 2 for d in on3)   # steps 2 and 3 of 4: 11 items, 3 x 3
    after = rest(on3)
    assert len(after) == 2 and all(len(d) == 3 for d in on3)      # the next epoch: 23 items, 8 per rank
    shards = [torch.tensor([i for s in after for i in s[r]]) for r in range(3)]
    real = [sh[d.real_mask(r, 0, len(sh))].tolist() for r, (sh, d) in enumerate(zip(shards, on3))]
    ids = [i for s in seen for b in s for i in b] + sum(real, [])
    assert sorted(ids) == list(range(23))                    # padding masked, every item once


def test_stream_without_len_resumes_after_the_items_consumed():
    run = [DistributedDL(DataLoader(Stream(15, False), batch_size=2), rank=r, world_size=2) for r in range(2)]
    seen = run_steps(run, 2)                                  # 2 steps x 2 ranks x 2 items
    state = run[1].state_dict()
    assert (state["samples_done"], state["batches_done"], state["epoch_complete"]) == (8, 2, False)
    assert sorted(i for s in seen for b in s for i in b) == list(range(8))
    on1 = DistributedDL(DataLoader(Stream(15, False), batch_size=2), rank=0, world_size=1)
    with pytest.warns(UserWarning, match="after the 8 items already seen"):
        on1.load_state_dict(state)
    assert [b.tolist() for b in on1] == [[8, 9], [10, 11], [12, 13], [14]]
    assert on1.state_dict()["epoch_complete"] and on1.epoch == 0
    assert [b.tolist() for b in on1][0] == [0, 1] and on1.epoch == 1   # the next epoch from its start


LOADERS = {  # each built afresh, as a script would: the same arguments, a generator seeded the same way
    "shuffle": lambda ds: DataLoader(ds, batch_size=6, shuffle=True),
    "shuffle with a generator": lambda ds: DataLoader(ds, batch_size=6, shuffle=True,
                                                      generator=torch.Generator().manual_seed(1)),
    "weighted sampler": lambda ds: DataLoader(ds, batch_size=6, sampler=torch.utils.data.WeightedRandomSampler(
        torch.linspace(0.1, 1, 20), 15)),
    "bucketing batch sampler": lambda ds: DataLoader(ds, batch_sampler=Bucketing(20)),
    "sequential": lambda ds: DataLoader(ds, batch_size=6),
    "shuffle with worker processes": lambda ds: DataLoader(ds, batch_size=6, shuffle=True, num_workers=2),
}


class Bucketing(torch.utils.data.Sampler):
    """A batch sampler drawing from Python's and numpy's global RNGs."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        import random

        import numpy as np

        idxs = list(np.random.permutation(self.n))
        return iter([[int(i) for i in idxs[j:j + random.choice([3, 4])]] for j in range(0, self.n, 4)])

    def __len__(self):
        return self.n // 4


def epochs(it, n_epochs):
    """Each epoch's batches, and a torch random number drawn after each (what a model's dropout would see)."""
    out = []
    for _ in range(n_epochs):
        out.append([b.tolist() for b in it])
        out.append(torch.rand(3).tolist())
    return out


@pytest.mark.parametrize("name", list(LOADERS))
def test_draw_like_loader_changes_nothing_and_resumes_mid_epoch_exactly(name):
    """What Checkpoint wraps a one-process loader in: same batches, same later random numbers, and a mid-epoch
    resume (state through JSON, torch's RNG restored as a checkpoint does) continues the same order."""
    import json
    import random

    import numpy as np

    def seeded():
        torch.manual_seed(3), random.seed(3), np.random.seed(3)

    seeded()
    plain = epochs(LOADERS[name](Ids(20)), 3)
    seeded()
    wrapped = DistributedDL(LOADERS[name](Ids(20)), rank=0, world_size=1, draw_like_loader=True)
    assert epochs(wrapped, 3) == plain

    seeded()
    first = DistributedDL(LOADERS[name](Ids(20)), rank=0, world_size=1, draw_like_loader=True)
    it = iter(first)
    head = [next(it).tolist() for _ in range(2)]
    state = json.loads(json.dumps(first.state_dict()))
    rng = torch.get_rng_state(), random.getstate(), np.random.get_state()
    torch.manual_seed(99), random.seed(99), np.random.seed(99)       # a new process: other random states
    resumed = DistributedDL(LOADERS[name](Ids(20)), rank=0, world_size=1, draw_like_loader=True)
    resumed.load_state_dict(state)
    torch.set_rng_state(rng[0]), random.setstate(rng[1]), np.random.set_state(rng[2])
    rest = epochs(resumed, 3)
    assert [head + rest[0], *rest[1:4]] == plain[:4]
    if name in ("shuffle with a generator", "sequential"):   # the ranks draw alike: from the sampler's generator, or nothing
        assert DistributedDL(LOADERS[name](Ids(20)), rank=0, world_size=2, draw_like_loader=True).world_size == 2
    else:
        with pytest.raises(ValueError, match="one process"):
            DistributedDL(LOADERS[name](Ids(20)), rank=0, world_size=2, draw_like_loader=True)


def test_a_position_saved_by_a_seeded_wrapper_resumes_with_its_seed():
    """Checkpoints written before draw_like_loader hold a seed: the resumed loader keeps drawing from it."""
    old = DistributedDL(LOADERS["shuffle"](Ids(20)), rank=0, world_size=1, seed=11)
    it = iter(old)
    next(it)
    state = old.state_dict()
    want = [b.tolist() for b in it]
    new = DistributedDL(LOADERS["shuffle"](Ids(20)), rank=0, world_size=1, draw_like_loader=True)
    new.load_state_dict(state)
    assert [b.tolist() for b in new] == want and new.seed == 11


@pytest.mark.parametrize("field, value", [("generators", ["not base64!"]), ("generators", "x"),
                                          ("drawn", {"epoch": "0", "rng": {}}), ("drawn", [1])])
def test_a_damaged_draw_state_is_refused_naming_the_field(field, value):
    first = DistributedDL(LOADERS["shuffle with a generator"](Ids(20)), rank=0, world_size=1, draw_like_loader=True)
    it = iter(first)
    next(it)
    state = {**first.state_dict(), field: value}
    resumed = DistributedDL(LOADERS["shuffle with a generator"](Ids(20)), rank=0, world_size=1, draw_like_loader=True)
    with pytest.raises(ValueError, match=f"position's {field} is not what cadence saved"):
        resumed.load_state_dict(state)
