"""A metric's failure keeps its type: code catching torch.OutOfMemoryError or a distributed
error still sees it, the metric named in a note."""

import pytest
import torch
from torch import nn
from fixtures import make_data

from cadence import AccumMetric, DataLoaders, Learner


def _learn(metric):
    dls = DataLoaders.from_dsets(*make_data(n_train=32, n_valid=32, n_in=5, n_out=2), bs=16, device="cpu")
    return Learner(dls, nn.Linear(5, 2), loss_func=nn.CrossEntropyLoss(), metrics=metric)


def _oom(pred, targ):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def _dist(pred, targ):
    raise torch.distributed.DistBackendError("NCCL communicator was aborted")


def out_of_memory(pred, targ):
    return _oom(pred, targ)


@pytest.mark.parametrize("func, error", [(_oom, torch.OutOfMemoryError), (_dist, torch.distributed.DistBackendError)])
def test_an_error_computing_a_metric_keeps_its_type(func, error):
    learn = _learn(AccumMetric(func))
    with pytest.raises(error, match="^(CUDA out of memory|NCCL)") as e:
        learn.validate()
    assert type(e.value) is error
    assert e.value.__notes__[0].startswith(f"(in metric '{func.__name__}', failed computing its value over the pass: "
                                           f"with pred tensor of shape (32, 2) (torch.float32)")


def test_an_error_on_a_batch_keeps_its_type_and_is_noted_once():
    learn = _learn(out_of_memory)                        # a plain function: accumulated batch by batch
    with pytest.raises(torch.OutOfMemoryError) as e:
        learn.validate()
    notes = e.value.__notes__
    assert sum("in metric 'out_of_memory'" in n for n in notes) == 1
    assert "with pred tensor of shape (16, 2) (torch.float32) and targets (tensor of shape (16,) (torch.int64))" in notes[0]


def test_a_loss_function_out_of_memory_stays_out_of_memory():
    """A batch-size finder catches torch.OutOfMemoryError: a loss_func running out of memory must not become the
    ValueError that a loss not fitting the model's output is."""
    from torch.utils.data import DataLoader, TensorDataset

    def hungry(pred, y):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    x = torch.randn(8, 3)
    learn = Learner(DataLoaders(DataLoader(TensorDataset(x, x[:, :1]), batch_size=4), device="cpu"),
                    nn.Linear(3, 1), loss_func=hungry)
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"), learn.no_bar():
        learn.fit(1)
