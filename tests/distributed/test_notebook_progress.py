"""Workers `notebook_launcher` starts from a Jupyter kernel print plain progress lines into the cell: no terminal
control codes, though the kernel's FORCE_COLOR=1 / TERM=xterm-color would make rich draw a live bar."""

from __future__ import annotations

import os
import re

import pytest
from notebooks import output_text, outputs, python3_kernel

from cadence.callbacks.progress import _plain_output
from cadence.distributed import notebook
from cadence.distributed.notebook import NOTEBOOK_OUTPUT_VAR, debug_launcher, in_jupyter_kernel


def test_notebook_output_var_means_plain_lines_whatever_force_color_says(monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert not _plain_output()                     # a terminal run (or FORCE_COLOR) keeps its live bar
    monkeypatch.setenv(NOTEBOOK_OUTPUT_VAR, "1")
    assert _plain_output()


def test_not_a_kernel_here():
    assert not in_jupyter_kernel()


def _notebook_var():
    return os.environ.get("CADENCE_NOTEBOOK_OUTPUT")


@pytest.mark.slow
def test_workers_are_told_only_when_launched_from_a_kernel(monkeypatch):
    assert debug_launcher(_notebook_var, num_processes=1) is None
    monkeypatch.setattr(notebook, "in_jupyter_kernel", lambda: True)
    assert debug_launcher(_notebook_var, num_processes=1) == "1"


TRAIN_CELL = """\
import torch
from torch import nn
from torch.utils.data import TensorDataset
from cadence import DataLoaders, Learner, accuracy, notebook_launcher

def train():
    torch.manual_seed(0)
    x = torch.randn(300, 10); y = (x[:, 0] > 0).long()
    dls = DataLoaders.from_dsets(TensorDataset(x[:200], y[:200]), TensorDataset(x[200:], y[200:]), bs=32)
    learn = Learner(dls, nn.Linear(10, 2), loss_func=nn.CrossEntropyLoss(), metrics=accuracy)
    with learn.distrib_ctx(in_notebook=True):
        learn.fit(2, 1e-2)

notebook_launcher(train, num_processes=2)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_progress_from_notebook_launcher_is_plain_lines_in_the_cell(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    kernel_name = python3_kernel(tmp_path, monkeypatch, one_thread=True)
    for var, value in (("FORCE_COLOR", "1"), ("TERM", "xterm-color")):   # what ipykernel gives its processes
        monkeypatch.setenv(var, value)
    # ipykernel forwards what the workers write to its file descriptors into the cell, except under pytest
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(TRAIN_CELL)]

    nbclient.NotebookClient(nb, timeout=240, kernel_name=kernel_name,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    path = tmp_path / "executed.ipynb"
    nbformat.write(nb, path)
    saved = nbformat.read(path, as_version=4)

    errors = outputs(saved, "error")
    assert not errors, "\n".join(f"{e.ename}: {e.evalue}" for e in errors)
    text = "".join(output_text(o) for o in outputs(saved, "stream"))
    assert "\x1b" not in text and "\r" not in text, repr(text)
    rows = re.findall(r"^epoch (\d) \| train_loss [0-9.]+ \| valid_loss [0-9.]+ \| accuracy [0-9.]+ \| time", text, re.M)
    assert rows == ["0", "1"], repr(text)          # one row per epoch, from rank 0 only
    assert "epoch 1/2 train" not in text           # no leftover bar line
