"""`get_preds` on batches padded each to its own length: joined padded to the longest with `pad_index` (-100 by
default), along every dim but the batch's, with `concat_dim=1` (sequence-first outputs) too; per-item losses as well.
Expected values: the model run on each item alone."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from cadence import DataLoaders, Learner

LENGTHS = [2, 5, 3, 3, 4, 7, 1]     # batches of 3: padded to 5, 7 and 1


def tagger() -> nn.Module:
    """Per-token class scores in the tokens' layout: (bs, len, 3), or (len, bs, 3) for sequence-first tokens."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3))


def loss(pred, y, reduction="mean"):
    out = nn.functional.cross_entropy(pred.reshape(-1, 3), y.reshape(-1), reduction=reduction)
    return out.view(y.shape) if reduction == "none" else out


def learner(seq_first: bool = False) -> Learner:
    g = torch.Generator().manual_seed(0)
    items = [(torch.randint(0, 10, (n,), generator=g), torch.randint(0, 3, (n,), generator=g)) for n in LENGTHS]

    def collate(rows):
        n = max(len(x) for x, _ in rows)
        xs, ys = torch.zeros(len(rows), n, dtype=torch.long), torch.zeros(len(rows), n, dtype=torch.long)
        for i, (x, y) in enumerate(rows):
            xs[i, :len(x)], ys[i, :len(y)] = x, y
        return (xs.T, ys.T) if seq_first else (xs, ys)
    dl = DataLoader(items, batch_size=3, collate_fn=collate)
    learn = Learner(DataLoaders(dl, dl, device="cpu"), tagger(), loss_func=None if seq_first else loss)
    learn.remove_cb(learn.progress)
    learn.items = items
    return learn


def batch_length(i: int) -> int:
    return max(LENGTHS[i // 3 * 3:i // 3 * 3 + 3])


@pytest.mark.parametrize("pad", [None, 0])
def test_batches_of_different_lengths_padded_to_the_longest(pad):
    learn = learner()
    kw = {} if pad is None else {"pad_index": pad}
    inputs, preds, targs, losses = learn.get_preds(with_input=True, with_loss=True, **kw)
    pad = -100 if pad is None else pad
    assert preds.shape == (7, 7, 3) and targs.shape == inputs.shape == losses.shape == (7, 7)
    for i, (x, y) in enumerate(learn.items):
        n, b = len(x), batch_length(i)
        with torch.no_grad():
            alone = learn.model(x[None])[0]
        assert torch.allclose(preds[i, :n], alone) and torch.equal(inputs[i, :n], x) and torch.equal(targs[i, :n], y)
        assert torch.allclose(losses[i, :n], nn.functional.cross_entropy(alone, y, reduction="none"))
        for t in (preds, targs, inputs, losses):
            assert (t[i, b:] == pad).all()


def test_sequence_first_outputs_padded_along_the_sequence():
    learn = learner(seq_first=True)
    preds, targs = learn.get_preds(concat_dim=1)
    assert preds.shape == (7, 7, 3) and targs.shape == (7, 7)          # (longest, items, classes)
    for i, (x, y) in enumerate(learn.items):
        with torch.no_grad():
            alone = learn.model(x[:, None])[:, 0]
        assert torch.allclose(preds[:len(x), i], alone) and torch.equal(targs[:len(x), i], y)
        assert (preds[batch_length(i):, i] == -100).all() and (targs[batch_length(i):, i] == -100).all()
