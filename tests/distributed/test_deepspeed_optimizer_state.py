"""DeepSpeed's optimizer state in and out of cadence's engine-free format, and the Accelerator's ZeRO optimizer.

`learn.save` writes the optimizer as a one-process torch optimizer over the same model and parameter groups would
(`optimizer.pt`): before, ZeRO-2/3 wrote DeepSpeed's flat partitions (one "parameter" per group), which a plain
Learner refused, and with a peft LoRA model (a frozen first parameter) ZeRO-3 raised KeyError. The moments are
compared with DeepSpeed's own `safe_get_full_optimizer_state` read by the launched run (tests/scripts/
deepspeed_optimizer_state.py), and the loaded optimizer takes the step the DeepSpeed run took next.
"""

import copy
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from cadence import Accelerator, DeepSpeedPlugin
from cadence.distributed.deepspeed_state import frozen_fp32
from helpers import SCRIPTS, run_launch

sys.path.insert(0, str(SCRIPTS))
import deepspeed_optimizer_state as script  # noqa: E402  (the launched script's Learners)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("stage, kind", [(2, "mlp"), (3, "mlp"), (2, "lora"), (3, "lora")])
def test_a_zero_save_loads_into_a_plain_learner_with_deepspeeds_moments_and_continues_alike(tmp_path, stage, kind):
    run_launch("deepspeed_optimizer_state.py", str(tmp_path), str(stage), kind, timeout=300)
    learn = script.LEARNERS[kind](tmp_path, bs=8)   # one process: the two processes' global batch
    learn.load("saved", with_opt=True)
    saved = {k: v.clone() for k, v in learn.model.state_dict().items()}
    named = dict(learn.model.named_parameters())
    reference = torch.load(tmp_path / "reference.pt")
    assert set(reference) == {name for name, p in named.items() if p.requires_grad}
    assert len(reference) < len(named)   # some parameters are frozen: numbered in their groups, without state
    for name, moments in reference.items():
        for key, value in moments.items():
            assert torch.equal(learn.opt.state[named[name]][key], value), (name, key)
    assert all(p not in learn.opt.state for p in named.values() if not p.requires_grad)
    learn.fit(1)
    final = torch.load(tmp_path / "final.pt")
    for name, value in learn.model.state_dict().items():
        torch.testing.assert_close(value, final[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any(not torch.equal(saved[n], final[n]) for n in reference)   # the step moved the trained weights


@pytest.mark.parametrize("stage", [2, 3])
def test_a_plain_optimizer_state_loads_into_zero_and_saves_back_the_same(tmp_path, stage):
    """Numbering both ways: a plain Learner's file read into a one-process ZeRO engine, then written again."""
    plain = script.mlp_learner(tmp_path, bs=8)
    plain.fit(2)
    plain.save("plain")
    expected = plain.opt.state_dict()
    learn = script.mlp_learner(tmp_path, bs=8)
    with learn.distrib_ctx(strategy="deepspeed", zero_stage=stage):
        learn.load("plain", with_opt=True)
        learn.save("again")
    again = torch.load(tmp_path / "models" / "again" / "optimizer.pt")
    assert [g["params"] for g in again["param_groups"]] == [g["params"] for g in expected["param_groups"]]
    assert [g["lr"] for g in again["param_groups"]] == [g["lr"] for g in expected["param_groups"]]
    assert again["state"].keys() == expected["state"].keys()
    for i, entry in expected["state"].items():
        for key, value in entry.items():
            assert torch.equal(again["state"][i][key], value), (i, key)


def test_frozen_parameters_warn_only_in_low_precision_naming_it():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert frozen_fp32(model, "no", 3) == {} and frozen_fp32(model, "fp32", 3) == {}   # Accelerate's / cadence's
    with pytest.warns(UserWarning, match="ZeRO-3 in bf16 keeps no fp32 copy of the 2 frozen parameters"):
        frozen_fp32(model, "bf16", 3)


def _prepared(stage: int):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    accelerator = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=stage))
    model, opt, dl = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1),
                                         DataLoader(torch.randn(8, 3), batch_size=4))
    return accelerator, model, opt, dl


def _step(accelerator, model, opt, x) -> None:
    accelerator.backward(model(x).pow(2).mean())
    opt.step()
    opt.zero_grad()


def test_the_zero3_optimizer_state_dict_is_the_engines_and_loads_back():
    accelerator, model, opt, dl = _prepared(3)
    try:
        batches = list(dl)
        _step(accelerator, model, opt, batches[0])
        state = copy.deepcopy(opt.state_dict())   # was KeyError: the torch optimizer's groups hold flat partitions
        moments = next(iter(state["optimizer_state_dict"]["state"].values()))
        _step(accelerator, model, opt, batches[1])
        opt.load_state_dict(state)
        back = next(iter(opt.state_dict()["optimizer_state_dict"]["state"].values()))
        assert all(torch.equal(back[k], v) for k, v in moments.items())
    finally:
        accelerator.strategy.teardown()


def test_clip_grad_value_under_deepspeed_is_refused_saying_to_clip_by_norm():
    accelerator, model, opt, dl = _prepared(2)
    try:
        accelerator.backward(model(next(iter(dl))).pow(2).mean())
        with pytest.raises(ValueError, match=r"DeepSpeed does not support clip_grad_value_.*Use clip_grad_norm_"):
            accelerator.clip_grad_value_(model.parameters(), 0.1)
    finally:
        accelerator.strategy.teardown()
