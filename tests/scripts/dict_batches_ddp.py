"""Launched on 2 processes by tests/trainer/test_dict_batches.py: a Learner on dict batches under distrib_ctx.

A model computing its own loss (loss_func=None), 203 validation items (the last shard padded):
valid_loss, accuracy and get_preds count every item once, as one process over the whole set would.
Prints "DICT OK" on rank 0.
"""

import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from cadence import DataLoaders, Learner, accuracy, rank

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from accelerate_nlp import TinyClassifier, token_data  # noqa: E402

torch.manual_seed(0)
valid = token_data(203, seed=1)
dls = DataLoaders(DataLoader(token_data(256), batch_size=16, shuffle=True), DataLoader(valid, batch_size=32),
                  device="cpu")
learn = Learner(dls, TinyClassifier(), loss_func=None, metrics=accuracy, lr=3e-2)
with learn.distrib_ctx():
    learn.fit(3)
    row = learn.recorder.values[-1]
    preds, targs = learn.get_preds()
model = learn.model.eval()
with torch.no_grad():
    whole = model(**torch.utils.data.default_collate(valid))
labels = torch.stack([d["labels"] for d in valid])
assert abs(row["valid_loss"] - whole.loss.item()) < 1e-5, (row, whole.loss.item())
assert abs(row["accuracy"] - (whole.logits.argmax(1) == labels).float().mean().item()) < 1e-6
assert preds.shape == (203, 2) and torch.equal(targs, labels)
torch.testing.assert_close(preds, whole.logits)
if rank() == 0:
    print("DICT OK", row)
