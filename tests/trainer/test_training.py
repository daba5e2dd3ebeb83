"""Training results: equality with a hand-written loop, metrics over the whole set, save/load, inference."""

import functools

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader

from cadence import AccumMetric, DataLoaders, Learner, accuracy, error_rate, rmse, top_k_accuracy


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def test_fit_with_sgd_equals_hand_written_loop(dsets):
    train, valid = dsets

    def loader():
        return DataLoader(train, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(1))

    ref, ref_loader = make_model(), loader()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        for xb, yb in ref_loader:
            loss = nn.functional.cross_entropy(ref(xb), yb)
            loss.backward()
            opt.step()
            opt.zero_grad()

    dls = DataLoaders(loader(), DataLoader(valid, batch_size=16), device="cpu")
    learn = Learner(dls, make_model(), loss_func=nn.CrossEntropyLoss(), opt_func=torch.optim.SGD, lr=0.1)
    with learn.no_bar():
        learn.fit(3)
    for a, b in zip(ref.parameters(), learn.model.parameters()):
        assert torch.equal(a, b)
    assert learn.step == 3 * 4


def test_metrics_equal_direct_computation_over_the_whole_set(dsets):
    train, valid = dsets
    # batch of 20 over 32 items: unequal batches, so averaging per-batch values would differ
    dls = DataLoaders(DataLoader(train, batch_size=16), DataLoader(valid, batch_size=20), device="cpu")

    def macro_recall(p, t):
        cls = p.argmax(1)
        return torch.stack([(cls[t == c] == c).float().mean() for c in t.unique()]).mean()

    learn = Learner(dls, make_model(), loss_func=nn.CrossEntropyLoss(),
                    metrics=[accuracy, error_rate, functools.partial(top_k_accuracy, k=2), AccumMetric(macro_recall, "recall")])
    with learn.no_bar():
        learn.fit(1, lr=1e-2)
    res = learn.validate()
    x, y = valid.tensors
    with torch.no_grad():
        out = learn.model(x)
    assert res["accuracy"] == pytest.approx((out.argmax(1) == y).float().mean().item(), abs=1e-12)
    assert res["error_rate"] == pytest.approx(1 - res["accuracy"], abs=1e-12)
    top2 = out.topk(2, dim=1).indices
    assert res["top_k_accuracy"] == pytest.approx((top2 == y[:, None]).any(1).float().mean().item(), abs=1e-12)
    assert res["recall"] == pytest.approx(macro_recall(out, y).item(), abs=1e-6)
    assert res["valid_loss"] == pytest.approx(nn.functional.cross_entropy(out, y).item(), rel=1e-6)
    assert learn.recorder.values[-1]["accuracy"] == pytest.approx(res["accuracy"])


def test_rmse_over_the_whole_set():
    x = torch.randn(50, 4)
    y = x.sum(1, keepdim=True)
    ds = torch.utils.data.TensorDataset(x, y)
    dls = DataLoaders(DataLoader(ds, batch_size=16), DataLoader(ds, batch_size=16), device="cpu")
    learn = Learner(dls, nn.Linear(4, 1), loss_func=nn.MSELoss(), metrics=rmse)
    res = learn.validate()
    with torch.no_grad():
        direct = ((learn.model(x) - y) ** 2).mean().sqrt().item()
    assert res["rmse"] == pytest.approx(direct, rel=1e-6)


