"""Launched on 2 processes by tests/hf/test_hf_preds_padding.py: `get_preds` of a tiny Llama under DDP on batches
padded each to its own longest sequence (the ranks' last batches too). Also imported there for its data.

argv: OUT_FILE. Rank 0 saves (inputs, preds, targs) to it.
"""

import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf"))
from tiny_models import VOCAB, tiny_model  # noqa: E402

from cadence import DataLoaders, Learner, rank  # noqa: E402

LENGTHS = [5, 3, 9, 4, 6, 6, 8, 3, 7, 5, 12]   # 11 items: batches of 4 end with a batch of 3; one item of 12 tokens
BS = 4


def items() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in LENGTHS]


def collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' DataCollatorForTokenClassification: each batch padded to its longest; labels with -100."""
    n = max(len(r) for r in rows)
    ids, mask = torch.zeros(len(rows), n, dtype=torch.long), torch.zeros(len(rows), n, dtype=torch.long)
    labels = torch.full((len(rows), n), -100)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)], labels[i, :len(r)] = r, 1, r
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def learner() -> Learner:
    dl = DataLoader(items(), batch_size=BS, collate_fn=collate)
    learn = Learner(DataLoaders(dl, dl, device="cpu"), tiny_model("llama"), loss_func=None)
    learn.remove_cb(learn.progress)
    return learn


if __name__ == "__main__":
    learn = learner()
    with learn.distrib_ctx(strategy="ddp"):
        inputs, preds, targs = learn.get_preds(with_input=True)
    if rank() == 0:
        torch.save((inputs, preds, targs), sys.argv[1])
