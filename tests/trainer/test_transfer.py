"""Transfer learning: freeze / freeze_to / unfreeze, BatchNorm of frozen groups, BnFreeze, fine_tune, under DDP and FSDP2."""

import copy
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from cadence import BnFreeze, Callback, DataLoaders, Learner, accuracy

from helpers import REPO, run_launch


def bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def three_groups(m):
    return [list(m[:2].parameters()), list(m[3].parameters()), list(m[5].parameters())]


def learner(dls, **kw):
    return Learner(dls, bn_model(), loss_func=nn.CrossEntropyLoss(), splitter=three_groups, lr=1e-2, **kw)


def fit_and_compare(learn, cbs=None):
    """{name: changed?} for every parameter and BatchNorm buffer over one epoch."""
    before = copy.deepcopy(learn.model.state_dict())
    with learn.no_bar():
        learn.fit(1, cbs=cbs)
    return {k: not torch.equal(v, learn.model.state_dict()[k]) for k, v in before.items() if k != "1.num_batches_tracked"}


def test_freeze_trains_the_last_group_and_batchnorm(dls):
    learn = learner(dls)
    learn.freeze()
    assert [p.requires_grad for p in learn.model.parameters()] == [False, False, True, True, False, False, True, True]
    changed = fit_and_compare(learn)
    assert changed == {"0.weight": False, "0.bias": False, "1.weight": True, "1.bias": True, "1.running_mean": True,
                       "1.running_var": True, "3.weight": False, "3.bias": False, "5.weight": True, "5.bias": True}


def test_freeze_to_and_unfreeze(dls):
    learn = learner(dls)
    learn.freeze_to(1)
    assert [p.requires_grad for p in learn.model.parameters()] == [False, False, True, True, True, True, True, True]
    learn.freeze_to(-1)
    assert learn.frozen_idx == 2
    learn.unfreeze()
    assert all(p.requires_grad for p in learn.model.parameters())
    assert all(fit_and_compare(learn).values())


def test_train_bn_false_freezes_batchnorm_and_bn_freeze_keeps_its_statistics(dls):
    learn = learner(dls, train_bn=False)
    learn.freeze()
    changed = fit_and_compare(learn)
    assert not changed["1.weight"] and not changed["1.bias"]
    assert changed["1.running_mean"]                       # still in train mode: statistics move
    changed = fit_and_compare(learn, cbs=BnFreeze())
    assert not any(v for k, v in changed.items() if k.startswith(("0.", "1.", "3."))) and changed["5.weight"]


@pytest.mark.parametrize("n", [3, -4, 1.5, "1"])
def test_freeze_to_refuses_what_would_freeze_everything(dls, n):
    with pytest.raises(ValueError, match=r"3 parameter group\(s\), so n must be an int in \[-3, 2\]"):
        learner(dls).freeze_to(n)


def test_freeze_without_a_splitter_says_how_to_get_groups(dls, model):
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss())
    with pytest.warns(UserWarning, match="one parameter group, so nothing is frozen; pass Learner\\(splitter=...\\)"):
        learn.freeze()
    assert all(p.requires_grad for p in model.parameters())


def test_fine_tune_uses_fastais_rates_and_freezing(dls):
    seen = []

    class AtFit(Callback):
        def before_fit(self):
            seen.append(([g["lr"] for g in self.opt.param_groups], [p.requires_grad for p in self.model[0].parameters()]))

    learn = learner(dls, cbs=AtFit())
    with learn.no_bar():
        learn.fine_tune(2, base_lr=0.02, lr_mult=100)
    assert seen[0][1] == [False, False] and seen[1][1] == [True, True]
    assert seen[0][0] == pytest.approx([0.002, 0.002, 0.02])           # slice(base_lr): body at base_lr / 10
    assert seen[1][0] == pytest.approx([0.0001, 0.001, 0.01])          # base_lr / 2 / lr_mult ... base_lr / 2
    assert learn.epoch == 1 and len(learn.recorder.values) == 2


class Crash(Exception):
    pass


class CrashAt(Callback):
    """Raise at training batch `batch` of epoch `epoch` of the `nth` fit (counting from 0): a run killed there."""

    def __init__(self, nth, epoch, batch):
        self.nth, self.epoch_at, self.batch_at, self.fits = nth, epoch, batch, -1

    def before_fit(self):
        self.fits += 1

    def after_batch(self):
        if self.training and (self.fits, self.epoch, self.iter) == (self.nth, self.epoch_at, self.batch_at):
            raise Crash()


