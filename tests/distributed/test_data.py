"""DistributedDL in one process, with explicit rank and world size."""

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from cadence.distributed import DistributedDL, send_to_device
from cadence.distributed.ops import gather_for_metrics


def shards(dl_fn, world_size, **kw):
    return [DistributedDL(dl_fn(), rank=r, world_size=world_size, **kw) for r in range(world_size)]


def flat(ddl):
    return torch.cat([b if isinstance(b, torch.Tensor) else b[0] for b in ddl]).tolist()


def test_fastai_example():
    for i, ddl in enumerate(shards(lambda: DataLoader(torch.arange(50), batch_size=12), 4)):
        batches = list(ddl)
        assert len(ddl) == len(batches) == 2
        torch.testing.assert_close(batches[0], torch.arange(i * 13, i * 13 + 12) % 50)
        torch.testing.assert_close(batches[1], torch.tensor([i * 13 + 12]) % 50)
    assert (ddl.dataset_len, ddl.per_rank, ddl.n_padded) == (50, 13, 52)


@pytest.mark.parametrize("n,ws,bs", [(10, 3, 4), (7, 2, 3), (3, 4, 2), (1, 2, 5), (16, 4, 4)])
def test_uneven_sizes_cover_dataset_with_equal_batch_counts(n, ws, bs):
    ddls = shards(lambda: DataLoader(torch.arange(n), batch_size=bs), ws)
    outs = [flat(d) for d in ddls]
    assert len({len(d) for d in ddls}) == 1 and all(len(list(d)) == len(d) for d in ddls)
    assert all(len(o) == -(-n // ws) for o in outs)
    joined = sum(outs, [])
    assert joined[:n] == list(range(n))                          # contiguous chunks, in order
    assert joined[n:] == [i % n for i in range(len(joined) - n)]  # padding wraps to the start


def test_gather_for_metrics_single_process_drops_padding():
    ddl = DistributedDL(DataLoader(torch.arange(50), batch_size=12), rank=3, world_size=4)
    per_batch = [gather_for_metrics(b * 10, ddl) for b in ddl]
    assert torch.cat(per_batch).tolist() == [i * 10 for i in range(39, 50)]
    assert gather_for_metrics(torch.cat(list(ddl)), ddl).tolist() == list(range(39, 50))
    assert gather_for_metrics(torch.arange(5), 3).tolist() == [0, 1, 2]
    with pytest.raises(TypeError, match="DistributedDL or a number"):
        gather_for_metrics(torch.arange(5), "3")


def test_shuffle_same_permutation_on_every_rank_new_each_epoch():
    dl_fn = lambda: DataLoader(torch.arange(23), batch_size=4, shuffle=True)
    ddls = shards(dl_fn, 3, seed=7)
    epochs = [[flat(d) for d in ddls] for _ in range(3)]          # auto-advance per __iter__
    orders = [sum(e, [])[:23] for e in epochs]
    assert all(sorted(o) == list(range(23)) for o in orders)
    assert orders[0] != orders[1] != orders[2]
    assert all(d.epoch == 2 for d in ddls)
    for d in ddls:
        d.set_epoch(1)
    assert sum([flat(d) for d in ddls], [])[:23] == orders[1]    # deterministic from (seed, epoch)
    assert orders[0] == ddls[0].order(0) == ddls[0].sample_order(0).tolist()


def test_shuffle_seed_drawn_from_torch_rng():
    torch.manual_seed(0)
    a = DistributedDL(DataLoader(range(8), batch_size=2, shuffle=True), rank=0, world_size=2)
    torch.manual_seed(0)
    b = DistributedDL(DataLoader(range(8), batch_size=2, shuffle=True), rank=1, world_size=2)
    assert a.seed == b.seed and a.shuffle and not DistributedDL(DataLoader(range(8)), rank=0, world_size=1).shuffle


def test_sample_order_and_batch_idxs_map_rows_to_dataset():
    ds = torch.arange(11) * 100
    ddls = shards(lambda: DataLoader(ds, batch_size=2, shuffle=True), 2, seed=3)
    rows = torch.cat([gather_for_metrics(torch.cat(list(d)), d) for d in ddls])
    order = ddls[0].sample_order()
    assert len(rows) == 11 and torch.equal(rows, ds[order])
    in_order = torch.empty_like(rows)
    in_order[order] = rows
    assert torch.equal(in_order, ds)
    for b in ddls[1]:
        assert torch.equal(b, ds[ddls[1].last_batch_idxs()])


def test_keeps_collate_fn_and_drop_last_and_moves_to_device():
    collate = lambda items: {"x": torch.stack(items), "n": len(items)}
    dl = DataLoader(torch.arange(10.), batch_size=3, collate_fn=collate, drop_last=True)
    ddl = DistributedDL(dl, rank=1, world_size=2, device="cpu")
    batches = list(ddl)
    assert len(ddl) == len(batches) == 1
    assert batches[0]["n"] == 3 and batches[0]["x"].tolist() == [5., 6., 7.]
    moved = send_to_device({"a": [torch.ones(1)], "b": (torch.zeros(1), "s")}, "meta")
    assert moved["a"][0].is_meta and moved["b"][0].is_meta and moved["b"][1] == "s"


def test_keeps_workers_and_pin_memory():
    dl = DataLoader(torch.arange(20), batch_size=3, num_workers=2, pin_memory=False)
    ddl = DistributedDL(dl, rank=0, world_size=2)
    assert ddl._loader.num_workers == 2 and ddl._loader.pin_memory is False
    assert flat(ddl) == list(range(10))


def test_refuses_bad_rank_and_non_loaders():
    ds = torch.arange(10)
    with pytest.raises(ValueError, match="rank must be"):
        DistributedDL(DataLoader(ds), rank=2, world_size=2)
    with pytest.raises(TypeError, match="DataLoader"):
        DistributedDL(ds, rank=0, world_size=2)


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        return self.n


class Unsized(IterableDataset):
    def __iter__(self):
        return iter(range(5))


@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_dataset_split_by_rank(workers):
    ddls = shards(lambda: DataLoader(Stream(11), batch_size=2, num_workers=workers), 3)
    outs = [flat(d) for d in ddls]
    assert outs == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 0]]   # rank 2 padded with item 0
    assert [len(d) for d in ddls] == [2, 2, 2]
    rows = torch.cat([gather_for_metrics(torch.tensor(o), d) for o, d in zip(outs, ddls)])
    assert torch.equal(rows, ddls[0].sample_order()) and sorted(rows.tolist()) == list(range(11))


