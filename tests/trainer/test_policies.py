"""fit_flat_cos, fit_sgdr, SchedPoly, ReduceLROnPlateau, the Recorder's plots, summary, and lr_find's suggestions."""

import math
import subprocess
import sys

import matplotlib
import numpy as np
import pytest
import torch
from torch import nn

from cadence import (Callback, Learner, Order, ParamScheduler, ReduceLROnPlateau, SchedPoly, minimum, slide, steep,
                     valley)

from helpers import REPO, cadence_env

matplotlib.use("Agg")


def learner(dls, model, **kw):
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=torch.optim.SGD, **kw)
    learn.remove_cb(learn.progress)
    return learn


def cos_anneal(start, end, p):
    return start + (end - start) * (1 - math.cos(math.pi * p)) / 2


def test_fit_flat_cos_is_flat_then_anneals(dls, model):
    learn = learner(dls, model)
    learn.fit_flat_cos(2, lr=0.1, pct_start=0.5)                    # 8 steps: 4 flat, 4 annealing
    expected = [0.1] * 4 + [cos_anneal(0.1, 0.1 / 1e5, k / 4) for k in range(4)]
    assert learn.recorder.lrs == pytest.approx(expected)


def test_fit_sgdr_restarts_each_cycle_and_doubles_its_length(dls, model):
    learn = learner(dls, model)
    learn.fit_sgdr(2, cycle_len=1, lr_max=0.1)                     # 1 + 2 epochs of 4 steps
    assert learn.n_epoch == 3
    expected = [cos_anneal(0.1, 0, k / 4) for k in range(4)] + [cos_anneal(0.1, 0, k / 8) for k in range(8)]
    assert learn.recorder.lrs == pytest.approx(expected)


def test_sched_poly_and_recorded_hyper_parameters(dls, model):
    learn = learner(dls, model)
    learn.fit(1, cbs=ParamScheduler({"lr": SchedPoly(0.1, 0.0, 2)}))
    assert learn.recorder.lrs == pytest.approx([0.1 - 0.1 * (k / 4) ** 2 for k in range(4)])
    assert learn.recorder.hps["lr"] == pytest.approx(learn.recorder.lrs)


def test_bad_policy_arguments_are_refused_before_training(dls, model):
    learn = learner(dls, model)
    with pytest.raises(ValueError, match="fit_sgdr needs cycle_len to be a positive int, got 0"):
        learn.fit_sgdr(2, cycle_len=0)
    with pytest.raises(ValueError, match="pct_start is the fraction of training at the flat rate, in \\[0, 1\\]; got 2"):
        learn.fit_flat_cos(1, pct_start=2)
    assert learn.step == 0


class ScriptedLoss(Callback):
    """Replace each epoch's recorded valid_loss with a scripted one (after the Recorder, before the monitors)."""

    order = Order.REPORT

    def __init__(self, losses):
        self.losses = losses

    def after_epoch(self):
        self.learn.recorder.values[-1]["valid_loss"] = self.losses[self.learn.epoch]


def test_reduce_lr_on_plateau_divides_the_rate_after_patience_epochs(dls, model, capsys):
    learn = learner(dls, model, lr=1e-2)
    losses = [1.0, 0.9, 0.9, 0.95, 0.8, 0.85, 0.86, 0.9, 0.9]
    learn.fit(9, cbs=[ScriptedLoss(losses), ReduceLROnPlateau(patience=2, factor=10, min_lr=5e-5)])
    per_epoch = learn.recorder.lrs[::4]
    assert per_epoch == pytest.approx([1e-2] * 4 + [1e-3] * 3 + [1e-4] * 2)
    assert learn.opt.param_groups[0]["lr"] == 5e-5                      # 1e-5 would be below min_lr
    assert "ReduceLROnPlateau: no improvement in valid_loss for 2 epoch(s); lr reduced to 0.001 after epoch 3" \
        in capsys.readouterr().out
    with pytest.raises(ValueError, match="factor divides the learning rate, so it must be > 1, got 0.5"):
        ReduceLROnPlateau(factor=0.5)


def test_recorder_plots_show_what_was_recorded(dls, model):
    learn = learner(dls, model)
    learn.fit_one_cycle(2, lr_max=0.1)
    (line,) = learn.recorder.plot_lr().axes[0].lines
    assert list(line.get_ydata()) == learn.recorder.lrs
    train, valid = learn.recorder.plot_loss(skip_start=0).axes[0].lines
    assert list(train.get_ydata()) == learn.recorder.losses
    assert list(valid.get_ydata()) == [v["valid_loss"] for v in learn.recorder.values]
    lr_ax, mom_ax = learn.recorder.plot_sched().axes
    assert list(lr_ax.lines[0].get_ydata()) == pytest.approx(learn.recorder.lrs)
    assert mom_ax.get_ylabel() == "mom" and list(mom_ax.lines[0].get_ydata()) == pytest.approx(
        [float(v) for v in learn.recorder.hps["mom"]])