@pytest.mark.parametrize("nth, epoch, batch", [(0, 0, 2), (1, 0, 1), (1, 1, 3)], ids=["frozen", "unfrozen", "later"])
def test_fine_tune_killed_anywhere_resumes_in_the_part_it_was_in_and_ends_as_an_uninterrupted_run(
        dls, tmp_path, nth, epoch, batch):
    from cadence.callbacks.checkpoint import Checkpoint

    def run(*cbs, resume=None):
        learn = learner(dls, cbs=[Checkpoint(tmp_path / "ckpt", every_n_steps=1, keep_last=2), *cbs])
        with learn.no_bar():
            learn.fine_tune(2, base_lr=0.02, freeze_epochs=1, resume=resume)
        return learn

    reference = learner(dls)
    with reference.no_bar():
        reference.fine_tune(2, base_lr=0.02, freeze_epochs=1)
    with pytest.raises(Crash):
        run(CrashAt(nth, epoch, batch))
    parts = []
    resumed = run(Callback(before_fit=lambda cb: parts.append((cb.epoch, cb.n_epoch, cb.opt.param_groups[0]["lr"]))),
                  resume="auto")
    # the part the run was killed in continues where it stopped; no part runs again or is skipped
    starts = {(0, 0, 2): [(0, 1), (0, 2)], (1, 0, 1): [(0, 2)], (1, 1, 3): [(1, 2)]}[(nth, epoch, batch)]
    assert [p[:2] for p in parts] == starts
    assert [r["epoch"] for r in resumed.recorder.values] == [0, 1]    # the last part's epochs, as the reference's
    assert [r["train_loss"] for r in resumed.recorder.values] == [r["train_loss"] for r in reference.recorder.values]
    assert all(torch.equal(a, b) for a, b in zip(reference.model.state_dict().values(),
                                                  resumed.model.state_dict().values()))


def digits_split():
    sys.path.insert(0, str(REPO / "examples"))
    from train_digits import get_dsets, get_model

    train, valid = get_dsets()
    return get_model, train.tensors, valid.tensors


@pytest.mark.slow
def test_fine_tune_beats_plain_fit_from_the_same_pretrained_weights():
    """Pretrain the digits CNN on digits 0-4, then learn 5-9 from 64 images with a new head, at a rate too high for
    the pretrained body: fine_tune keeps the body's rate 200 times lower (plain fit: 0.36 vs fine_tune 0.79 here;
    other seeds gave 0.60 vs 0.80 and 0.53 vs 0.81)."""
    get_model, (x, y), (xv, yv) = digits_split()
    torch.manual_seed(0)
    pretrained = get_model()
    old = y < 5
    pre = Learner(DataLoaders.from_dsets(TensorDataset(x[old], y[old]), bs=64, device="cpu"), pretrained,
                  loss_func=nn.CrossEntropyLoss())
    with pre.no_bar():
        pre.fit_one_cycle(2, 1e-2)
    new = torch.nonzero(~old).squeeze(1)[:64]

    def transfer(how):
        torch.manual_seed(1)
        model = copy.deepcopy(pretrained)
        model[-1].reset_parameters()
        dls = DataLoaders.from_dsets(TensorDataset(x[new], y[new]), TensorDataset(xv[yv >= 5], yv[yv >= 5]), bs=8,
                                     device="cpu", generator=torch.Generator().manual_seed(1))
        learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=accuracy,
                        splitter=lambda m: [list(m[:-1].parameters()), list(m[-1].parameters())])
        with learn.no_bar():
            how(learn)
        return learn.validate()["accuracy"]

    tuned = transfer(lambda learn: learn.fine_tune(3, base_lr=0.3))
    plain = transfer(lambda learn: learn.fit(4, lr=0.3))
    assert tuned > plain + 0.1, (tuned, plain)


@pytest.mark.slow
def test_freezing_under_ddp_and_fsdp_equals_a_single_process_loop():
    out = run_launch("transfer_ddp.py", "ddp", "fsdp").stdout
    for check in ("ddp_frozen_body_unchanged", "ddp_equals_single_process_loop", "fsdp_frozen_body_unchanged",
                  "fsdp_equals_single_process_loop"):
        assert f"CHECK {check} ok" in out, out


def test_each_freeze_and_unfreeze_starts_the_optimizer_state_afresh_as_fastais(dls):
    """fastai's freeze_to clears the optimizer's state: after a fit and unfreeze(), Adam's moments and step counts
    start again (the first step after it is a first step: step == 1 for every parameter)."""
    learn = learner(dls)
    learn.freeze()
    learn.fit(1)
    assert learn.opt.state
    learn.unfreeze()
    assert not learn.opt.state
    learn.fit(1)
    steps = {float(s["step"]) for s in learn.opt.state.values()}
    assert steps == {float(len(dls.train))}


def test_train_bn_keeps_layernorm_and_instancenorm_of_frozen_groups_training_as_fastais_norm_types(dls):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3))
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(),
                    splitter=lambda m: [list(m[:2].parameters()), list(m[3].parameters())])
    learn.freeze()
    assert [p.requires_grad for p in model.parameters()] == [False, False, True, True, True, True]
    learn.train_bn = False
    learn.freeze()
    assert [p.requires_grad for p in model.parameters()] == [False, False, False, False, True, True]