def test_iterable_dataset_without_len_one_process_yields_every_item():
    ddl = DistributedDL(DataLoader(Unsized(), batch_size=2), rank=0, world_size=1)
    assert flat(ddl) == [0, 1, 2, 3, 4] and ddl.last_batch == (4, 1)
    with pytest.raises(TypeError, match="no length"):
        len(ddl)
    ddl.set_epoch(0)
    ddl.skip_batches(1)
    assert flat(ddl) == [2, 3, 4]


def test_skip_batches_resumes_mid_epoch_without_loading_skipped_items():
    loaded = []

    class Logged(torch.utils.data.Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            loaded.append(i)
            return i

    ddl = DistributedDL(DataLoader(Logged(), batch_size=3, shuffle=True), rank=1, world_size=2, seed=5)
    ddl.set_epoch(4)
    full = [b.tolist() for b in ddl]
    ddl.set_epoch(4)
    ddl.skip_batches(2)
    loaded.clear()
    assert [b.tolist() for b in ddl] == full[2:]
    assert sorted(loaded) == sorted(sum(full[2:], []))
    assert ddl.start_batch == 0 and len(list(ddl)) == len(ddl)   # one-shot
    with pytest.raises(ValueError, match="skip between"):
        ddl.skip_batches(len(ddl) + 1)


def test_skip_batches_iterable():
    ddl = DistributedDL(DataLoader(Stream(12), batch_size=2), rank=0, world_size=2)
    ddl.skip_batches(2)
    assert flat(ddl) == [8, 10]


def test_state_dict_resumes_mid_epoch_with_the_same_permutation():
    make = lambda: DistributedDL(DataLoader(torch.arange(40), batch_size=3, shuffle=True), rank=1, world_size=2)
    ddl = make()
    list(ddl)                                         # epoch 0
    it = iter(ddl)                                    # epoch 1, stop after 2 batches
    seen = [next(it).tolist() for _ in range(2)]
    state = ddl.state_dict()
    assert state == {"seed": ddl.seed, "epoch": 1, "batches_done": 2, "epoch_complete": False,
                     "world_size": 2, "batch_size": 3}
    rest = [b.tolist() for b in it]
    resumed = make()
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == rest and resumed.get_idxs() == ddl.get_idxs()
    resumed.set_epoch(1)
    assert seen + rest == [b.tolist() for b in resumed]


def test_iterable_dataset_without_len_with_workers_keeps_order():
    class Long(IterableDataset):
        def __iter__(self):
            return iter(range(11))

    ddl = DistributedDL(DataLoader(Long(), batch_size=2, num_workers=2), rank=0, world_size=1)
    assert flat(ddl) == list(range(11)) and ddl.state_dict()["epoch_complete"]
    assert flat(ddl) == list(range(11)) and ddl.epoch == 1