def test_save_load_round_trip(dls, tmp_path):
    learn = Learner(dls, make_model(), loss_func=nn.CrossEntropyLoss(), path=tmp_path)
    with learn.no_bar():
        learn.fit(1)
    saved = learn.save("stage1")
    assert saved == tmp_path / "models" / "stage1"
    assert sorted(p.name for p in saved.iterdir()) == ["model.safetensors", "optimizer.pt"]
    weights = load_file(str(saved / "model.safetensors"))
    assert set(weights) == set(learn.model.state_dict())
    for k, v in learn.model.state_dict().items():
        assert torch.equal(weights[k], v)
    saved_state = learn.opt.state_dict()

    fresh = Learner(dls, nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), loss_func=nn.CrossEntropyLoss(),
                    path=tmp_path)
    fresh.load("stage1")
    for a, b in zip(learn.model.parameters(), fresh.model.parameters()):
        assert torch.equal(a, b)
    loaded = fresh.opt.state_dict()
    for i, st in saved_state["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(loaded["state"][i][k]), torch.as_tensor(v))
    assert loaded["param_groups"][0]["lr"] == saved_state["param_groups"][0]["lr"]


def test_save_handles_tied_weights(dls, tmp_path):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(8, 8, bias=False)
            self.dec = nn.Linear(8, 8, bias=False)
            self.dec.weight = self.enc.weight
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.dec(self.enc(x)))

    learn = Learner(dls, Tied(), loss_func=nn.CrossEntropyLoss(), path=tmp_path)
    learn.save("tied")
    other = Learner(dls, Tied(), loss_func=nn.CrossEntropyLoss(), path=tmp_path).load("tied")
    assert torch.equal(other.model.enc.weight, learn.model.enc.weight)
    assert other.model.dec.weight is other.model.enc.weight


def test_load_of_another_architecture_fails_before_touching_the_model(dls, tmp_path):
    learn = Learner(dls, make_model(), loss_func=nn.CrossEntropyLoss(), path=tmp_path)
    learn.save("m")
    other_model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3), nn.Linear(3, 3))
    before = {k: v.clone() for k, v in other_model.state_dict().items()}
    other = Learner(dls, other_model, loss_func=nn.CrossEntropyLoss(), path=tmp_path)
    with pytest.raises(ValueError) as info:
        other.load("m")
    msg = str(info.value)
    assert "missing keys: 3.bias, 3.weight" in msg and "0.weight: (16, 8)" in msg
    assert all(torch.equal(before[k], v) for k, v in other_model.state_dict().items())


def test_load_missing_name_lists_what_exists(dls, tmp_path):
    learn = Learner(dls, make_model(), loss_func=nn.CrossEntropyLoss(), path=tmp_path)
    learn.save("exists")
    with pytest.raises(FileNotFoundError, match="exists"):
        learn.load("nope")


def test_get_preds_with_input_loss_and_act(dls, dsets):
    _, valid = dsets
    learn = Learner(dls, make_model(), loss_func=nn.CrossEntropyLoss())
    inps, preds, targs, losses = learn.get_preds(with_input=True, with_loss=True,
                                                 act=functools.partial(torch.softmax, dim=1))
    x, y = valid.tensors
    with torch.no_grad():
        out = learn.model(x)
    assert torch.equal(inps, x) and torch.equal(targs, y)
    assert torch.allclose(preds, out.softmax(1))
    assert torch.allclose(losses, nn.functional.cross_entropy(out, y, reduction="none"))
    assert learn.loss_func.reduction == "mean"


def test_predict_one_item(dls, dsets):
    _, valid = dsets
    learn = Learner(dls, make_model(), loss_func=nn.CrossEntropyLoss())
    x = valid.tensors[0][3]
    with torch.no_grad():
        want = learn.model(x[None])[0]
    assert torch.allclose(learn.predict(x), want)


