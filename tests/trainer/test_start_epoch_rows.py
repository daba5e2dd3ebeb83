"""`fit(start_epoch=k)` prints a row for each skipped epoch, as fastai does, in the plain lines and in the terminal
table, and `learn.recorder` holds what is printed.

fastai 2.8.12 (`learn.fit(4, 1e-2, start_epoch=2)`, metrics=accuracy, plain console) printed

    epoch     train_loss  valid_loss  accuracy  time
    0         00:00
    1         00:00
    2         0.759331    0.719319    0.531250  00:00
    3         ...

(its skipped rows hold the epoch and the time alone, the time landing under train_loss), and recorded
`recorder.values == [[], [], [...], [...]]`. cadence prints the time in its own column, as it times its epochs.
"""

import io

import pytest
import torch
from rich.console import Console
from torch import nn
from torch.utils.data import TensorDataset

from cadence import DataLoaders, Learner, ProgressCallback, Recorder, accuracy


def _learner(console=None, add_time=True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = (x[:, 0] > 0).long()
    torch.manual_seed(0)
    learn = Learner(DataLoaders.from_dsets(TensorDataset(x, y), TensorDataset(x, y), bs=16, device="cpu"),
                    nn.Linear(4, 2), loss_func=nn.CrossEntropyLoss(), metrics=accuracy)
    if not add_time:
        learn.remove_cb(learn.recorder).add_cb(Recorder([accuracy], add_time=False))
    if console is not None:
        learn.remove_cb(ProgressCallback).add_cb(ProgressCallback(console=console))
    return learn


def test_plain_lines_show_each_skipped_epoch_with_its_number_and_time(capsys):
    learn = _learner()
    learn.fit(4, 1e-2, start_epoch=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["epoch 0 | time 00:00.00", "epoch 1 | time 00:00.00"]           # fastai: "0  00:00"
    assert [line.split(" | ")[0] for line in lines[2:]] == ["epoch 2", "epoch 3"] and len(lines) == 4
    assert lines[2].split(" | ")[1].startswith("train_loss ") and "| accuracy " in lines[2]
    values = learn.recorder.values
    assert values[:2] == [[], []] and [r.as_dict() for r in values[:2]] == [{"epoch": 0, "time": 0.0},
                                                                            {"epoch": 1, "time": 0.0}]
    with learn.no_logging():   # no rows at all, the skipped ones included
        learn.fit(3, 1e-2, start_epoch=1)
    assert capsys.readouterr().out == "" and learn.recorder.values[0] == []


def test_without_times_a_skipped_epoch_shows_its_number_alone(capsys):
    learn = _learner(add_time=False)
    learn.fit_one_cycle(3, 1e-2, start_epoch=1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "epoch 0" and lines[1].startswith("epoch 1 | train_loss ") and len(lines) == 3
    assert learn.recorder.values[0].as_dict() == {"epoch": 0}


@pytest.mark.parametrize("fit", ["fit", "fit_one_cycle"])
def test_terminal_table_has_a_row_per_skipped_epoch_before_the_trained_ones(fit):
    out = io.StringIO()
    learn = _learner(Console(file=out, force_terminal=True, color_system=None, width=120))
    getattr(learn, fit)(4, 1e-2, start_epoch=2)
    lines = [line.split("\x1b[2K")[-1].split() for line in out.getvalue().splitlines()]   # past the bar's redraws
    assert ["epoch", "train_loss", "valid_loss", "accuracy", "time"] in lines
    rows = [r for r in lines if r and r[0].isdigit()]
    assert rows[:2] == [["0", "00:00.00"], ["1", "00:00.00"]]          # blank loss and metric cells, as fastai's
    assert [r[0] for r in rows[2:]] == ["2", "3"] and all(len(r) == 5 for r in rows[2:])
    assert float(rows[-1][3]) == pytest.approx(learn.recorder.values[-1]["accuracy"], abs=1e-6)
    assert len(learn.recorder.values) == 4


def test_csv_logger_writes_a_row_for_each_skipped_epoch_before_the_trained_ones(tmp_path):
    """fastai's CSVLogger writes `0,00:00` for each epoch `start_epoch` skipped; cadence's writes the epoch and its
    time in their own columns (`0,,,,00:00`), so `read_log()` has one row per epoch of the schedule."""
    from cadence import CSVLogger

    learn = _learner()
    learn.path = tmp_path
    with learn.no_bar():
        learn.fit(4, 1e-2, start_epoch=2, cbs=CSVLogger())
    lines = (tmp_path / "history.csv").read_text().splitlines()
    assert lines[0] == "epoch,train_loss,valid_loss,accuracy,time"
    assert lines[1:3] == ["0,,,,00:00", "1,,,,00:00"]
    assert [line.split(",")[0] for line in lines[3:]] == ["2", "3"] and all(line.split(",")[1] for line in lines[3:])
