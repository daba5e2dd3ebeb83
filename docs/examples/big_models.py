"""docs/big-models.md's code, whole: `python docs/examples/big_models.py` (a second on a CPU; writes export/ under
the current directory). A small model stands in for a big one, and a small CPU budget for a small machine, so
that some of its blocks go to disk. The page shows the section between the `--8<--` markers;
tests/test_docs_examples.py runs this file and checks the placement and the output."""

import torch
from torch import nn

from cadence import DataLoaders, Learner


class Block(nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(dim), nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class BigModel(nn.Module):
    def __init__(self, vocab: int = 100, dim: int = 64, depth: int = 6):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(*[Block(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)))


torch.manual_seed(0)
trained = BigModel()
Learner(DataLoaders([], [], device="cpu"), trained, loss_func=nn.CrossEntropyLoss()).save_model("export", max_shard_size="40KB")
tokens = torch.randint(0, 100, (2, 8))

# --8<-- [start:dispatch]
from cadence import init_empty_weights, load_checkpoint_and_dispatch
with init_empty_weights():                       # parameters on the meta device: no memory
    model = BigModel()
model = load_checkpoint_and_dispatch(model, "export/", device_map="auto",   # learn.save_model's layout, sharded or not
                                     max_memory={"cpu": "100KB"}, no_split_module_classes=["Block"])   # GPUs first: {0: "20GiB", ...}
model.hf_device_map                              # {'embed': 'cpu', 'blocks.0': 'cpu', ..., 'blocks.4': 'disk', ..., 'head': 'disk'}
# --8<-- [end:dispatch]
print("hf_device_map:", model.hf_device_map)
with torch.no_grad():
    print("output equals the trained model's:", torch.equal(model(tokens), trained(tokens)))
