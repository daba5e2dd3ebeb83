"""Launched by tests/distributed/test_lr_find_engines.py: `lr_find_engines.py STRATEGY [ZERO_STAGE] OUT`.

Under the engine, on every process: `lr_find` suggests a rate and puts the weights and optimizer state back, so a
`fit(1)` after it ends with the weights of the same `fit(1)` without it (the model and optimizer stepped once
before, so there are moments to restore); `models/_lr_find` (where DeepSpeed keeps its state for the sweep) is
gone after. Rank 0 writes both runs' final weights (gathered to full tensors) to OUT.
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import DataLoaders, Learner
from cadence.distributed.env import rank

strategy, *stage, out = sys.argv[1:]
kwargs = {"zero_stage": int(stage[0])} if stage else {}


def trained(sweep: bool, path: Path) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 8, generator=g)
    y = x @ torch.randn(8, 2, generator=g)
    ds = TensorDataset(x, y)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    learn = Learner(DataLoaders(DataLoader(ds, batch_size=8), DataLoader(ds, batch_size=8), device="cpu"), model,
                    loss_func=nn.MSELoss(), lr=1e-2, path=path)
    with learn.no_bar(), learn.no_logging(), learn.distrib_ctx(strategy=strategy, **kwargs):
        learn.fit(1)
        if sweep:
            found = learn.lr_find(num_it=20, show_plot=False)
            assert 0 < found.valley < 10, found
            assert rank() != 0 or not (path / "models" / "_lr_find").exists()   # the main process removes it
            print(f"SWEPT rank {rank()}", flush=True)
        learn.fit(1)
        state = learn.strategy.model_state_dict(learn.model)   # every rank: a gather under the sharding engines
    return {k: v.detach().clone().contiguous() for k, v in state.items()}


root = Path(out).parent
plain, swept = trained(False, root / "plain"), trained(True, root / "swept")
if rank() == 0:
    save_file({**{f"plain.{k}": v for k, v in plain.items()}, **{f"swept.{k}": v for k, v in swept.items()}}, out)
