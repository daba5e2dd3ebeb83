"""ProgressCallback: plain lines when output is not a terminal, a live bar and a table on a terminal."""

import io
import sys

import pytest
from rich.console import Console
from torch import nn

from cadence import Learner, ProgressCallback, accuracy
from cadence.callbacks.progress import _plain_output


def test_plain_line_per_epoch_when_not_a_terminal(dls, capsys):
    learn = Learner(dls, nn.Linear(8, 3), loss_func=nn.CrossEntropyLoss(), metrics=accuracy)
    learn.fit(2)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("epoch 0 | train_loss ") and "| valid_loss " in lines[0] and "| accuracy " in lines[0]
    assert lines[1].startswith("epoch 1 |")


def test_terminal_table_and_bar(dls):
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system=None, width=120)
    learn = Learner(dls, nn.Linear(8, 3), loss_func=nn.CrossEntropyLoss(), metrics=accuracy)
    learn.remove_cb(ProgressCallback).add_cb(ProgressCallback(console=console))
    learn.fit(2)
    text = out.getvalue()
    header = next(line for line in text.splitlines() if "train_loss" in line)
    assert header.split() == ["epoch", "train_loss", "valid_loss", "accuracy", "time"]
    acc = learn.recorder.values[-1]["accuracy"]
    assert f"{acc:.6f}" in text
    assert "epoch 2/2 train" in text  # the live bar was drawn
    n_train = len(dls.train)
    final_train = [line for line in text.splitlines() if "epoch 2/2 train" in line and f"{n_train}/{n_train}" in line]
    assert final_train and "loss " in final_train[-1]  # the bar read the last batch count and the loss from the learner


def test_live_bar_updates_while_training(dls):
    """The bar polls the learner as it redraws: a slow epoch shows intermediate counts without any per-batch call."""
    import time

    class Slow(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 3)

        def forward(self, x):
            time.sleep(0.15)  # 4 batches: 0.6 s, three redraws at 5 Hz
            return self.lin(x)

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system=None, width=120)
    learn = Learner(dls, Slow(), loss_func=nn.CrossEntropyLoss())
    learn.remove_cb(ProgressCallback).add_cb(ProgressCallback(console=console))
    learn.fit(1)
    n_train = len(dls.train)
    counts = {f"{k}/{n_train}" for k in range(1, n_train)}
    assert any(c in out.getvalue() for c in counts), "no intermediate batch count was drawn"


def test_no_bar_leaves_each_row_to_learn_logger_and_no_logging_silences_it(dls, capsys):
    learn = Learner(dls, nn.Linear(8, 3), loss_func=nn.CrossEntropyLoss())
    with learn.no_bar():
        learn.fit(2)
    lines = capsys.readouterr().out.splitlines()      # fastai's: `print` of each row, no bar
    assert [line[:4] for line in lines] == ["[0, ", "[1, "] and lines[0].endswith("']")
    with learn.no_bar(), learn.no_logging():
        learn.fit(1)
    assert capsys.readouterr().out == ""
    assert any(isinstance(cb, ProgressCallback) for cb in learn.cbs)


class _Stdout(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


@pytest.mark.parametrize("env, tty", [({}, False), ({}, True), ({"TTY_COMPATIBLE": "0"}, True),
                                      ({"TTY_COMPATIBLE": "1"}, False), ({"FORCE_COLOR": "1"}, False),
                                      ({"FORCE_COLOR": ""}, True), ({"TTY_COMPATIBLE": "2"}, False)])
def test_plain_output_exactly_when_rich_finds_no_terminal(monkeypatch, env, tty):
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(sys, "stdout", _Stdout(tty))
    assert _plain_output() is not Console().is_terminal  # rich decides when we cannot tell without it


def test_closed_stdout_counts_as_no_terminal(monkeypatch):
    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stdout", closed)
    assert _plain_output() and not Console().is_terminal


def test_force_color_gets_the_live_bar_on_captured_output(dls, monkeypatch, capsys):
    monkeypatch.setenv("FORCE_COLOR", "1")
    Learner(dls, nn.Linear(8, 3), loss_func=nn.CrossEntropyLoss()).fit(1)
    out = capsys.readouterr().out
    assert "\x1b[" in out and "epoch 1/1 train" in out  # rich drew the bar, as it does on a terminal
