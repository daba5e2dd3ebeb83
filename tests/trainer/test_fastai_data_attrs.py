"""fastai's `dls.train.bs = 8`: the next pass over the loader has batches of 8 (torch fixes a loader's batch size, so
DataLoaders rebuilds it with the same data set, sampler and settings), or a clear error where it cannot be; the same
on a DistributedDL (`dls.train` under distrib_ctx), whose `bs` is the per-process batch size, as fastai's.

Expected values are what fastai 2.8.12 gave for the same calls (70 training and 30 validation items,
`DataLoaders.from_dsets(bs=16)`, then `dls.train.bs = 8; dls.valid.bs = 7`).
"""

import pickle
import textwrap

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler, SequentialSampler, TensorDataset

from cadence import Callback, DataLoaders, DistributedDL, Learner
from helpers import run_launch


def _dsets():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, 4, generator=g)
    y = (x[:, 0] > 0).long()
    return TensorDataset(x[:70], y[:70]), TensorDataset(x[70:], y[70:])


class BatchSizes(Callback):
    """The number of items in each batch the model gets, training and validation apart."""

    def before_fit(self):
        self.train, self.valid = [], []

    def before_batch(self):
        (self.train if self.training else self.valid).append(len(self.xb[0]))


def _fit(dls):
    torch.manual_seed(0)
    sizes = BatchSizes()
    learn = Learner(dls, nn.Linear(4, 2), loss_func=nn.CrossEntropyLoss(), cbs=sizes)
    with learn.no_bar():
        learn.fit(1, 1e-2)
    return sizes


def test_setting_bs_changes_the_batches_the_model_gets_next():
    dls = DataLoaders.from_dsets(*_dsets(), bs=16, device="cpu")
    assert _fit(dls).train == [16] * 4
    dls.train.bs, dls.valid.bs = 8, 7
    assert (dls.bs, dls.train.bs, len(dls.train), len(dls.valid)) == (8, 8, 8, 5)   # fastai: 8 8 8 5
    sizes = _fit(dls)
    assert sizes.train == [8] * 8 and sizes.valid == [7, 7, 7, 7, 2]                 # fastai's batches, shapes
    assert dls.train.shuffle and not dls.valid.shuffle and dls.train.drop_last       # fastai: shuffle, drop_last


def test_the_rebuilt_loader_keeps_sampler_collate_fn_workers_and_generator():
    train, _ = _dsets()
    gen = torch.Generator().manual_seed(3)

    def collate(items):   # marks its batches: the model sees inputs + 100
        x, y = torch.utils.data.default_collate(items)
        return x + 100, y

    dl = DataLoader(train, batch_size=16, shuffle=True, generator=gen, collate_fn=collate, num_workers=1, timeout=30,
                    persistent_workers=True, drop_last=True)
    dls = DataLoaders(dl, device="cpu")
    dls.train.bs = 10
    new = dls.train
    assert new is not dl and type(new) is DataLoader and new.sampler is dl.sampler            # the same RandomSampler
    assert (new.batch_size, new.num_workers, new.timeout, new.persistent_workers, new.collate_fn, new.generator,
            new.drop_last) == (10, 1, 30, True, collate, gen, True)
    xb, _ = next(iter(new))
    assert xb.shape == (10, 4) and bool((xb > 50).all())
    assert dl.bs == 16            # the loader left behind says its own batch size again


def test_a_plain_batch_sampler_is_rebuilt_and_a_custom_one_is_refused_saying_what_to_do():
    train, _ = _dsets()
    by_batches = DataLoader(train, batch_sampler=BatchSampler(RandomSampler(train), 10, drop_last=False))
    dls = DataLoaders(by_batches, device="cpu")
    dls.train.bs = 35
    assert [len(b[0]) for b in dls.train] == [35, 35] and dls.train.shuffle

    class Pairs(Sampler):
        def __iter__(self):
            return iter([[0, 1], [2, 3]])

        def __len__(self):
            return 2

    own = DataLoader(train, batch_sampler=Pairs())
    dls = DataLoaders(own, device="cpu")
    dls.train.bs = 8
    with pytest.raises(ValueError, match=r"dls.train.bs = 8: .*batch_sampler, a Pairs, which sets their size; give "
                                         r"that sampler the new size"):
        dls.train
    assert dls.train is own and dls.train.bs is None     # the error said it once; the loader is as it was


def test_a_loader_that_cannot_be_rebuilt_or_a_bad_size_is_refused_naming_it():
    train, _ = _dsets()

    class MyLoader(DataLoader):
        pass

    dls = DataLoaders(MyLoader(train, batch_size=16), device="cpu")
    dls.train.bs = 8
    with pytest.raises(TypeError, match=r"dls.train.bs = 8: .*a MyLoader, not a torch DataLoader; build a new "
                                        r"DataLoader with batch_size=8 and use it in its place"):
        dls.train
    dls = DataLoaders.from_dsets(*_dsets(), bs=16, device="cpu")
    for bad in (0, "8", 2.5):
        dls.valid.bs = bad
        with pytest.raises(ValueError, match=rf"dls.valid.bs must be a positive int .*, got {bad!r}"):
            dls.valid
        assert dls.valid.bs == 16


