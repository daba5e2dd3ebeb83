"""docs/accelerate-parallelism.md's code, whole: `cadence launch --num_processes 4 docs/examples/accelerate_parallelism.py`
(add `--cpu` without GPUs; a few seconds on a CPU, writing export/ under the current directory). The page shows
the section between the `--8<--` markers; tests/test_docs_examples.py launches this file on 4 processes (tp 2 x
dp_shard 2) and checks that the loss went down, every eval sample was gathered once and the export holds the
whole model."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(8, 64), nn.Linear(64, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


torch.manual_seed(0)
x = torch.randn(512, 8)
ds = TensorDataset(x, x[:, :4].argmax(1))   # the class: the largest of the first four features
train_dl, eval_dl = DataLoader(ds, batch_size=32, shuffle=True), DataLoader(TensorDataset(x[:100], ds.tensors[1][:100]), batch_size=16)
model, loss_fn = Net(), nn.CrossEntropyLoss()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

# --8<-- [start:tp]
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from cadence import Accelerator                  # was: from accelerate import Accelerator
from cadence.utils import ParallelismConfig      # was: from accelerate.utils import ParallelismConfig

def parallelize(model, tp_mesh):                 # your tensor-parallel plan, on the "tp" sub-mesh
    parallelize_module(model, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel(),
                                        "head": ColwiseParallel(output_layouts=Replicate())})

accelerator = Accelerator(parallelism_config=ParallelismConfig(tp_size=2, dp_shard_size=2, parallelize=parallelize))
model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
for xb, yb in train_dl:
    loss = loss_fn(model(xb), yb)
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step(); optimizer.zero_grad()
for xb, yb in eval_dl:
    preds, refs = accelerator.gather_for_metrics((model(xb).argmax(-1), yb))   # each sample once
accelerator.save_model(model, "export")          # the full model, in the Hugging Face layout
# --8<-- [end:tp]
losses, correct, seen = [], 0, 0
for xb, yb in train_dl:                          # a second epoch, recording the loss
    loss = loss_fn(model(xb), yb)
    accelerator.backward(loss)
    optimizer.step(); optimizer.zero_grad()
    losses.append(loss.item())
for xb, yb in eval_dl:
    preds, refs = accelerator.gather_for_metrics((model(xb).argmax(-1), yb))
    correct, seen = correct + int((preds == refs).sum()), seen + len(refs)
accelerator.print(f"processes {accelerator.num_processes}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
                  f"eval samples gathered {seen}, accuracy {correct / seen:.3f}")
accelerator.end_training()
