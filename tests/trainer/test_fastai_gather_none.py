"""get_preds keeps a None output's key on every batch and process: ranks gather the same
structure, a None leaf everywhere stays None, one None on some ranks only is refused alike on all."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from cadence import DataLoaders, Learner
from cadence.trainer.gather import GatherPreds, _cat, _tensors_only


def test_a_none_value_keeps_its_key():
    kept = _tensors_only({"logits": torch.ones(2), "hidden": None, "cache": ("k", "v")})
    assert list(kept) == ["logits", "hidden", "cache"] and kept["hidden"] is None and kept["cache"] is None


def test_cat_of_a_none_leaf_is_none_and_a_sometimes_none_leaf_is_refused():
    joined = _cat([{"a": torch.ones(2), "b": None}, {"a": torch.zeros(1), "b": None}])
    assert joined["b"] is None and joined["a"].tolist() == [1.0, 1.0, 0.0]
    for chunks in ([{"b": None}, {"b": torch.ones(1)}], [{"b": torch.ones(1)}, {"b": None}]):
        with pytest.raises(ValueError, match="is None in some batches and a tensor elsewhere"):
            _cat(chunks)


class _TwoRanks:
    """strategy.gather as on two processes: this rank's tensor, then the other rank's (as it would send)."""

    device = torch.device("cpu")

    def __init__(self, other):
        self.other, self.calls = other, []

    def gather(self, t):
        self.calls.append(t.shape)
        return torch.cat([t, self.other(t)])


def _gatherer(other, preds):
    g = GatherPreds()
    g.learn = SimpleNamespace(strategy=_TwoRanks(other), dl=None)
    g.preds = preds
    return g


def test_a_leaf_none_on_every_rank_stays_none_and_is_not_gathered():
    g = _gatherer(lambda t: t, [{"logits": torch.ones(2, 3), "hidden": None}])
    g.after_validate()
    assert g.preds[0]["hidden"] is None and g.preds[0]["logits"].shape == (4, 3)
    assert g.learn.strategy.calls[0] == (1, 2)           # the None flags, one per leaf, gathered first


def test_a_leaf_none_on_one_rank_only_is_refused_before_any_tensor_is_gathered():
    # the other rank's "hidden" is a tensor: its flags say [logits not None, hidden not None]
    g = _gatherer(lambda t: torch.zeros_like(t), [{"logits": torch.ones(2, 3), "hidden": None}])
    with pytest.raises(ValueError, match="is None on some processes and a tensor elsewhere"):
        g.after_validate()
    assert g.learn.strategy.calls == [(1, 2)]


def test_get_preds_of_a_model_returning_a_dict_with_a_none_value():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x):
            return {"logits": self.lin(x), "aux": None}

    x = torch.randn(20, 4)
    dls = DataLoaders.from_dsets(TensorDataset(x, torch.zeros(20, dtype=torch.long)),
                                 TensorDataset(x, torch.zeros(20, dtype=torch.long)), bs=8, device="cpu")
    learn = Learner(dls, Model(), loss_func=lambda out, y: nn.functional.cross_entropy(out["logits"], y))
    preds, targs = learn.get_preds()
    assert preds["aux"] is None and preds["logits"].shape == (20, 2) and targs.shape == (20,)
