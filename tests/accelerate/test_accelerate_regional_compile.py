"""Accelerate's regional compilation: `TorchDynamoPlugin(use_regional_compilation=True)`, the launcher's variable,
`compile_regions` / `compile_regions_deepspeed` from `cadence.utils`. Compiled in place: saved names stay plain."""

import pytest
import torch
from torch import nn

from cadence import Accelerator, DeepSpeedPlugin
from cadence.compile import is_compiled
from cadence.utils import TorchDynamoPlugin, compile_regions, compile_regions_deepspeed, has_compiled_regions


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    """A stem, three identical blocks in an `nn.ModuleList`, a head: a transformer's shape."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.stem = nn.Linear(4, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(3))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


REGIONS = ["stem", "blocks.0", "blocks.1", "blocks.2", "head"]


def train(accelerator: Accelerator, steps: int = 3) -> tuple[nn.Module, list[float]]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = accelerator.prepare(model, opt)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        loss = (model(x) - 1).pow(2).mean()
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


@pytest.mark.slow
def test_the_plugin_compiles_each_block_of_the_prepared_model_and_trains_like_eager():
    plugin = TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True)
    assert plugin.to_kwargs() == {"backend": "aot_eager"} and plugin.to_dict()["use_regional_compilation"]  # Accelerate's
    accelerator = Accelerator(cpu=True, dynamo_plugin=plugin)
    model, losses = train(accelerator)
    inner = accelerator.unwrap_model(model)
    assert [n for n, m in inner.named_modules() if is_compiled(m)] == REGIONS and not is_compiled(inner)
    assert losses[-1] < losses[0]
    eager_model, eager_losses = train(Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="no")))
    assert not has_compiled_regions(eager_model)
    torch.testing.assert_close(losses, eager_losses)
    saved, eager = accelerator.get_state_dict(model), eager_model.state_dict()
    assert list(saved) == list(eager)                                        # no `_orig_mod.` in the names
    for k in eager:
        torch.testing.assert_close(saved[k], eager[k])


def test_the_launchers_variable_turns_regional_compilation_on(monkeypatch):
    monkeypatch.setenv("CADENCE_DYNAMO_BACKEND", "eager")        # `cadence launch --dynamo_backend eager
    monkeypatch.setenv("CADENCE_DYNAMO_USE_REGIONAL_COMPILATION", "1")   # --dynamo_use_regional_compilation true`
    assert TorchDynamoPlugin().use_regional_compilation and not TorchDynamoPlugin(use_regional_compilation=False
                                                                                  ).use_regional_compilation
    accelerator = Accelerator(cpu=True)
    assert accelerator.compile_options == {"backend": "eager", "regional": True}
    model = accelerator.prepare(Net())                           # compilation is lazy: nothing traced here
    assert [n for n, m in model.named_modules() if is_compiled(m)] == REGIONS
    monkeypatch.delenv("CADENCE_DYNAMO_USE_REGIONAL_COMPILATION")
    assert TorchDynamoPlugin().use_regional_compilation is False
    with pytest.raises(ValueError, match="use_regional_compilation='yes'.*True or False"):
        TorchDynamoPlugin(backend="eager", use_regional_compilation="yes")


@pytest.mark.slow
def test_an_accelerate_script_calling_compile_regions_runs_unchanged():
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(5, 4)
    expected = model(x)
    model = compile_regions(model, backend="eager")              # accelerate.utils.compile_regions's call
    assert has_compiled_regions(model) and [n for n, m in model.named_modules() if is_compiled(m)] == REGIONS
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(model)
    torch.testing.assert_close(model(x), expected)
    assert sorted(accelerator.unwrap_model(model).state_dict()) == sorted(Net().state_dict())


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("stage", [2, 3])
def test_regional_compilation_under_deepspeed_trains_like_eager(stage):
    def run(plugin):
        accelerator = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=stage), dynamo_plugin=plugin)
        try:
            model, losses = train(accelerator)
            return accelerator.unwrap_model(model), losses, accelerator.get_state_dict(model)
        finally:
            accelerator.strategy.teardown()

    inner, losses, saved = run(TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True))
    assert [n for n, m in inner.named_modules() if is_compiled(m)] == REGIONS
    _, eager_losses, eager = run(TorchDynamoPlugin(backend="no"))
    torch.testing.assert_close(losses, eager_losses)
    assert list(saved) == list(eager)
    compile_regions_deepspeed(inner, backend="eager")             # Accelerate's call on `engine.module`: in place
    assert [n for n, m in inner.named_modules() if is_compiled(m)] == REGIONS
