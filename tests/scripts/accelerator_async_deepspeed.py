"""Accelerator.save_state under DeepSpeed ZeRO, synchronous then `async_save=True` at the same step, then one more
step (the background write made 0.5 s late) before `end_training` finishes the async write: both checkpoints
must hold the same files, byte for byte.

  accelerator_async_deepspeed.py OUT STAGE
Prints `FILES <json list of the files>` and `DIFFERENT <json list of those whose bytes differ>` on rank 0.
"""

import json
import sys
import threading
import time
from pathlib import Path

import torch

from cadence import Accelerator
from cadence.accelerate import DeepSpeedPlugin


def slow_background_writes(delay: float) -> None:
    """torch.save into a file from a thread other than the main one (the background writer) starts `delay` s late:
    the step after the async save_state runs while its files are still to be written."""
    save = torch.save

    def slow(obj, f, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(delay)
        return save(obj, f, *args, **kwargs)
    torch.save = slow


def main():
    slow_background_writes(0.5)
    out, stage = Path(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(0)
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=stage))
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 4))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 64)), batch_size=8)
    model, opt, data = acc.prepare(net, torch.optim.AdamW(net.parameters(), lr=0.1), data)
    batches = iter(data)

    def step():
        acc.backward(model(next(batches)[0]).square().mean())
        opt.step()
        opt.zero_grad()
    step()
    acc.save_state(out / "sync")
    acc.save_state(out / "async", async_save=True)
    step()  # training goes on while the async checkpoint is written: it keeps the state of its own step
    acc.end_training()
    if acc.is_main_process:
        files = sorted(str(p.relative_to(out / "sync")) for p in (out / "sync").rglob("*") if p.is_file())
        assert files == sorted(str(p.relative_to(out / "async")) for p in (out / "async").rglob("*") if p.is_file())
        print("FILES", json.dumps(files))
        print("DIFFERENT", json.dumps([f for f in files if (out / "sync" / f).read_bytes() !=
                                       (out / "async" / f).read_bytes()]))


if __name__ == "__main__":
    main()
