"""What a fastai 2.8 user notices, checked against fastai 2.8.12 itself (the same scripts run under both).

Expected values are what fastai printed for the same data, model and seeds (`make_data`, `Net`, SGD with momentum
0.9, bs 64, unshuffled): each literal names the fastai command it came from.
"""

import functools
import inspect
import pickle
import warnings

import matplotlib
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import cadence
from cadence import (AccumMetric, CancelBackwardException, Callback, CSVLogger, DataLoaders, Learner, Metric,
                     ReduceLROnPlateau, SaveModelCallback, TerminateOnNaN, TerminateOnNaNCallback, error_rate,
                     load_learner)
from cadence.distributed.strategy import SingleDevice
from cadence.trainer.callback import camel2snake
from cadence.trainer.metrics import as_metric

matplotlib.use("Agg")


def make_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 10, generator=g)
    w = torch.randn(10, 3, generator=g)
    y = (x @ w + 0.5 * torch.randn(1024, 3, generator=g)).argmax(1)
    return TensorDataset(x[:768], y[:768]), TensorDataset(x[768:], y[768:])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.BatchNorm1d(32), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        return self.head(self.body(x))


def splitter(m):
    return [list(m.body.parameters()), list(m.head.parameters())]


def mk(tmp_path, **kw):
    torch.manual_seed(123)
    dls = DataLoaders.from_dsets(*make_data(), bs=64, shuffle=False, device="cpu")
    learn = Learner(dls, Net(), loss_func=nn.CrossEntropyLoss(), opt_func=functools.partial(torch.optim.SGD,
                    momentum=0.9), path=tmp_path, **kw)
    learn.remove_cb(learn.progress)
    return learn


class MyAcc(Metric):  # fastai's documented custom-metric pattern
    def reset(self):
        self.c, self.n = 0, 0

    def accumulate(self, learn):
        self.c += (learn.pred.argmax(-1) == learn.yb[0]).sum().item()
        self.n += len(learn.yb[0])

    @property
    def value(self):
        return self.c / self.n

    @property
    def name(self):
        return "myacc"


class Count(Metric):  # the Metric docstring's example
    def reset(self):
        self.n = 0

    def accumulate(self, learn):
        self.n += len(learn.yb[0])

    @property
    def value(self):
        return self.n


class TwoProcesses(SingleDevice):
    """One process that says it is one of two data-parallel processes (collectives are the identity)."""

    dp_size = 2

    def all_sum(self, t):
        return t

    def gather(self, t):
        return t

    def barrier(self):
        pass


# ------------------------------------------------------------------ 1. a custom Metric
def test_a_fastai_style_metric_trains_on_one_process(tmp_path):
    learn = mk(tmp_path, metrics=[MyAcc(), Count()])
    learn.fit(1, 0.05)
    # fastai `r1_custom_metric.py fa`: values [[0.980869710445404, 0.8944541215896606, 0.609375]];
    # Count: metric_names [..., 'count', ...], value 256 (fastai: class2attr(self, 'Metric'))
    assert learn.recorder.metric_names == ["epoch", "train_loss", "valid_loss", "myacc", "count", "time"]
    assert learn.recorder.values[0][2:] == [0.609375, 256]
    assert learn.recorder.values[0][1] == pytest.approx(0.8944541215896606, abs=1e-6)


def test_on_several_processes_a_metric_without_sync_is_refused_before_training(tmp_path):
    learn = mk(tmp_path, metrics=MyAcc(), strategy=TwoProcesses("cpu"))
    with pytest.raises(NotImplementedError, match=r"metric 'myacc' \(MyAcc\) cannot be combined across processes"
                                                  r".*sync\(self, all_sum, all_gather\)"):
        learn.fit(1, 0.05)
    assert learn.recorder.losses == []   # refused in before_fit: not one batch trained

    class SyncedAcc(MyAcc):
        def sync(self, all_sum, all_gather):
            self.c, self.n = (int(v) for v in all_sum(torch.tensor([self.c, self.n])))

    learn.metrics = [SyncedAcc(), AccumMetric(lambda p, t: (p == t).float().mean(), "acc", dim_argmax=-1)]
    learn.fit(1, 0.05)
    assert learn.recorder.values[0][2:] == [0.609375, 0.609375]


