"""Launched on 2 processes by tests/callbacks/test_checkpoint_async.py: the same ZeRO-3 training with no
checkpoint, with synchronous saves and with async saves every 2 optimizer steps, resumed from the async run's
checkpoint of step 6, and, with the persistent parameters over `PERSISTENT_MAX_BYTES` (set to 0), saved and resumed
from step 6 again; rank 0 writes each run's final weights to OUT_DIR/<run>.safetensors. The weights (512 x 512) are
above DeepSpeed's persistence threshold (partitioned, gathered in each forward), the biases below it (kept whole on
every rank: a save frees them and puts them back, a resume reads them whole from the rank's own file, or, over the
limit, gathers them from the partitions as DeepSpeed's own load does). Every rank prints `<run> LOAD COLLECTIVES <n>`
for the resumed runs.

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
from cadence.distributed import deepspeed_checkpoint
from cadence.distributed.env import rank

from async_checkpoint import count_collectives  # tests/scripts/async_checkpoint.py

out = Path(sys.argv[1])
collectives = count_collectives()
RUNS = {"none": (None, None), "sync": ("sync", None), "async": ("async", None), "resumed": ("async", "async"),
        "capped": ("async", None), "capped-resumed": ("async", "capped")}  # run: (its saves, the run it resumes)
for run, (saves, resumes) in RUNS.items():
    torch.manual_seed(0)
    x, y = torch.randn(64, 512), torch.randn(64, 512)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=4), device="cpu")
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    learn = Learner(dls, model, loss_func=nn.MSELoss(), opt_func=torch.optim.AdamW, lr=1e-3)
    learn.remove_cb(learn.progress)
    cbs = [] if saves is None else [Checkpoint(out / f"ckpt-{run}", every_n_steps=2, every_epoch=False, keep_last=2,
                                               async_save=saves == "async")]
    deepspeed_checkpoint.PERSISTENT_MAX_BYTES = 0 if run.startswith("capped") else 64 * 2**20
    collectives["load"] = 0
    with learn.distrib_ctx(strategy="deepspeed", zero_stage=3):
        learn.fit(1, cbs=cbs, resume=out / f"ckpt-{resumes}" / "step-00000006" if resumes else None)
        weights = learn.strategy.model_state_dict(learn.model)
    if resumes:
        print(f"{run} LOAD COLLECTIVES {collectives['load']}", flush=True)
    if rank() == 0:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / f"{run}.safetensors"))
