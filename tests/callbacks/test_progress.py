"""ProgressCallback: plain lines when output is not a terminal, a live bar and a table on a terminal."""

import io

from rich.console import Console
from torch import nn

from cadence import Learner, ProgressCallback, accuracy


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


def test_no_bar_silences_output(dls, capsys):
    learn = Learner(dls, nn.Linear(8, 3), loss_func=nn.CrossEntropyLoss())
    with learn.no_bar():
        learn.fit(1)
    assert capsys.readouterr().out == ""
    assert any(isinstance(cb, ProgressCallback) for cb in learn.cbs)
