"""learn.export / load_learner: safetensors weights, the pickled structure unpickled only when the caller trusts it."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from cadence import Learner, load_learner

UNPICKLED = []


class MarkedLoss(nn.CrossEntropyLoss):
    """A loss whose unpickling leaves a trace: shows when load_learner unpickled the export."""

    def __setstate__(self, state):
        UNPICKLED.append(type(self).__name__)
        super().__setstate__(state)


class WithScale(nn.Module):
    """A model with a non-persistent buffer (not in the weights file: the structure must carry it)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        self.register_buffer("scale", torch.full((3,), 2.0), persistent=False)

    def forward(self, x):
        return self.body(x) * self.scale


@pytest.fixture
def trained(dls, tmp_path):
    torch.manual_seed(0)
    learn = Learner(dls, WithScale(), loss_func=MarkedLoss(), path=tmp_path)
    with learn.no_bar():
        learn.fit(1, lr=1e-2)
    UNPICKLED.clear()
    return learn


def test_export_then_load_with_trust_predicts_the_same(trained, tmp_path):
    out = trained.export()
    assert out == tmp_path / "export.pkl"   # fastai's name, a directory
    assert sorted(p.name for p in out.iterdir()) == ["export.json", "learner.pkl", "model.safetensors"]
    weights = load_file(str(out / "model.safetensors"))
    assert sorted(weights) == sorted(trained.model.state_dict())
    assert all(torch.equal(weights[k], v) for k, v in trained.model.state_dict().items())
    assert json.loads((out / "export.json").read_text())["model_class"].endswith("WithScale")

    loaded = load_learner(out, trust_pickle=True)
    assert UNPICKLED == ["MarkedLoss"] and isinstance(loaded.loss_func, MarkedLoss)
    assert torch.equal(loaded.model.scale, torch.full((3,), 2.0))
    preds, targs = trained.get_preds()
    again, _ = loaded.get_preds(dl=trained.dls.valid)
    assert torch.equal(preds, again)
    x = trained.dls.valid.dataset[0][0]
    torch.testing.assert_close(loaded.predict(x), preds[0])


def test_without_trust_nothing_is_unpickled_and_the_message_says_why(trained):
    out = trained.export()
    with pytest.raises(ValueError, match=r"unpickling runs whatever code the file names.*trust_pickle=True.*"
                                         r"model=MyModel\(\), loss_func=...\) reads only the safetensors weights"):
        load_learner(out)
    assert UNPICKLED == []


def test_load_into_your_own_model_reads_only_the_weights(trained):
    out = trained.export()
    loaded = load_learner(out, model=WithScale())
    assert UNPICKLED == []
    x = trained.dls.valid.dataset[:5][0]
    torch.testing.assert_close(loaded.model(x), trained.model(x))
    with pytest.raises(ValueError, match="without a loss function"):
        loaded.loss_func(x, x)
    with pytest.raises(ValueError, match="(?s)does not fit this model.*missing keys: 0.bias, 0.weight"):
        load_learner(out, model=nn.Sequential(nn.Linear(8, 3)))


def test_export_refuses_what_cannot_be_pickled_and_writes_nothing(dls, model, tmp_path):
    learn = Learner(dls, model, loss_func=lambda p, y: nn.functional.cross_entropy(p, y), path=tmp_path)
    with pytest.raises(TypeError, match="export could not pickle the model or the loss function .*not lambdas"):
        learn.export()
    assert list(tmp_path.iterdir()) == []


def test_a_new_export_replaces_the_old_one_whole(trained, tmp_path):
    trained.export()
    with trained.no_bar():
        trained.fit(1, lr=1e-2)
    trained.export()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export.pkl"]   # no temporary or old directory left
    weights = load_file(str(tmp_path / "export.pkl" / "model.safetensors"))
    assert torch.equal(weights["body.0.weight"], trained.model.body[0].weight)


def splitter_body_head(m):
    return [list(m.body[:2].parameters()), list(m.body[2].parameters())]


def test_load_learner_keeps_the_metrics_and_training_settings_as_fastais_pickled_learner(dls, tmp_path):
    """fastai's load_learner gives back the Learner's metrics (validate on new data reports them), opt_func, splitter
    and hyper-parameters; a lambda among them is left out with a warning, the export still made."""
    from functools import partial

    from cadence import F1Score, accuracy

    torch.manual_seed(0)
    learn = Learner(dls, WithScale(), loss_func=nn.CrossEntropyLoss(), path=tmp_path, metrics=[accuracy, F1Score(average="macro")],
                    opt_func=partial(torch.optim.SGD, momentum=0.9), splitter=splitter_body_head, lr=0.05, wd=0.1)
    with learn.no_bar():
        learn.fit(1)
    loaded = load_learner(learn.export(), trust_pickle=True)
    assert loaded.recorder.metric_names[-3:-1] == ["accuracy", "f1_score"]
    x, y = dls.valid.dataset[:]
    with torch.no_grad():
        out = learn.model(x)
    res = loaded.validate(dl=dls.valid)
    assert res["accuracy"] == pytest.approx((out.argmax(1) == y).float().mean().item())
    assert isinstance(loaded.opt, torch.optim.SGD) and loaded.opt.param_groups[0]["momentum"] == 0.9
    assert len(loaded.opt.param_groups) == 2 and (loaded.lr, loaded.wd) == (0.05, 0.1)

    learn.metrics = [accuracy, lambda p, t: (p.argmax(1) == t).float().mean()]
    with pytest.warns(UserWarning, match="the Learner's metric <lambda> cannot be pickled .* load_learner will leave"):
        out = learn.export("export2")
    assert [m.name for m in load_learner(out, trust_pickle=True).metrics] == ["accuracy"]


def test_export_of_a_transformers_model_after_gradient_checkpointing_enable_loads_and_predicts_the_same(tmp_path):
    """transformers' gradient_checkpointing_enable registers a local function as a forward hook (it stays after
    gradient_checkpointing_disable), which cannot be pickled: export leaves it out, saying so, instead of failing."""
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import GPT2Config, GPT2LMHeadModel

    from cadence import DataLoaders

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    model.gradient_checkpointing_enable()
    ids = torch.randint(0, 64, (4, 8))
    dls = DataLoaders(DataLoader(TensorDataset(ids, ids), batch_size=2), DataLoader(TensorDataset(ids, ids),
                                                                                   batch_size=2), device="cpu")
    learn = Learner(dls, model, loss_func=None, path=tmp_path)
    with pytest.warns(UserWarning, match="export leaves out hooks that cannot be pickled .*make_inputs_require_grads"):
        out = learn.export()
    loaded = load_learner(out, trust_pickle=True)
    model.eval(), loaded.model.eval()   # no dropout
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, model(ids).logits)
