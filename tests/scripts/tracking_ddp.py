"""Launched on 2 processes by tests/callbacks/test_tracking.py: `tracking_ddp.py OUT_DIR`.

Trains under distrib_ctx with TensorBoard, W&B (offline) and CSV trackers writing under OUT_DIR;
rank 0 writes what the Recorder holds to OUT_DIR/result.json, other ranks write nothing.
"""

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import DataLoaders, Learner, accuracy
from cadence.callbacks.tracking import Tracker
from cadence.distributed.env import rank


def main(out: Path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64 + 37, 6, generator=g)
    y = (x @ torch.randn(6, 3, generator=g)).argmax(1)
    dls = DataLoaders(DataLoader(TensorDataset(x[:64], y[:64]), batch_size=8),
                      DataLoader(TensorDataset(x[64:], y[64:]), batch_size=8), device="cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    tracker = Tracker(["tensorboard", "wandb", "csv"], project="ddp", run_name="r", dir=out, config={"script": "ddp"})
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=accuracy, lr=1e-2, cbs=tracker)
    with learn.distrib_ctx():
        learn.fit(2)
    if rank() == 0:
        result = {"values": [row.as_dict() for row in learn.recorder.values], "losses": learn.recorder.raw_losses, "step": learn.step,
                  "state": tracker.state_dict()}
        (out / "result.json").write_text(json.dumps(result))
    else:
        assert tracker.state_dict() == {"trackers": {"tensorboard": {}, "wandb": {}, "csv": {}}}


if __name__ == "__main__":
    main(Path(sys.argv[1]))
