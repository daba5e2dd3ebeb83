"""Run by tests/accelerate/test_accelerate_parity.py with the real Hugging Face Accelerate (one process, CPU): writes
what cadence must read or match into OUT_DIR.

- checkpoint_safetensors/, checkpoint_bin/: `save_state` of a model, Adam, a StepLR scheduler, a registered object,
  after 3 micro-steps of a 2-step accumulation (so `accelerator.step` is 3), with and without safetensors;
- expected.pt: what those checkpoints hold (weights, optimizer state, last_epoch, the object's state, `step`) and the
  random numbers python, numpy and torch draw right after the save (a loaded run must draw the same);
- model_bin/: `save_model(model, ..., safe_serialization=False, max_shard_size=60)`, sharded;
- gpt2/: `save_state` of a tiny GPT-2 (its embedding and head tied: the safetensors file keeps one name of the two),
  and gpt2_expected.pt its weights;
- reference.json: `accelerator.step` and `sync_gradients` after each `accumulate` block of two epochs over 5 batches
  with gradient_accumulation_steps=2.

    python tests/scripts/accelerate_parity_reference.py OUT_DIR
"""

import json
import random
import sys
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "hf"), str(Path(__file__).resolve().parent.parent)]
from helpers import Counter  # noqa: E402
from tiny_models import tiny_model  # noqa: E402


def model_and_data():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    data = TensorDataset(torch.randn(20, 3), torch.randn(20, 1))
    return model, data


def checkpoints(out: Path) -> None:
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, data = model_and_data()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    model, opt, dl, sched = acc.prepare(model, opt, DataLoader(data, batch_size=4, shuffle=True), sched)
    for i, (x, y) in enumerate(dl):
        if i == 3:
            break
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
            counter.n += 1
    acc.save_state(out / "checkpoint_safetensors", safe_serialization=True)
    acc.save_state(out / "checkpoint_bin", safe_serialization=False)
    acc.save_model(model, out / "model_bin", max_shard_size=60, safe_serialization=False)
    expected = {"model": model.state_dict(), "optimizer": opt.state_dict(), "last_epoch": sched.scheduler.last_epoch,
                "counter": counter.n, "step": acc.step}
    expected["draws"] = {"python": random.random(), "numpy": float(np.random.rand()), "torch": torch.rand(3)}
    torch.save(expected, out / "expected.pt")


def tied_checkpoint(out: Path) -> None:
    acc = Accelerator(cpu=True)
    model = acc.prepare(tiny_model("gpt2"))
    with torch.no_grad():
        model.transformer.wte.weight.add_(1.0)   # other weights than a fresh model's
    acc.save_state(out / "gpt2", safe_serialization=True)
    torch.save(model.state_dict(), out / "gpt2_expected.pt")


def accumulation_steps() -> list:
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, data = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, dl = acc.prepare(model, opt, DataLoader(TensorDataset(*data[:10]), batch_size=2))
    seen = []
    for _ in range(2):
        for x, y in dl:
            with acc.accumulate(model):
                acc.backward(torch.nn.functional.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
            seen.append([acc.step, acc.sync_gradients])
    return seen


if __name__ == "__main__":
    out = Path(sys.argv[1])
    checkpoints(out)
    tied_checkpoint(out)
    (out / "reference.json").write_text(json.dumps({"accumulation_steps": accumulation_steps()}))