def test_a_users_own_n_and_a_list_of_batches_are_left_alone():
    train, _ = _dsets()
    dl = DataLoader(train, batch_size=16)
    dl.n = 100
    dls = DataLoaders(dl, device="cpu")
    dls.train.bs = 5
    assert (dls.train.bs, dls.train.n, len(dls.train)) == (5, 100, 14)   # the rebuilt loader keeps the user's n
    batches = DataLoaders([(torch.ones(2, 4), torch.zeros(2))], device="cpu")
    with pytest.raises(AttributeError, match="'list' object has no attribute 'bs'"):
        batches.train.bs = 8


def test_a_loader_handed_back_or_pickled_still_takes_a_new_bs():
    """As after distrib_ctx (DataLoaders gets back the loader it tagged before) and after fastai's `torch.save(dls)`:
    the loader's `bs` is still cadence's to honour."""
    dls = DataLoaders.from_dsets(*_dsets(), bs=16, device="cpu")
    first = dls.train
    dls.train = [(torch.ones(2, 4), torch.zeros(2, dtype=torch.long))]
    dls.train = first
    dls.train.bs = 8
    assert _fit(dls).train == [8] * 8
    restored = pickle.loads(pickle.dumps(dls))
    restored.train.bs = 10
    assert _fit(restored).train == [10] * 7


# ---------------------------------------------------------------- DistributedDL (dls.train under distrib_ctx)
def _ddls(bs=4, n=20):
    return [DistributedDL(DataLoader(torch.arange(n), batch_size=bs), rank=r, world_size=2) for r in range(2)]


def test_distributed_dl_bs_is_per_process_and_setting_it_rebatches_every_rank():
    ddls = _ddls()
    assert [d.bs for d in ddls] == [4, 4] and [d.n for d in ddls] == [20, 20] and len(ddls[0]) == 3
    for d in ddls:
        d.bs = 3
    assert [d.bs for d in ddls] == [3, 3] and len(ddls[0]) == 4
    assert [b.tolist() for b in ddls[0]] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert [b.tolist() for b in ddls[1]] == [[10, 11, 12], [13, 14, 15], [16, 17, 18], [19]]


def test_distributed_dl_bs_set_during_an_epoch_applies_from_the_next():
    ddl = _ddls()[0]
    it = iter(ddl)
    assert next(it).tolist() == [0, 1, 2, 3]
    ddl.bs = 5
    assert [b.tolist() for b in it] == [[4, 5, 6, 7], [8, 9]] and ddl.bs == 5   # the epoch under way keeps its own
    assert [b.tolist() for b in ddl] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    with pytest.raises(ValueError, match=r"DistributedDL.bs must be a positive int .*, got -1"):
        ddl.bs = -1


@pytest.mark.slow
def test_ddp_dls_bs_is_per_process_and_a_new_bs_reaches_every_process(tmp_path):
    script = tmp_path / "bs_ddp.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        from torch.utils.data import TensorDataset
        from cadence import Callback, DataLoaders, DistributedDL, Learner
        from cadence.distributed.env import rank

        class Sizes(Callback):
            def before_fit(self): self.seen = []
            def before_batch(self):
                if self.training: self.seen.append(len(self.xb[0]))

        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0)); y = (x[:, 0] > 0).long()
        dls = DataLoaders.from_dsets(TensorDataset(x, y), TensorDataset(x[:20], y[:20]), bs=16, device="cpu")
        sizes = Sizes()
        learn = Learner(dls, nn.Linear(4, 2), loss_func=nn.CrossEntropyLoss(), cbs=sizes)
        with learn.no_bar(), learn.distrib_ctx():
            assert isinstance(learn.dls.train, DistributedDL)
            print(f"RANK {rank()} bs {learn.dls.bs} {learn.dls.train.bs}", flush=True)
            learn.fit(1, 1e-2)
            print(f"RANK {rank()} fit1 {sizes.seen}", flush=True)
            learn.dls.train.bs = 8
            learn.fit(1, 1e-2)
            print(f"RANK {rank()} fit2 {sizes.seen}", flush=True)
        print(f"RANK {rank()} after {learn.dls.train.bs} {type(learn.dls.train).__name__}", flush=True)
    """))
    out = run_launch(script, nproc=2, timeout=300).stdout
    for r in range(2):   # fastai under DDP: dls.bs and dls.train.bs are the per-process 16, not 32
        assert f"RANK {r} bs 16 16" in out
        assert f"RANK {r} fit1 [16, 16]" in out                  # 64 items: 32 a process, 2 batches of 16
        assert f"RANK {r} fit2 [8, 8, 8, 8]" in out              # then 4 batches of 8
        assert f"RANK {r} after 8 DataLoader" in out             # and the loader handed back keeps it, as fastai's
