"""Launched on 2 processes with `cadence launch --dynamo_backend aot_eager [--use_fsdp]` by tests/test_compile.py.

The Learner compiles because the launcher said so (no compile= in this script). Checks, one
`CHECK <name> ok` line each on rank 0:
- under distrib_ctx the user's module is compiled, a DDP wrapper around it is not (FSDP2 shards the
  module in place: it is both), and dynamo captured graphs of the nn.Sequential while training;
- after training both ranks compute the same output for the same input;
- after distrib_ctx the plain module is compiled again;
- learn.save writes the plain module's keys (no `_orig_mod.`, no `module.`).
"""

import json
import os
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from torch._dynamo.utils import counters

from cadence import DataLoaders, Learner, gather
from cadence.compile import is_compiled
from cadence.distributed.env import rank
from toy import classification

out = Path(sys.argv[1])
x, y = classification(64, features=8)
dls = DataLoaders(DataLoader(TensorDataset(x[:48], y[:48]), batch_size=8),
                  DataLoader(TensorDataset(x[48:], y[48:]), batch_size=8), device="cpu")
torch.manual_seed(0)
learn = Learner(dls, nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), loss_func=nn.CrossEntropyLoss(),
                path=out, lr=1e-2)
assert learn.compile_options["backend"] == "aot_eager", learn.compile_options


def check(name: str, ok: bool) -> None:
    if not ok:
        raise AssertionError(f"check failed: {name}")
    if rank() == 0:
        print(f"CHECK {name} ok", flush=True)


with learn.distrib_ctx():
    inner = learn.strategy.unwrap(learn.model)
    wrapper_ok = learn.model is inner if os.environ["CADENCE_STRATEGY"] == "fsdp" else (
        isinstance(learn.model, DistributedDataParallel) and not is_compiled(learn.model))
    check("module inside the wrapper compiled", wrapper_ok and is_compiled(inner))
    learn.fit(2)
    check("graphs captured", counters["stats"]["unique_graphs"] > 0)
    with torch.no_grad():
        out_here = learn.model(x[:4])              # every rank runs the same input through its copy / shards
    both = gather(out_here[None])
    check("ranks agree", torch.equal(both[0], both[1]))
check("plain module compiled after", is_compiled(learn.model) and not hasattr(learn.model, "module"))
file = learn.save("compiled", with_opt=False)
if rank() == 0:
    files = sorted(file.rglob("*.safetensors")) if file.is_dir() else [file]   # learn.save: a file or a directory
    keys = []
    for one in files:
        with safe_open(str(one), framework="pt") as f:
            keys += list(f.keys())
    keys = sorted(keys)
    check("saved keys", keys == sorted(["0.weight", "0.bias", "2.weight", "2.bias"]))
    (out / "result.json").write_text(json.dumps({"keys": keys}))