# ------------------------------------------------------------------ 2. callback attribute names
def test_callback_names_are_fastcores_camel2snake(tmp_path):
    # fastcore 1.8 (fastai 2.8.12): camel2snake(n) for each n
    expected = {"CSVLogger": "csv_logger", "ReduceLROnPlateau": "reduce_lr_on_plateau", "LRFinder": "lr_finder",
                "MyHTTPServer": "my_http_server", "HTTP2Server": "http2_server", "AB1Cd": "ab1_cd", "A1B": "a1_b",
                "getHTTPResponse": "get_http_response", "TerminateOnNaN": "terminate_on_na_n", "ABC": "abc",
                "Ab_Cd": "ab_cd", "_Patient": "_patient", "X": "x", "already_snake": "already_snake"}
    assert {n: camel2snake(n) for n in expected} == expected
    learn = mk(tmp_path, cbs=[CSVLogger(), ReduceLROnPlateau(), SaveModelCallback()])
    # fastai `r2_cb_attr_names.py fa`: csv_logger -> CSVLogger, reduce_lr_on_plateau -> ReduceLROnPlateau
    assert type(learn.csv_logger) is CSVLogger and type(learn.reduce_lr_on_plateau) is ReduceLROnPlateau
    # fastai's learn.save_model is the callback; cadence keeps its method (docs/fastai.md)
    assert callable(learn.save_model) and type(learn.save_model_callback) is SaveModelCallback


# ------------------------------------------------------------------ 3. built-in metrics through export
def _exported_metrics() -> dict:
    """Every metric cadence exports that needs no argument, as `Learner(metrics=...)` holds it."""
    out = {}
    for name in cadence.__all__:
        obj = getattr(cadence, name)
        if not getattr(obj, "__module__", "").startswith("cadence.trainer.metrics") or name in ("Metric", "SumMetric"):  # base classes
            continue
        if hasattr(obj, "as_metric"):
            out[name] = as_metric(obj)
        elif callable(obj) and all(p.default is not p.empty or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
                                   for p in inspect.signature(obj).parameters.values()):
            out[name] = obj()
    return out