def test_summary_lists_layers_shapes_parameters_freezing_and_callbacks(dls, model):
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(),
                    splitter=lambda m: [list(m[0].parameters()), list(m[2].parameters())])
    learn.freeze()
    text = learn.summary()
    lines = [" ".join(line.split()) for line in text.splitlines()]
    assert "Sequential (input: 16 x 8)" == lines[0]
    assert "Linear (0) 16 x 16 144 False" in lines and "ReLU (1) 16 x 16 0" in lines and "Linear (2) 16 x 3 51 True" in lines
    assert "Total params: 195" in lines and "Total trainable params: 51" in lines
    assert "Model frozen up to parameter group #1 (of 2)" in lines
    assert lines[-2:] == ["- Recorder", "- ProgressCallback"]
    assert learn.model.training  # the summary's forward pass left the mode as it was


LRS = torch.tensor(10.0 ** np.linspace(-6, 0, 40))


def test_suggestion_functions_follow_fastais_rules():
    down_up = torch.tensor([10.0 - i for i in range(10)] + [2.0, 3.0, 4.0, 5.0, 6.0])
    lrs = LRS[:15]
    # longest decreasing run ends at index 9 with length 10: start 9 - 10 = -1, a third 10/3 -> -1 + 3 + 1 = 3
    assert valley(lrs, down_up, 100) == (float(lrs[3]), (float(lrs[3]), 7.0))
    assert minimum(lrs, down_up, 100) == (float(lrs[9]) / 10, (float(lrs[9]), 1.0))
    kinked = torch.tensor([5.0, 4.9, 4.0, 3.9, 3.8], dtype=torch.float64)
    assert steep(LRS[:5], kinked, 100) == (float(LRS[1]), (float(LRS[1]), 4.9))
    # slope -1 up to index 29, then +5: walking left from the end, the gradients 15 points apart agree once
    # the right point reaches index 28; the last rate taken is at index 29 - 15 = 14
    line = torch.tensor([-float(i) for i in range(30)] + [-29.0 + 5 * k for k in range(1, 11)])
    lr, (x, y) = slide(LRS, line, 100)
    assert lr == pytest.approx(float(LRS[14])) and y == pytest.approx(-14.0)


def test_lr_find_returns_one_field_per_suggestion_and_plots(dls, model):
    import matplotlib.pyplot as plt

    learn = learner(dls, model)
    before = len(plt.get_fignums())
    sugg = learn.lr_find(num_it=40, suggest_funcs=(valley, slide, minimum, steep))
    assert sugg._fields == ("valley", "slide", "minimum", "steep")
    assert all(1e-7 <= v <= 10 for v in sugg)
    assert len(plt.get_fignums()) == before + 1
    assert len(learn.recorder.lrs) == len(learn.lr_finder.lrs) == len(learn.recorder.losses)


HIDDEN_MATPLOTLIB = """
import sys, warnings
sys.modules["matplotlib"] = None                      # as if matplotlib were not installed
sys.path.insert(0, "tests")
import torch
from torch import nn
from fixtures import make_data
from torch.utils.data import DataLoader
from cadence import DataLoaders, Learner
train, valid = make_data()
learn = Learner(DataLoaders(DataLoader(train, batch_size=4), DataLoader(valid, batch_size=16), device="cpu"),
                nn.Linear(8, 3), loss_func=nn.CrossEntropyLoss())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    sugg = learn.lr_find(num_it=12)
print("SUGGESTED", sugg.valley > 0)
print("WARNED", [str(w.message) for w in caught])
try:
    learn.recorder.plot_loss()
except ModuleNotFoundError as e:
    print("PLOT", e)
"""


@pytest.mark.slow
def test_without_matplotlib_lr_find_suggests_and_says_how_to_get_the_plot():
    proc = subprocess.run([sys.executable, "-c", HIDDEN_MATPLOTLIB], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env=cadence_env())
    assert proc.returncode == 0, proc.stderr
    assert "SUGGESTED True" in proc.stdout
    assert "lr_find: matplotlib is not installed, so there is no plot (pip install matplotlib" in proc.stdout
    assert "PLOT plotting needs matplotlib, which is not installed: pip install matplotlib" in proc.stdout
