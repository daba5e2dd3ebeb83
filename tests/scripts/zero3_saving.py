"""Launched on 2 processes by tests/callbacks/test_checkpoint_async.py: the same ZeRO-3 training four times, with
no checkpoint, with synchronous saves and with async saves every 2 optimizer steps, and resumed from the async run's
checkpoint of step 6; rank 0 writes each run's final weights to OUT_DIR/<none|sync|async|resumed>.safetensors. The
weights (512 x 512) are above DeepSpeed's persistence threshold (partitioned, gathered in each forward), the biases
below it (kept whole on every rank: a save frees them and puts them back, a resume reads them whole).

argv: OUT_DIR
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import DataLoaders, Learner
from cadence.callbacks.checkpoint import Checkpoint
from cadence.distributed.env import rank

out = Path(sys.argv[1])
for mode in ("none", "sync", "async", "resumed"):
    torch.manual_seed(0)
    x, y = torch.randn(64, 512), torch.randn(64, 512)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=4), device="cpu")
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    learn = Learner(dls, model, loss_func=nn.MSELoss(), opt_func=torch.optim.AdamW, lr=1e-3)
    learn.remove_cb(learn.progress)
    cbs = [] if mode == "none" else [Checkpoint(out / f"ckpt-{mode}", every_n_steps=2, every_epoch=False,
                                                keep_last=2, async_save=mode == "async")]
    with learn.distrib_ctx(strategy="deepspeed", zero_stage=3):
        learn.fit(1, cbs=cbs, resume=out / "ckpt-async" / "step-00000006" if mode == "resumed" else None)
        weights = learn.strategy.model_state_dict(learn.model)
    if rank() == 0:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / f"{mode}.safetensors"))