def test_every_builtin_metric_survives_export_and_load_learner(tmp_path):
    metrics = _exported_metrics()
    assert {"error_rate", "rmse", "exp_rmspe", "accuracy", "F1Score", "Dice", "Perplexity"} <= set(metrics)
    for name, m in metrics.items():
        assert type(pickle.loads(pickle.dumps(m))) is type(m), name
    learn = mk(tmp_path, metrics=[cadence.accuracy, error_rate])
    learn.fit(1, 0.05)
    learn.metrics = [cadence.accuracy, error_rate, *(m for n, m in metrics.items() if n not in ("accuracy", "error_rate"))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # export warned "cannot be pickled" for error_rate, rmse, exp_rmspe
        learn.export("exp")
    loaded = load_learner(tmp_path / "exp", trust_pickle=True)
    assert [m.name for m in loaded.metrics] == [m.name for m in learn.metrics]
    loaded.metrics = [cadence.accuracy, error_rate]
    # fastai `r5_error_rate_export.py fa`: [0, 0.980869710445404, 0.8944541215896606, 0.609375, 0.390625, '00:00']
    assert list(loaded.validate(dl=learn.dls.valid))[1:] == [0.609375, 0.390625]


# ------------------------------------------------------------------ 4. load(device=)
def test_load_takes_fastais_device(tmp_path):
    learn = mk(tmp_path)
    learn.fit(1, 0.05)
    learn.save("m")
    for device in ("cpu", torch.device("cpu")):
        other = mk(tmp_path)
        assert other.load("m", device=device) is other
        # fastai `r3_load_device.py fa`: loaded 0.8944541215896606
        assert other.validate()[0] == pytest.approx(0.8944541215896606, abs=1e-6)
    assert mk(tmp_path).load("m", "cpu", with_opt=False, strict=True).opt.state == {}
    with pytest.raises(TypeError, match="with_opt= by name"):
        learn.load("m", False)


# ------------------------------------------------------------------ 5. recorder.plot_lr_find
def test_plot_lr_find_plots_the_sweep_as_fastai(tmp_path):
    learn = mk(tmp_path)
    with pytest.raises(ValueError, match="call learn.lr_find"):
        learn.recorder.plot_lr_find()
    learn.lr_find(show_plot=False)
    fig = learn.recorder.plot_lr_find()
    ax = fig.axes[0]
    x, y = ax.lines[0].get_xdata(), ax.lines[0].get_ydata()
    # fastai `r4_plot_lr_find.py fa`, then the figure's line: 89 points from 1e-07 to 1.096478196143185, losses
    # 1.1268957 to 1.0686082, log x, labels 'Learning Rate' / 'Loss'; skip_end=0: 94 points
    assert (len(x), x[0], ax.get_xscale(), ax.get_xlabel(), ax.get_ylabel()) == (89, 1e-07, "log", "Learning Rate",
                                                                                 "Loss")
    assert [x[-1], y[0], y[-1]] == pytest.approx([1.096478196143185, 1.1268957, 1.0686082], rel=1e-5)
    assert len(learn.recorder.plot_lr_find(skip_end=0).axes[0].lines[0].get_xdata()) == 94
    marked = learn.recorder.plot_lr_find(suggestions=[(1e-3, 1.1)], nms=["valley"]).axes[0]
    assert [line.get_label() for line in marked.lines[1:]] == ["valley"]


# ------------------------------------------------------------------ 6. zero_grad (kept: docs/fastai.md)
def test_gradients_are_dropped_after_a_step_as_fastai_with_a_torch_optimizer(tmp_path):
    seen = []

    class Peek(Callback):
        def before_batch(self):
            if self.training and self.iter == 1:
                seen.append(self.learn.model.head.bias.grad)

        def before_backward(self):
            if self.training and self.iter == 0 and self.epoch == 1:
                raise CancelBackwardException()

    learn = mk(tmp_path)
    learn.fit(2, 0.05, cbs=Peek())
    # fastai with opt_func=partial(OptimWrapper, opt=torch.optim.SGD, momentum=0.9) (its wrapper of a torch
    # optimizer, which is what cadence's opt_func is): grad None, values [[0.98087, 0.89445], [0.73705, 0.42553]]
    assert seen == [None, None]
    assert np.round(np.array(learn.recorder.values, dtype=float), 5).tolist() == [[0.98087, 0.89445],
                                                                                   [0.73705, 0.42553]]


# ------------------------------------------------------------------ 7. recorder.hps
def test_hps_hold_the_last_groups_value_per_batch(tmp_path):
    learn = mk(tmp_path, splitter=splitter)
    learn.fit_one_cycle(1, slice(1e-3, 1e-1))
    hps = learn.recorder.hps
    # fastai `r7_hps.py fa`: 12 batches, lr[0] np.float64(0.004), lr[-1] np.float64(0.0030163384512159053),
    # mom[0] 0.95, mom[5] 0.8616977765066707
    assert len(hps["lr"]) == len(hps["mom"]) == 12
    assert isinstance(hps["lr"][0], np.floating) and hps["lr"][0] == pytest.approx(0.004)
    assert hps["lr"][-1] == pytest.approx(0.0030163384512159053, rel=1e-6)
    assert hps["mom"][0] == 0.95 and hps["mom"][5] == pytest.approx(0.8616977765066707)
    learn.recorder.plot_sched()


# ------------------------------------------------------------------ 8. fastai names
def test_fastai_names_dls_bs_all_batches_terminate_on_nan(tmp_path):
    learn = mk(tmp_path)
    assert learn.dls.bs == 64   # fastai `r8_dls_bs.py fa`: l.dls.bs = 64
    calls = []

    class Counting(Learner):
        def all_batches(self):
            calls.append(self.training)
            super().all_batches()

    counting = Counting(learn.dls, Net(), loss_func=nn.CrossEntropyLoss())
    counting.remove_cb(counting.progress)
    counting.fit(1)
    assert calls == [True, False]
    assert issubclass(TerminateOnNaNCallback, TerminateOnNaN)
    nan_loss = Callback(after_loss=lambda cb: setattr(cb.learn, "loss", cb.learn.loss * np.nan))
    learn.fit(2, cbs=[TerminateOnNaNCallback(), nan_loss])
    assert learn.recorder.values == []   # stopped in the first batch, as fastai's CancelFitException


# ------------------------------------------------------------------ 9. distrib_ctx on one process
def test_distrib_ctx_on_one_process_says_nothing_of_syncbatchnorm(tmp_path):
    learn = mk(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with learn.distrib_ctx():
            assert not any(isinstance(m, nn.SyncBatchNorm) for m in learn.model.modules())
            learn.fit(1, 0.05)
    assert [str(w.message) for w in caught if "SyncBatchNorm" in str(w.message)] == []


def test_a_metric_exported_before_name_was_a_property_keeps_its_name():
    """Exports pickle the Learner's metrics; one pickled when `name` was an instance attribute reads it back."""
    import pickle

    from cadence import accuracy
    from cadence.trainer.metrics import as_metric

    metric = as_metric(accuracy)
    state = dict(metric.__dict__)
    state["name"] = state.pop("_name", None) or "accuracy"
    old = object.__new__(type(metric))
    old.__dict__.update(state)
    assert pickle.loads(pickle.dumps(old)).name == "accuracy"
