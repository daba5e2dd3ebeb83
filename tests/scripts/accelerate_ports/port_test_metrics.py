"""Port of the download-free checks of Accelerate's external_deps/test_metrics.py (the import swapped to cadence).

gather_for_metrics with an uneven last batch: every sample exactly once, in dataset order.
"""

import copy

import torch
from torch.utils.data import DataLoader, IterableDataset

from cadence import Accelerator, set_seed   # was: from accelerate import Accelerator
from regression import RegressionDataset, RegressionModel


def test_torch_metrics(num_samples=82, batch_size=16):
    accelerator = Accelerator()
    set_seed(42)
    model = RegressionModel(a=1, b=1)
    baseline = copy.deepcopy(model)
    dset = RegressionDataset(length=num_samples, seed=0)   # seeded: the same data on every process
    ddp_model, dl = accelerator.prepare(model, DataLoader(dset, batch_size=batch_size))
    logits, targs = [], []
    for batch in dl:
        with torch.no_grad():
            logit, targ = accelerator.gather_for_metrics((ddp_model(batch["x"]), batch["y"]))
        logits.append(logit)
        targs.append(targ)
    logits, targs = torch.cat(logits), torch.cat(targs)
    assert len(logits) == num_samples, f"expected {num_samples} predictions, got {len(logits)}"
    # every sample exactly once, in the dataset's order (the loader's batches are dealt to the processes in turn)
    torch.testing.assert_close(targs, torch.from_numpy(dset.y))
    torch.testing.assert_close(logits, baseline(torch.from_numpy(dset.x)).detach())


class DummyIterableDataset(IterableDataset):
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __iter__(self):
        yield from self.data


def test_gather_for_metrics_with_iterable_dataset():
    accelerator = Accelerator()
    dl = accelerator.prepare(DataLoader(DummyIterableDataset(torch.as_tensor(range(30))), batch_size=4))
    got = torch.cat([accelerator.gather_for_metrics(batch) for batch in dl])
    assert sorted(got.tolist()) == list(range(30))


def test_gather_for_metrics_with_non_tensor_objects():
    accelerator = Accelerator()
    words = [f"w{i}" for i in range(11)]
    dl = accelerator.prepare(DataLoader(words, batch_size=4))
    got = [w for batch in dl for w in accelerator.gather_for_metrics(batch)]
    assert sorted(got) == sorted(words) and len(got) == 11


def test_gather_for_metrics_drop_last():
    accelerator = Accelerator()
    per_device_batch_size = 5
    num_items = (10 * accelerator.num_processes) + 1
    dl = accelerator.prepare(DataLoader(range(num_items), batch_size=per_device_batch_size, drop_last=True))
    iterator = iter(dl)
    next(iterator)
    gathered = accelerator.gather_for_metrics(next(iterator))
    assert gathered.size(0) == per_device_batch_size * accelerator.num_processes


def main():
    test_torch_metrics()
    test_torch_metrics(num_samples=99, batch_size=4)
    test_gather_for_metrics_with_iterable_dataset()
    test_gather_for_metrics_with_non_tensor_objects()
    test_gather_for_metrics_drop_last()
