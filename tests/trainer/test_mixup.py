"""MixUp and CutMix on one process, against fastai's definitions (2 and 3 processes: test_fastai_ddp.py)."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import Callback, DataLoaders, Learner, Order
from cadence.callbacks.mixup import CutMix, MixUp


class See(Callback):
    """After the mixing callback: the original batch (kept by a callback before it), the mixed one, the loss."""

    order = Order.DEFAULT + 1

    def before_fit(self):
        self.rows = []

    def after_loss(self):
        if self.training:
            cb = getattr(self.learn, "mix_up", None) or self.learn.cut_mix
            self.rows.append((self.learn.keep.kept_x, self.learn.keep.kept_y, self.learn.xb[0], self.learn.pred.detach(),
                              self.learn.loss.item(), cb.partner.clone(), cb.lam.clone()))


class Keep(Callback):
    order = Order.DEFAULT - 1

    def before_batch(self):
        self.kept_x, self.kept_y = self.learn.xb[0].clone(), self.learn.yb[0].clone()


def learner(x, y, cb, targets_float=False):
    torch.manual_seed(0)
    ds = TensorDataset(x, y)
    dls = DataLoaders(DataLoader(ds, batch_size=8, shuffle=True), DataLoader(ds, batch_size=8), device="cpu")
    model = nn.Sequential(nn.Flatten(), nn.Linear(x[0].numel(), 3))
    learn = Learner(dls, model, loss_func=nn.MSELoss() if targets_float else nn.CrossEntropyLoss(),
                    cbs=[Keep(), See(), cb])
    learn.remove_cb(learn.progress)
    return learn


def test_mixup_blends_inputs_and_mixes_class_losses_as_fastai():
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    learn = learner(x, y, MixUp(0.4))
    loss_func = learn.loss_func
    learn.fit(2)
    assert learn.loss_func is loss_func                                    # given back after training
    assert len(learn.see.rows) == 8
    for x0, y0, mixed, pred, loss, partner, lam in learn.see.rows:
        assert sorted(partner.tolist()) == list(range(8)) and bool(((lam >= 0.5) & (lam <= 1)).all())
        assert torch.allclose(mixed, torch.lerp(x0[partner], x0, lam[:, None]))
        ce = nn.functional.cross_entropy
        want = torch.lerp(ce(pred, y0[partner], reduction="none"), ce(pred, y0, reduction="none"), lam).mean()
        assert loss == pytest.approx(want.item(), rel=1e-6)
    assert len({tuple(r[6].tolist()) for r in learn.see.rows}) == 8       # a new draw every batch


def test_mixup_blends_float_targets():
    x, y = torch.randn(16, 6), torch.randn(16, 3)
    learn = learner(x, y, MixUp(0.4), targets_float=True)
    learn.fit(1)
    for x0, y0, mixed, pred, loss, partner, lam in learn.see.rows:
        mixed_y = torch.lerp(y0[partner], y0, lam[:, None])
        assert loss == pytest.approx(nn.functional.mse_loss(pred, mixed_y).item(), rel=1e-6)


def test_cutmix_pastes_a_box_of_the_partner_and_weights_by_its_area():
    x, y = torch.randn(16, 2, 8, 8), torch.randint(0, 3, (16,))
    learn = learner(x, y, CutMix(1.0))
    learn.fit(2)
    boxes = 0
    for x0, y0, mixed, pred, loss, partner, lam in learn.see.rows:
        from_partner = (mixed != x0).any(1)                                # (batch, H, W): pixels taken over
        own = (mixed == x0).all(1)
        assert bool((own | from_partner).all())
        pasted = (mixed == x0[partner]).all(1) & ~own
        assert torch.equal(pasted | (from_partner & ~pasted), from_partner)
        area = from_partner.any(0).float().mean().item()
        boxes += area > 0
        assert lam[0].item() == pytest.approx(1 - area, abs=1 / 64 + 1e-6) or area == 0
    assert boxes > 0
    with pytest.raises(ValueError, match="image batches"):
        learner(torch.randn(16, 6), y, CutMix()).fit(1)
    with pytest.raises(ValueError, match="alpha"):
        MixUp(0)


def test_mixup_resumed_from_a_mid_epoch_checkpoint_ends_equal(tmp_path):
    """MixUp's generators are saved with the checkpoint: the resumed run mixes as the uninterrupted one did."""
    from cadence.callbacks.checkpoint import Checkpoint

    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))

    def run(name, resume=None):
        learn = learner(x, y, MixUp(0.4))
        learn.path = tmp_path / name
        torch.manual_seed(1)
        learn.fit(3, cbs=Checkpoint(every_n_steps=3), resume=resume)
        return {k: v.clone() for k, v in learn.model.state_dict().items()}

    full = run("full")
    resumed = run("resumed", resume=tmp_path / "full" / "checkpoints" / "step-00000006")
    assert all(torch.equal(full[k], resumed[k]) for k in full)
