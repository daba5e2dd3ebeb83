"""`get_preds` of a Hugging Face model trained with a loss_func: its predictions are the logits (as under
loss_func=None), and outputs or batches holding leaves that are not tensors (a key/value cache, strings) are
come back as None, their keys kept (every process gathers the same structure)."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import DataLoaders, Learner

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128))


def _lm_loss(pred, labels):
    return nn.functional.cross_entropy(pred.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def test_get_preds_of_a_causal_lm_with_a_loss_func_gives_its_logits_like_loss_func_none():
    ids = torch.randint(0, 128, (12, 8), generator=torch.Generator().manual_seed(1))
    ds = TensorDataset(ids, ids)
    dls = DataLoaders(DataLoader(ds, batch_size=8), DataLoader(ds, batch_size=8), device="cpu")
    learn = Learner(dls, _llama(), loss_func=_lm_loss)
    learn.remove_cb(learn.progress)
    learn.fit(1)
    preds, targs = learn.get_preds()   # the output holds a DynamicCache (past_key_values): not gathered
    learn.model.eval()
    with torch.no_grad():
        expected = learn.model(ids).logits
    assert isinstance(preds, torch.Tensor) and torch.allclose(preds, expected, atol=1e-5)
    assert torch.equal(targs, ids)
    inputs, preds, targs = learn.get_preds(with_input=True, act=lambda t: t.softmax(-1))
    assert torch.equal(inputs, ids) and torch.allclose(preds, expected.softmax(-1), atol=1e-5)

    dict_dls = DataLoaders(DataLoader([{"input_ids": r, "labels": r} for r in ids], batch_size=8), device="cpu")
    plain = Learner(dict_dls, learn.model, loss_func=None)       # the model's own loss: the same logits
    assert torch.allclose(plain.get_preds(ds_idx=0)[0], expected, atol=1e-5)


class _WithCache(nn.Module):
    """A model whose output holds leaves that are not tensors: a cache object and a string."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        y = self.lin(x)
        return {"out": y, "cache": object(), "note": "x", "pair": (y * 2, None)}


def test_gathering_leaves_out_leaves_that_are_not_tensors_in_outputs_and_batches():
    x = torch.randn(10, 4)
    items = [{"x": row, "text": f"item {i}", "labels": i} for i, row in enumerate(x)]   # collated: a list of strings per batch

    class Model(_WithCache):
        def forward(self, x, text):
            return super().forward(x)

    dls = DataLoaders(DataLoader(items, batch_size=4), DataLoader(items, batch_size=4), device="cpu")
    learn = Learner(dls, Model(), loss_func=lambda pred, *_: pred["out"].sum())
    learn.remove_cb(learn.progress)
    inputs, preds, targs = learn.get_preds(with_input=True)
    with torch.no_grad():
        expected = learn.model.lin(x)
    # what is not a tensor comes back as None, its key kept: every process gathers the same structure
    assert set(preds) == {"out", "cache", "note", "pair"} and preds["pair"][1] is None
    assert preds["cache"] is None and preds["note"] is None
    assert torch.allclose(preds["out"], expected) and torch.allclose(preds["pair"][0], expected * 2)
    assert set(inputs) == {"x", "text"} and inputs["text"] is None and torch.equal(inputs["x"], x) and torch.equal(targs, torch.arange(10))
