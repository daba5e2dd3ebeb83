"""A schedule-free optimizer's `eval()` / `train()` through a prepared optimizer reach the weights the model runs with.

Accelerate's by_feature/schedule_free example calls `optimizer.eval()` before evaluating: the optimizer
moves the weights to its averaged point `x`, and `train()` moves them back. DeepSpeed keeps its own fp32
master weights (ZeRO-1/2 partitions, ZeRO-3 partitions it lends the optimizer only during a step), so the
switch used to leave the model's weights alone on ZeRO-2 and do nothing at all on ZeRO-3: the model was
evaluated at the training point. One process, real `schedulefree` and DeepSpeed, against the same steps
in plain torch.
"""

import pytest
import torch
from torch import nn

from cadence import Accelerator, DeepSpeedPlugin

schedulefree = pytest.importorskip("schedulefree")

PROBE = torch.ones(1, 3)


def batches() -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(4, 3) for _ in range(3)]


def model_and_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    return model, schedulefree.AdamWScheduleFree(model.parameters(), lr=0.1, warmup_steps=0)


def train_and_probe(model: nn.Module, opt, backward) -> tuple[torch.Tensor, torch.Tensor]:
    """Train on the batches in the optimizer's train mode; the model's output on PROBE in eval mode, then in train."""
    opt.train()
    for x in batches():
        backward(model(x).pow(2).sum())
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        opt.eval()
        at_eval = model(PROBE)
        opt.train()
        at_train = model(PROBE)
    return at_eval, at_train


def by_hand() -> tuple[torch.Tensor, torch.Tensor]:
    model, opt = model_and_opt()
    return train_and_probe(model, opt, torch.Tensor.backward)


@pytest.mark.parametrize("stage", [None, 0, 2, 3])
def test_eval_and_train_switch_the_weights_the_model_runs_with(stage):
    model, opt = model_and_opt()
    plugin = {} if stage is None else {"deepspeed_plugin": DeepSpeedPlugin(zero_stage=stage)}
    accelerator = Accelerator(cpu=True, **plugin)
    try:
        model, opt = accelerator.prepare(model, opt)
        at_eval, at_train = train_and_probe(model, opt, accelerator.backward)
    finally:
        accelerator.strategy.teardown()
    expected_eval, expected_train = by_hand()
    assert not torch.allclose(expected_eval, expected_train)   # the switch is visible in the output
    assert torch.allclose(at_eval, expected_eval, atol=1e-6)
    assert torch.allclose(at_train, expected_train, atol=1e-6)