@pytest.mark.parametrize("on_accelerator", [False, True])
def test_recorder_records_fastais_smoothed_loss(dsets, monkeypatch, on_accelerator):
    """fastai's Recorder: `losses` is the debiased moving average (beta 0.98) of the batch losses, carried over
    the whole fit, and `train_loss` its value at the end of each epoch. On an accelerator the Recorder keeps
    losses as tensors (no device sync per batch); no GPU here, so that path is forced."""
    from cadence import Callback, Order
    from cadence.trainer.recorder import Recorder

    if on_accelerator:
        monkeypatch.setattr(Recorder, "_on_cpu", lambda self: False)

    class Seen(Callback):
        def before_fit(self):
            self.raw = []

        def after_batch(self):
            if self.training:
                self.raw.append(self.loss.item())

    train, valid = dsets
    dls = DataLoaders(DataLoader(train, batch_size=24), DataLoader(valid, batch_size=16), device="cpu")
    learn = Learner(dls, make_model(), loss_func=nn.CrossEntropyLoss(), cbs=Seen())
    assert torch.equal(learn.loss, torch.tensor(0.0))   # fastai's learn.loss before any batch
    seen_smooth = []
    after_recorder = Callback(after_batch=lambda cb: seen_smooth.append(float(cb.learn.smooth_loss)))
    after_recorder.order = Order.REPORT
    with learn.no_bar():
        learn.fit(2, cbs=after_recorder)
    raw, val, expected = learn.seen.raw, 0.0, []
    for i, loss in enumerate(raw, 1):  # fastai's AvgSmoothLoss, written out
        val = 0.98 * val + 0.02 * loss
        expected.append(val / (1 - 0.98 ** i))
    assert len(raw) == 6 and learn.recorder.losses == pytest.approx(expected, rel=1e-6)
    assert [r["train_loss"] for r in learn.recorder.values] == pytest.approx([expected[2], expected[5]], rel=1e-6)
    assert learn.recorder.raw_losses == pytest.approx(raw, rel=1e-6)
    assert seen_smooth[:3] == pytest.approx(expected[:3], rel=1e-6)      # learn.smooth_loss after each batch


def test_fit_one_cycle_schedule_and_recorder(dls):
    learn = Learner(dls, make_model(), loss_func=nn.CrossEntropyLoss())
    with learn.no_bar():
        learn.fit_one_cycle(2, lr_max=1e-2, pct_start=0.25)
    lrs = learn.recorder.lrs
    assert len(lrs) == 8 and len(learn.recorder.losses) == 8
    assert lrs[0] == pytest.approx(1e-2 / 25)       # starts at lr_max / div
    assert max(lrs) == pytest.approx(1e-2)          # reaches lr_max after pct_start of the steps
    assert lrs.index(max(lrs)) == 2
    assert lrs[-1] < lrs[-2] < max(lrs)             # then anneals
    assert [v["epoch"] for v in learn.recorder.values] == [0, 1]
    assert learn.recorder.values[0].keys() == ["epoch", "train_loss", "valid_loss", "time"]


def test_discriminative_lrs_with_splitter(dls):
    def splitter(m):
        return [m[0].parameters(), m[2].parameters()]

    learn = Learner(dls, make_model(), loss_func=nn.CrossEntropyLoss(), splitter=splitter, lr=slice(1e-4, 1e-2))
    assert [g["lr"] for g in learn.opt.param_groups] == pytest.approx([1e-4, 1e-2])
    with learn.no_bar():
        learn.fit(1, lr=slice(1e-3))
    assert [g["lr"] for g in learn.opt.param_groups] == pytest.approx([1e-4, 1e-3])


def test_opt_func_is_built_with_the_learner_lr(dls):
    seen = []

    def opt_func(params, lr):  # an optimizer whose constructor uses lr (a schedule, a check) must see the real one
        seen.append(lr)
        return torch.optim.SGD(params, lr=lr)

    Learner(dls, make_model(), loss_func=nn.CrossEntropyLoss(), opt_func=opt_func, lr=0.05)
    assert seen == [0.05]


def test_lr_find_restores_the_model_and_suggests_a_rate(dls):
    learn = Learner(dls, make_model(), loss_func=nn.CrossEntropyLoss())
    before = {k: v.clone() for k, v in learn.model.state_dict().items()}
    sugg = learn.lr_find(num_it=30, show_plot=False)
    assert 1e-7 <= sugg.valley <= 10
    assert len(learn.lr_finder.lrs) <= 30
    assert all(torch.equal(before[k], v) for k, v in learn.model.state_dict().items())


def test_training_reduces_loss(dls):
    learn = Learner(dls, make_model(), loss_func=nn.CrossEntropyLoss(), metrics=accuracy)
    with learn.no_bar():
        learn.fit(8, lr=1e-2)
    vals = learn.recorder.values
    assert vals[-1]["train_loss"] < vals[0]["train_loss"]
    assert vals[-1]["accuracy"] > 0.5
