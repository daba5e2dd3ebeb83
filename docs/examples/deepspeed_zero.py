"""docs/deepspeed.md's code, whole: `cadence launch --num_processes 2 docs/examples/deepspeed_zero.py` (add `--cpu`
without GPUs; DeepSpeed installed; writes ds_config.json under the current directory; on a CPU, unless `make
setup-deepspeed` built them, the first run compiles DeepSpeed's CPU Adam (the offload) and CPU FusedAdam (the
config's AdamW), ~100 s each, cached after). The page shows the section between the `--8<--` markers;
tests/test_docs_examples.py launches this file on 2 processes and checks the loss went down in both contexts."""

import json

import torch
from torch import nn
from torch.utils.data import TensorDataset

from cadence import DataLoaders, Learner, rank

torch.manual_seed(0)
x = torch.randn(512, 8)
ds = TensorDataset(x, x[:, :2].sum(1, keepdim=True))   # regress x0 + x1
learn = Learner(DataLoaders.from_dsets(ds, ds, bs=32), nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)),
                loss_func=nn.MSELoss())
with open("ds_config.json", "w") as f:   # DeepSpeed's own config; "auto" is filled from the Learner
    json.dump({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
               "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, f)

# --8<-- [start:zero3]
with learn.distrib_ctx(strategy="deepspeed", zero_stage=3, offload_optimizer_device="cpu"):
    learn.fit_one_cycle(3, 1e-3)
# --8<-- [end:zero3]
    zero3 = [v["valid_loss"] for v in learn.recorder.values]
# --8<-- [start:config]
with learn.distrib_ctx(strategy="deepspeed", config="ds_config.json"):   # DeepSpeed's own JSON, "auto" values allowed
    learn.fit(3)
# --8<-- [end:config]
    config = [v["valid_loss"] for v in learn.recorder.values]
if rank() == 0:
    print(f"valid loss per epoch: ZeRO-3 with CPU offload {[round(v, 4) for v in zero3]}, "
          f"ds_config.json {[round(v, 4) for v in config]}")
