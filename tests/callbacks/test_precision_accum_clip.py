"""MixedPrecision, GradAccum and GradClip on one process."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import Callback, DataLoaders, Learner, ParamScheduler, SchedLin
from cadence.callbacks.accumulate import GradAccum, plan_windows
from cadence.callbacks.clip import GradClip
from cadence.callbacks.precision import MixedPrecision


def data(n=76, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return x, (x @ torch.randn(6, 3, generator=g)).argmax(1)


def learner(bs, cbs=(), n=76, lr=0.1, opt_func=torch.optim.SGD):
    x, y = data(n)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=bs), DataLoader(TensorDataset(x, y), batch_size=bs),
                      device="cpu")
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=opt_func, lr=lr, cbs=list(cbs))
    learn.remove_cb(learn.progress)
    return learn


class PredDtype(Callback):
    def __init__(self):
        self.dtypes = set()

    def after_pred(self):
        if self.training:
            self.dtypes.add(self.pred.dtype)


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_mixed_precision_trains_on_cpu(precision, dtype):
    seen = PredDtype()
    learn = learner(8, [seen, MixedPrecision(precision)], lr=0.5)
    learn.fit(4)
    assert seen.dtypes == {dtype}
    assert all(p.dtype == torch.float32 for p in learn.model.parameters())  # master weights stay fp32
    losses = [v["train_loss"] for v in learn.recorder.values]
    assert losses[-1] < losses[0]
    assert learn.step == 4 * 10


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_predictions_and_per_item_losses_come_back_in_fp32_as_fastais(precision):
    learn = learner(8, [MixedPrecision(precision)], lr=0.5)
    learn.fit(1)
    preds, targs, losses = learn.get_preds(with_loss=True)
    assert preds.dtype == losses.dtype == torch.float32
    assert torch.equal(losses, nn.functional.cross_entropy(preds, targs, reduction="none"))   # from the fp32 preds
    assert learn.validate()["valid_loss"] == pytest.approx(float(losses.mean()), rel=1e-6)


def test_to_bf16_to_fp16_to_fp32():
    learn = learner(8).to_bf16()
    assert learn.mixed_precision.precision == "bf16"
    learn.to_fp16()
    assert learn.mixed_precision.precision == "fp16" and len([c for c in learn.cbs if isinstance(c, MixedPrecision)]) == 1
    learn.to_fp32()
    seen = PredDtype()
    learn.fit(1, cbs=seen)
    assert seen.dtypes == {torch.float32}


class OverflowAt(Callback):
    """Make the loss infinite on one training batch: its fp16 gradients overflow."""

    def __init__(self, train_iter):
        self.at = train_iter

    def after_loss(self):
        if self.training and self.train_iter == self.at:
            self.learn.loss_grad = self.loss_grad * float("inf")


def test_fp16_overflow_is_skipped_and_the_schedule_does_not_advance():
    sched = ParamScheduler({"lr": SchedLin(0.1, 0.01)})
    learn = learner(8, [MixedPrecision("fp16"), OverflowAt(3), sched])
    learn.fit(1)
    assert learn.mixed_precision.skipped_steps == 1
    assert learn.step == 10 - 1
    lrs = learn.recorder.lrs
    assert lrs[3] == lrs[4]                      # the skipped step did not move the schedule
    assert lrs[2] != lrs[3] and lrs[4] != lrs[5]  # the others did
    state = learn.mixed_precision.state_dict()
    assert state["plugin"]["skipped_steps"] == 1 and state["plugin"]["scaler"]["scale"] < 2.0 ** 16


def weights(learn):
    return [p.detach().clone() for p in learn.model.parameters()]


@pytest.mark.parametrize("n", [64, 76])  # 76: a partial final window of 8 + 4 samples
def test_grad_accum_equals_the_big_batch(n):
    big = learner(32, n=n)
    big.fit(2)
    acc = learner(8, [GradAccum(steps=4)], n=n)
    acc.fit(2)
    assert acc.step == big.step == 2 * -(-n // 32)
    for a, b in zip(weights(big), weights(acc)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert len(acc.recorder.losses) == 2 * -(-n // 8)


def test_grad_accum_by_samples():
    big = learner(32)
    big.fit(1)
    acc = learner(8, [GradAccum(samples=32)])
    acc.fit(1)
    for a, b in zip(weights(big), weights(acc)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_grad_accum_schedules_count_optimizer_steps():
    acc = learner(8, [GradAccum(steps=4)], n=64)
    acc.fit_one_cycle(2, lr_max=0.1)
    big = learner(32, n=64)
    big.fit_one_cycle(2, lr_max=0.1)
    assert acc.recorder.lrs[::4] == pytest.approx(big.recorder.lrs)


def test_plan_windows():
    assert plan_windows([8, 8, 8, 8, 8], steps=2) == ([False, True, False, True, True], [0.5, 0.5, 0.5, 0.5, 1.0])
    assert plan_windows([10, 10, 10, 5], samples=25) == ([False, False, True, True], [1 / 3, 1 / 3, 1 / 3, 1.0])


def test_grad_clip_by_norm_records_the_norm_before_clipping():
    x, y = data()
    learn = learner(76, [GradClip(0.01)], lr=1.0)
    ref = learner(76, lr=1.0)
    ref_model = ref.model
    nn.functional.cross_entropy(ref_model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.01)
    torch.optim.SGD(ref_model.parameters(), lr=1.0).step()
    learn.fit(1)
    assert learn.grad_norm == pytest.approx(norm.item(), rel=1e-6)
    assert norm.item() > 0.01
    for a, b in zip(weights(learn), [p.detach() for p in ref_model.parameters()]):
        torch.testing.assert_close(a, b)


def test_grad_clip_by_value():
    learn = learner(76, [GradClip(value=1e-3)], lr=1.0)
    before = weights(learn)
    learn.fit(1)
    assert max((a - b).abs().max().item() for a, b in zip(before, weights(learn))) <= 1e-3 + 1e-7


def test_grad_clip_after_fp16_unscale():
    x, y = data()
    learn = learner(76, [MixedPrecision("fp16"), GradClip(1e6)], lr=0.0)
    learn.fit(1)
    ref = learner(76)
    nn.functional.cross_entropy(ref.model(x), y).backward()
    true_norm = torch.nn.utils.clip_grad_norm_(ref.model.parameters(), 1e9).item()
    assert learn.grad_norm == pytest.approx(true_norm, rel=1e-2)  # unscaled: not 65536 times larger


def test_bad_arguments():
    with pytest.raises(ValueError, match="bf16' or 'fp16"):
        MixedPrecision("fp8")
    with pytest.raises(ValueError, match="steps"):
        GradAccum()
    with pytest.raises(ValueError, match="positive int"):
        GradAccum(steps=0)
    with pytest.raises(ValueError, match="either max_norm"):
        GradClip()
