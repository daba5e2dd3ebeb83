"""fastai 2.8 behaviours: `learn.validation_context`, `dls.train.bs/.shuffle/.n`, and the rows
of the epochs `fit(start_epoch=)` skips.

Expected values are what fastai 2.8.12 gave for the same calls (70 training and 30 validation items, bs 16, so 4
training batches per epoch with the last partial one dropped): each literal names the fastai call it came from.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, TensorDataset

from cadence import (Callback, Checkpoint, DataLoaders, EarlyStoppingCallback, Learner, SaveModelCallback,
                     accuracy)

def _dsets():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, 4, generator=g)
    y = (x[:, 0] > 0).long()
    return TensorDataset(x[:70], y[:70]), TensorDataset(x[70:], y[70:])


def _learner(**kw):
    torch.manual_seed(0)
    learn = Learner(DataLoaders.from_dsets(*_dsets(), bs=16, device="cpu"), nn.Linear(4, 2),
                    loss_func=nn.CrossEntropyLoss(), metrics=accuracy, **kw)
    learn.remove_cb(learn.progress)
    return learn


class Events(Callback):
    """Records the fit-, epoch- and validation-level events it gets."""

    def __init__(self):
        self.seen = []

    def before_fit(self): self.seen.append("before_fit")
    def before_epoch(self): self.seen.append("before_epoch")
    def before_validate(self): self.seen.append("before_validate")
    def after_validate(self): self.seen.append("after_validate")
    def after_epoch(self): self.seen.append("after_epoch")
    def after_fit(self): self.seen.append("after_fit")


_FULL = ["before_fit", "before_epoch", "before_validate", "after_validate", "after_epoch", "after_fit"]
_INNER = ["before_validate", "after_validate"]


# ---------------------------------------------------------------- validation_context
def test_validation_context_gives_its_callbacks_fastai_events_and_detaches_them():
    learn = _learner()
    learn.fit(1, 1e-2)
    values = list(learn.recorder.values)
    cb = Events()
    with learn.validation_context(cbs=[cb]) as entered:
        assert entered is None                                      # fastai's ContextManagers gives None
        assert cb in learn.cbs and not learn.log_epochs and not learn.create_mbar
        learn._do_epoch_validate()
    assert cb.seen == _FULL                                         # fastai: with learn.validation_context(cbs=[cb])
    assert cb not in learn.cbs and learn.log_epochs and learn.create_mbar and learn.dl is None
    assert learn.recorder.values == values                          # cadence keeps the history (fastai's is reset)


def test_validation_context_inner_fires_the_pass_alone_and_keeps_the_fit_state():
    learn = _learner()
    seen = {}

    class Inner(Callback):
        def after_batch(self):
            if self.training and self.iter == 1 and not seen:
                cb = Events()
                dl, training = self.learn.dl, self.learn.training
                with self.learn.validation_context(cbs=cb, inner=True):
                    self.learn._do_epoch_validate(dl=self.learn.dls.valid)
                seen.update(events=cb.seen, dl=self.learn.dl is dl, training=self.learn.training == training,
                            model=self.learn.model.training)

    learn.fit(1, 1e-2, cbs=Inner())
    assert seen == {"events": _INNER, "dl": True, "training": True, "model": True}   # fastai: inner=True
    assert len(learn.recorder.values) == 1 and len(learn.recorder.losses) == 4


def test_validate_and_get_preds_run_their_callbacks_in_the_validation_context():
    learn = _learner()
    on_validate, on_preds, on_inner = Events(), Events(), Events()
    learn.validate(cbs=on_validate)
    preds, targs = learn.get_preds(cbs=on_preds)
    learn.get_preds(cbs=on_inner, inner=True)
    assert on_validate.seen == on_preds.seen == _FULL and on_inner.seen == _INNER   # fastai 2.8.12, same calls
    assert preds.shape == (30, 2) and learn.cbs == [learn.recorder]


def test_validation_context_ends_its_callbacks_fit_when_the_block_raises():
    learn = _learner()
    cb = Events()
    with pytest.raises(KeyError, match="x"):
        with learn.validation_context(cbs=cb):
            raise KeyError("x")
    assert cb.seen == ["before_fit", "before_epoch", "after_epoch", "after_fit"] and cb not in learn.cbs


def test_validation_context_names_the_callback_that_failed():
    learn = _learner()
    with pytest.raises(RuntimeError) as err:
        with learn.validation_context(cbs=Callback(before_fit=lambda cb: (_ for _ in ()).throw(RuntimeError("no")))):
            pass
    assert "(raised in callback Callback during event before_fit)" in err.value.__notes__


# ---------------------------------------------------------------- dls.train.bs / .shuffle / .n
def test_loaders_have_fastai_bs_shuffle_and_n():
    dls = DataLoaders.from_dsets(*_dsets(), bs=16)
    assert (dls.train.bs, dls.train.shuffle, dls.train.n) == (16, True, 70)   # fastai: DataLoaders.from_dsets(bs=16)
    assert (dls.valid.bs, dls.valid.shuffle, dls.valid.n) == (16, False, 30)
    assert type(dls.train) is DataLoader and len(dls.train) == 4              # still torch's loader


def test_torch_loaders_given_to_dataloaders_get_them_too():
    tr, va = _dsets()
    train, valid = DataLoader(tr, batch_size=8, shuffle=True), DataLoader(va, batch_size=5)
    dls = DataLoaders(train, valid, device="cpu")
    assert dls.train is train and dls.valid is valid
    assert (train.bs, train.shuffle, train.n, valid.bs, valid.shuffle, valid.n) == (8, True, 70, 5, False, 30)
    by_batches = DataLoader(tr, batch_sampler=BatchSampler(RandomSampler(tr), 10, drop_last=False))
    assert (DataLoaders(by_batches).train.bs, by_batches.shuffle, by_batches.n) == (10, True, 70)

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(6))

    stream = DataLoaders(DataLoader(Stream(), batch_size=3)).train
    assert (stream.bs, stream.shuffle, stream.n) == (3, False, None)
    batches = DataLoaders([(torch.ones(2, 4), torch.zeros(2))])
    assert batches.bs is None and not hasattr(batches.train, "bs")


def test_loader_swapped_in_during_fit_and_get_preds_loader_have_them(tmp_path):
    """A one-process Checkpoint swaps in a resumable DistributedDL; get_preds reads an in-order copy."""
    seen = []

    class Read(Callback):
        def before_train(self):
            seen.append(("train", self.dls.train.bs, self.dls.train.shuffle, self.dls.train.n))

        def before_validate(self):
            seen.append(("valid", self.dl.bs, self.dl.shuffle, self.dl.n))

    learn = _learner(path=tmp_path)
    learn.fit(1, 1e-2, cbs=[Read(), Checkpoint(dir=tmp_path / "ckpt", every_n_steps=100)])
    learn.get_preds(ds_idx=0, cbs=Read())
    assert type(learn.dls.train) is DataLoader
    assert seen == [("train", 16, True, 70), ("valid", 16, False, 30), ("valid", 16, False, 70)]


# ---------------------------------------------------------------- fit(start_epoch=)
def test_start_epoch_records_fastai_empty_rows_for_the_skipped_epochs():
    learn = _learner()
    learn.fit_one_cycle(4, 1e-2, start_epoch=2)
    values = learn.recorder.values
    assert values[:2] == [[], []] and len(values) == 4                        # fastai: [[], [], [...], [...]]
    assert [len(r) for r in values] == [0, 0, 3, 3] and [r["epoch"] for r in values] == [0, 1, 2, 3]
    assert learn.recorder.iters == [0, 0, 4, 8] and len(learn.recorder.lrs) == len(learn.recorder.losses) == 8
    assert learn.final_record is values[-1] and learn.recorder.lrs[0] == pytest.approx(0.0075, rel=1e-4)  # fastai's


def test_start_epoch_works_with_the_monitors_fastai_breaks(tmp_path):
    """fastai 2.8.12 raises IndexError in SaveModelCallback / EarlyStoppingCallback.after_epoch on the empty row."""
    learn = _learner(path=tmp_path)
    learn.fit_one_cycle(3, 1e-2, start_epoch=1, cbs=[SaveModelCallback(), EarlyStoppingCallback(patience=5)])
    assert learn.recorder.values[0] == [] and len(learn.recorder.values) == 3
    assert (tmp_path / "models" / "model").is_dir()
