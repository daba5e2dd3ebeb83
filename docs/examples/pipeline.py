"""docs/model-parallel.md's pipeline code, whole: `cadence launch --num_processes 2 docs/examples/pipeline.py` (add
`--cpu` without GPUs; a few seconds on a CPU). A tiny token classifier cut into 2 stages, once at a named child and
once by a `split` function. The page shows the sections between the `--8<--` markers; tests/test_docs_examples.py
launches this file on 2 processes and checks that both cuts trained."""

import torch
from torch import nn
from torch.utils.data import TensorDataset

from cadence import DataLoaders, Learner, accuracy, rank


class Block(nn.Module):
    def __init__(self, dim: int = 32):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(dim), nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.relu(self.fc(self.norm(x)))


class MyStage(nn.Module):
    """Stage `stage` of `num_stages`: an equal share of the model's children, under names of its own."""
    def __init__(self, model, stage, num_stages):
        super().__init__()
        children = list(model)
        share = -(-len(children) // num_stages)
        self.layers = nn.ModuleList(children[stage * share:(stage + 1) * share])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def make_learner(model) -> Learner:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (256, 4), generator=g)
    ds = TensorDataset(tokens, tokens[:, 0] % 4)   # the class: the first token mod 4
    return Learner(DataLoaders.from_dsets(ds, ds, bs=16), model, loss_func=nn.CrossEntropyLoss(), metrics=accuracy,
                   lr=3e-3)


def losses(learn) -> list[float]:
    return [round(v["train_loss"], 4) for v in learn.recorder.values]


torch.manual_seed(0)
embed, blocks = nn.Sequential(nn.Embedding(16, 32), nn.Flatten()), [nn.Linear(128, 32)] + [Block() for _ in range(6)]
norm, head = nn.LayerNorm(32), nn.Linear(32, 4)
# --8<-- [start:pp]
model = nn.Sequential(embed, *blocks, norm, head)
# --8<-- [end:pp]
learn = make_learner(model)
# --8<-- [start:pp_fit]
with learn.distrib_ctx(strategy="model_parallel", pp_size=2, pp_schedule="1F1B", pp_microbatches=4,
                       pp_split_points=["5"]):     # stage 1 begins at the child named "5"
    learn.fit(3)
# --8<-- [end:pp_fit]
named = losses(learn)
learn = make_learner(nn.Sequential(embed, *blocks, norm, head))
# --8<-- [start:pp_split]

def split(model, stage, num_stages):              # any model: return the module of `stage`
    return MyStage(model, stage, num_stages)      # its forward takes the previous stage's output
with learn.distrib_ctx(strategy="model_parallel", pp_size=2, split=split):
    learn.fit(3)
# --8<-- [end:pp_split]
print(f"rank {rank()}: train loss per epoch, cut at '5' {named}, cut by split {losses(learn)}")
