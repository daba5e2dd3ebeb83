"""docs/fsdp.md's code, whole: `cadence launch --num_processes 2 docs/examples/fsdp.py` (add `--cpu` without
GPUs; a few seconds on a CPU, writing export/ under the current directory). The page shows the section between
the `--8<--` markers; tests/test_docs_examples.py launches this file on 2 processes and checks what the page says:
the loss went down, the module is plain again after the context, and save_model's weights load into it."""

import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

from cadence import DataLoaders, Learner, rank, world_size


class Block(nn.Module):
    def __init__(self, dim: int = 32):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(dim), nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.relu(self.fc(self.norm(x)))


torch.manual_seed(0)
x = torch.randn(512, 8)
ds = TensorDataset(x, x[:, :2].sum(1, keepdim=True))   # regress x0 + x1
model = nn.Sequential(nn.Linear(8, 32), Block(), Block(), nn.Linear(32, 1))
learn = Learner(DataLoaders.from_dsets(ds, ds, bs=32), model, loss_func=nn.MSELoss())

# --8<-- [start:fsdp]
with learn.distrib_ctx(strategy="fsdp", transformer_layer_cls_to_wrap="Block"):   # one FSDP group per Block
    learn.fit_one_cycle(3, 1e-3)
# --8<-- [end:fsdp]
    learn.save_model("export")                 # every rank calls it: full fp32 weights
losses = [v["valid_loss"] for v in learn.recorder.values]   # per epoch
print(f"rank {rank()} of {world_size()}: valid loss per epoch {[round(v, 4) for v in losses]}")
plain = type(learn.model) is nn.Sequential and not any(hasattr(p, "to_local") for p in learn.model.parameters())
saved = load_file("export/model.safetensors")
print(f"rank {rank()}: plain module after the context {plain}, export loads into it "
      f"{all(torch.equal(saved[k], v) for k, v in learn.model.state_dict().items())}")
