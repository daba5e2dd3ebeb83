"""Port of Accelerate's tests/test_state_checkpointing.py on N processes (the import swapped to cadence).

Resuming from save_state gives the weights, Adam state, scheduler and RNG of the uninterrupted run
(under DDP, and under FSDP with its sharded checkpoint);
automatic naming counts checkpoint_<n>; total_limit keeps the newest.
"""

import os
import random
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from cadence import Accelerator, ProjectConfiguration, broadcast, set_seed   # was: from accelerate import ...


class DummyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(1))
        self.b = torch.nn.Parameter(torch.randn(1))

    def forward(self, x):
        return x * self.a + self.b


def dummy_dataloaders(a=2, b=3, batch_size=16, n_train_batches=10):
    x = torch.randn(batch_size * n_train_batches, 1)
    return DataLoader(TensorDataset(x, a * x + b + 0.1 * torch.randn_like(x)), shuffle=True, batch_size=batch_size)


def train(num_epochs, model, dataloader, optimizer, accelerator, scheduler=None):
    rands = []
    for _ in range(num_epochs):
        for x, y in dataloader:
            accelerator.backward(F.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        rands.append(random.random())
        if scheduler is not None:
            scheduler.step()
    return rands


def setup(tmpdir, iteration=0):
    set_seed(42)
    model = DummyModel()
    optimizer = torch.optim.Adam(params=model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.99)
    config = ProjectConfiguration(automatic_checkpoint_naming=True, iteration=iteration)
    accelerator = Accelerator(project_dir=tmpdir, project_config=config)
    return accelerator, *accelerator.prepare(model, optimizer, dummy_dataloaders(), scheduler)


def weights(accelerator, model):
    full = accelerator.get_state_dict(model)    # whole tensors on the main process, under DDP and FSDP alike
    return broadcast((full["a"].item(), full["b"].item()) if accelerator.is_main_process else None)


def opt_state(optimizer):
    """The optimizer state with FSDP's sharded tensors gathered (a collective: every process calls it)."""
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    state = optimizer.state_dict()
    return {**state, "state": {k: {n: full(v) for n, v in s.items()} for k, s in state["state"].items()}}


def same(a, b):
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
               for k in a["state"] for x, y in zip(a["state"][k].values(), b["state"][k].values())) \
        and a["param_groups"] == b["param_groups"]


def test_can_resume_training(tmpdir):
    accelerator, model, optimizer, dl, scheduler = setup(tmpdir)
    accelerator.save_state()
    a, b = weights(accelerator, model)
    ground_truth = train(3, model, dl, optimizer, accelerator, scheduler)
    (a1, b1), opt_state1 = weights(accelerator, model), opt_state(optimizer)

    accelerator, model, optimizer, dl, scheduler = setup(tmpdir, iteration=1)
    accelerator.load_state(os.path.join(tmpdir, "checkpoints", "checkpoint_0"))
    assert weights(accelerator, model) == (a, b)
    test_rands = train(2, model, dl, optimizer, accelerator, scheduler)
    accelerator.save_state()
    accelerator.load_state()            # the newest: checkpoint_1
    test_rands += train(1, model, dl, optimizer, accelerator, scheduler)
    assert weights(accelerator, model) == (a1, b1)
    assert same(opt_state(optimizer), opt_state1) and test_rands == ground_truth
    assert sorted(os.listdir(os.path.join(tmpdir, "checkpoints"))) == ["checkpoint_0", "checkpoint_1"]


def test_checkpoint_deletion(tmpdir):
    set_seed(42)
    accelerator = Accelerator(project_dir=tmpdir, project_config=ProjectConfiguration(
        automatic_checkpoint_naming=True, total_limit=2))
    accelerator.prepare(DummyModel())
    for _ in range(11):
        accelerator.save_state()
    assert sorted(os.listdir(os.path.join(tmpdir, "checkpoints"))) == ["checkpoint_10", "checkpoint_9"]


def main():
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    for i, test in enumerate((test_can_resume_training, test_checkpoint_deletion)):
        test(str(root / f"run{i}"))
