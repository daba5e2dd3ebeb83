"""Accelerator(dynamo_backend=...): prepared models are torch.compiled in place (Accelerate's option, cadence's compile)."""

import torch
from torch import nn

from cadence import Accelerator
from cadence.compile import is_compiled


def _prepared(**kwargs):
    torch.manual_seed(0)
    acc = Accelerator(cpu=True, **kwargs)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return acc, *acc.prepare(model, opt)


def _one_step(acc, model, opt):
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    acc.backward(model(x).pow(2).mean())
    opt.step()
    opt.zero_grad()
    return acc.unwrap_model(model).state_dict()


def test_dynamo_backend_compiles_the_prepared_model_and_trains_like_eager():
    acc, model, opt = _prepared(dynamo_backend="aot_eager")
    assert is_compiled(acc.unwrap_model(model)) and acc.dynamo_backend == "aot_eager"
    compiled = _one_step(acc, model, opt)
    eager = _one_step(*_prepared(dynamo_backend="no"))
    assert list(compiled) == ["0.weight", "0.bias", "2.weight", "2.bias"]       # no `_orig_mod.` in saved names
    for k in eager:
        torch.testing.assert_close(compiled[k], eager[k])


def test_the_launchers_dynamo_backend_reaches_the_accelerator(monkeypatch):
    monkeypatch.setenv("CADENCE_DYNAMO_BACKEND", "EAGER")        # what `cadence launch --dynamo_backend eager` sets
    acc, model, _ = _prepared()
    assert acc.dynamo_backend == "eager" and is_compiled(acc.unwrap_model(model))
    assert not is_compiled(acc.unwrap_model(_prepared(dynamo_backend="no")[1]))
