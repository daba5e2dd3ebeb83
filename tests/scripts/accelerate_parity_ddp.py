"""Launched on 2 processes by tests/accelerate/test_accelerate_parity.py: Accelerate's behaviour that depends on the
processes, each expected value written by hand from Accelerate 1.15's code; prints "ok <check>" per check.

- get_state_dict(model, unwrap=False) is the DDP wrapper's state dict: `module.` before every name; unwrap=True not;
- a prepared loader's total_batch_size is batch_size * 2 (batch_size itself with split_batches), its
  total_dataset_length the whole dataset's;
- save_model(..., safe_serialization=False) on 2 processes: the main process writes pytorch_model.bin, every process
  reads the same weights back after `wait_for_everyone`.

    cadence launch --cpu --num_processes 2 tests/scripts/accelerate_parity_ddp.py TMPDIR
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from cadence import Accelerator


def ok(check: str) -> None:
    if dist.get_rank() == 0:
        print("ok", check, flush=True)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))


def unwrap_false() -> None:
    acc = Accelerator(cpu=True)
    prepared = acc.prepare(model())
    wrapped, plain = acc.get_state_dict(prepared, unwrap=False), acc.get_state_dict(prepared)
    assert list(wrapped) == ["module.0.weight", "module.0.bias", "module.2.weight", "module.2.bias"], list(wrapped)
    assert list(plain) == ["0.weight", "0.bias", "2.weight", "2.bias"], list(plain)
    assert all(torch.equal(wrapped[f"module.{k}"], v) for k, v in plain.items())
    ok("get_state_dict unwrap=False")


def total_batch_size() -> None:
    dl = Accelerator(cpu=True).prepare(DataLoader(range(20), batch_size=4))
    assert (dl.total_batch_size, dl.total_dataset_length, len(dl)) == (8, 20, 3), \
        (dl.total_batch_size, dl.total_dataset_length, len(dl))
    split = Accelerator(cpu=True, split_batches=True).prepare(DataLoader(range(20), batch_size=4))
    assert (split.total_batch_size, split.total_dataset_length, split.batch_size) == (4, 20, 2), \
        (split.total_batch_size, split.total_dataset_length, split.batch_size)
    ok("total_batch_size")


def save_model_bin(directory: Path) -> None:
    acc = Accelerator(cpu=True)
    prepared = acc.prepare(model())
    acc.save_model(prepared, directory, safe_serialization=False)
    acc.wait_for_everyone()   # as in Accelerate, save_model waits for no other process
    assert sorted(p.name for p in directory.iterdir()) == ["pytorch_model.bin"]
    loaded = torch.load(directory / "pytorch_model.bin", weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in model().state_dict().items())
    ok("save_model bin")


if __name__ == "__main__":
    unwrap_false()
    total_batch_size()
    save_model_bin(Path(sys.argv[1]) / "export")
