"""docs/model-parallel.md's and docs/tensor-parallel.md's tensor-parallel code, whole: `cadence launch
--num_processes 2 docs/examples/model_parallel.py` (add `--cpu` without GPUs; a few seconds on a CPU). An MLP
sliced by your own plan, then a tiny Llama (built from a config, no download) by its own. The pages show the
sections between the `--8<--` markers; tests/test_docs_examples.py launches this file on 2 processes and checks
that both trained and that each rank holds the whole trained model after the context."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

from cadence import DataLoaders, Learner, rank


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 64), nn.Linear(64, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def motifs(n: int, seed: int) -> list[dict]:
    """Sequences of 16 tokens repeating a random 4-token motif."""
    ids = torch.randint(0, 128, (n, 4), generator=torch.Generator().manual_seed(seed)).repeat(1, 4)
    return [{"input_ids": row, "labels": row} for row in ids]


def losses(learn, kind: str) -> list[float]:
    return [round(v[kind], 4) for v in learn.recorder.values]


torch.manual_seed(0)
x = torch.randn(512, 8)
ds = TensorDataset(x, x[:, :2].sum(1, keepdim=True))   # regress x0 + x1
learn = Learner(DataLoaders.from_dsets(ds, ds, bs=32), MLP(), loss_func=nn.MSELoss(), lr=1e-2)

# --8<-- [start:tp]
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

def parallelize(model, tp_mesh):                         # how the layers are sliced (torch's DTensor styles)
    parallelize_module(model, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})

with learn.distrib_ctx(strategy="model_parallel", tp_size=2, parallelize=parallelize):   # dp = processes / tp_size
    learn.fit(3)
# --8<-- [end:tp]
mlp = losses(learn, "valid_loss")
whole = all(not hasattr(p, "to_local") and p.shape == q.shape
            for p, q in zip(learn.model.parameters(), MLP().parameters()))
llama = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=64))
learn = Learner(DataLoaders(DataLoader(motifs(64, 1), batch_size=8), DataLoader(motifs(16, 2), batch_size=8)),
                llama, loss_func=None, lr=1e-2)
# --8<-- [start:tp_hf]
with learn.distrib_ctx(strategy="model_parallel", tp_size=2):   # a Hugging Face Llama/Mistral/Qwen: its own tp plan
    learn.fit(3)
# --8<-- [end:tp_hf]
print(f"rank {rank()}: MLP valid loss per epoch {mlp}, whole after the context {whole}; "
      f"Llama train loss per epoch {losses(learn, 'train_loss')}")
