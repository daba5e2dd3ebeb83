"""An optimizer with an empty parameter group, its scheduler built before `prepare`, trains under DeepSpeed.

Accelerate's deepspeed_with_config_support example groups the parameters into "decay" and "no decay"
(`bias`, `LayerNorm.weight`); a Llama has neither, so the second group is empty. DeepSpeed drops empty
groups from the optimizer in place, and the scheduler built over both groups then stopped in
`lr_scheduler.step()` ("zip() argument 2 is longer than argument 1"). Here the empty group comes
first and each group has its own schedule, so a scheduler left with the wrong lambda would be seen too.
One process, real DeepSpeed ZeRO-0/2/3, against the same loop in plain torch without the empty group.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from cadence import Accelerator, DeepSpeedPlugin

STEPS, LR = 4, 0.1


def warmup(step: int) -> float:
    return (step + 1) / STEPS


def never(step: int) -> float:          # the empty group's schedule: were it applied to the model, nothing would train
    return 0.0


def data() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(3, 2, bias=False), torch.randn(STEPS * 2, 3)


def by_hand() -> tuple[torch.Tensor, list[float]]:
    model, xs = data()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    lrs = []
    for x in xs.split(2):
        model(x).pow(2).sum(1).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        lrs.append(opt.param_groups[0]["lr"])
    return model.weight.detach(), lrs


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_scheduler_over_an_empty_group_steps_with_the_groups_deepspeed_keeps(stage):
    model, xs = data()
    opt = torch.optim.SGD([{"params": [], "weight_decay": 0.0}, {"params": list(model.parameters())}], lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [never, warmup])
    accelerator = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=stage))
    try:
        model, opt, dl, sched = accelerator.prepare(model, opt, DataLoader(xs, batch_size=2), sched)
        lrs = []
        for x in dl:
            accelerator.backward(model(x).pow(2).sum(1).mean())
            opt.step()
            sched.step()
            opt.zero_grad()
            lrs.append(sched.get_last_lr())
        trained = accelerator.get_state_dict(model)["weight"]
    finally:
        accelerator.strategy.teardown()
    weight, expected_lrs = by_hand()
    assert lrs == [[lr] for lr in expected_lrs]
    assert torch.allclose(trained, weight, atol=1e-6)
