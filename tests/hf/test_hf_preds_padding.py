"""`get_preds` of a tiny Llama on batches padded each to its own longest sequence (transformers' data collators):
every item's logits, labels and inputs, in data set order, padded to the longest with -100 (transformers' Trainer's
`padding_index`), on 1 process and on 2 under DDP. Expected logits: the model run on each item alone, unpadded."""

import sys
from pathlib import Path

import pytest
import torch

from torch.utils.data import DataLoader

from cadence import DistributedDL
from tests.helpers import run_launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from hf_preds_padding import BS, LENGTHS, items, learner  # noqa: E402

LONGEST = max(LENGTHS)


def batch_lengths(world: int) -> dict[int, int]:
    """How far the collate padded each item: the longest of its batch, in its process's shard (the last shard ends
    with a repeat of item 0: padding the loader drops, whose length counted in the collate)."""
    out: dict[int, int] = {}
    for r in range(world):
        idxs = DistributedDL(DataLoader(range(len(LENGTHS)), batch_size=BS), rank=r, world_size=world).get_idxs()
        for s in range(0, len(idxs), BS):
            for i in idxs[s:s + BS]:
                out.setdefault(i, max(LENGTHS[j] for j in idxs[s:s + BS]))
    return out


def check(model: torch.nn.Module, inputs: dict, preds: torch.Tensor, targs: torch.Tensor, pad: int = -100,
          world: int = 1):
    assert preds.shape == (len(LENGTHS), LONGEST, model.config.vocab_size) and targs.shape == (len(LENGTHS), LONGEST)
    model.eval()
    lengths = batch_lengths(world)
    assert len(set(lengths.values())) > 2           # the batches were padded to different lengths
    for i, ids in enumerate(items()):
        n, b = len(ids), lengths[i]
        with torch.no_grad():
            alone = model(input_ids=ids[None]).logits[0]
        torch.testing.assert_close(preds[i, :n], alone, atol=1e-5, rtol=1e-5)
        assert (preds[i, b:] == pad).all()                                    # after its batch's length
        assert torch.equal(targs[i, :n], ids) and (targs[i, n:b] == -100).all() and (targs[i, b:] == pad).all()
        assert torch.equal(inputs["input_ids"][i, :n], ids) and (inputs["input_ids"][i, n:b] == 0).all()
        assert torch.equal(inputs["attention_mask"][i, :b], (torch.arange(b) < n).long())
        assert (inputs["input_ids"][i, b:] == pad).all()


def test_get_preds_pads_batches_of_different_lengths():
    learn = learner()
    inputs, preds, targs = learn.get_preds(with_input=True)
    check(learn.model, inputs, preds, targs)


def test_get_preds_pad_index():
    learn = learner()
    inputs, preds, targs = learn.get_preds(with_input=True, pad_index=0)
    check(learn.model, inputs, preds, targs, pad=0)


@pytest.mark.timeout(300)
def test_get_preds_pads_across_processes(tmp_path):
    out = tmp_path / "preds.pt"
    run_launch("hf_preds_padding.py", out, timeout=240)
    inputs, preds, targs = torch.load(out)
    learn = learner()                          # the same untrained weights (seed 0)
    check(learn.model, inputs, preds, targs, world=2)
