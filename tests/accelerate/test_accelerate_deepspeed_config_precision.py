"""Against Accelerate 1.15 under DeepSpeed: the Accelerator's mixed precision follows the DeepSpeed config when none
is given (a contradiction is refused in the Accelerator's words), and `zero3_init_flag` tells transformers ZeRO-3 is
on from the Accelerator's creation, so the models it builds after it are partitioned as they are built."""

import gc
import json

import pytest
import torch
from torch import nn

from cadence import Accelerator, DeepSpeedPlugin
from helpers import run_launch

BF16_ON = {"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}


def _accelerator(**kwargs):
    return Accelerator(cpu=True, **kwargs)


def test_a_config_that_turns_bf16_on_makes_the_accelerator_train_in_bf16():
    """No mixed_precision (and `cadence launch`'s default "no"): the config's bf16 decides, as in Accelerate."""
    accelerator = _accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=BF16_ON))
    try:
        assert accelerator.mixed_precision == accelerator.state.mixed_precision == "bf16"
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        before = model.weight.detach().clone()
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        assert next(model.parameters()).dtype == torch.bfloat16
        accelerator.backward(model(torch.randn(4, 8, dtype=torch.bfloat16)).float().pow(2).mean())
        optimizer.step()
        assert not torch.equal(accelerator.get_state_dict(model)["weight"], before)   # it trained
    finally:
        accelerator.strategy.teardown()   # the gloo group of one DeepSpeed needs


def test_a_mixed_precision_that_contradicts_the_config_is_refused_in_the_accelerators_words():
    with pytest.raises(ValueError, match=r"enables bf16 but the Accelerator's mixed_precision is 'fp16': set "
                                         r"\"enabled\": \"auto\" in the config, or use "
                                         r"Accelerator\(mixed_precision='bf16'\) / `cadence launch --mixed_precision "
                                         r"bf16`$"):
        _accelerator(mixed_precision="fp16", deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=BF16_ON))
    off = {**BF16_ON, "bf16": {"enabled": False}}
    with pytest.raises(ValueError, match=r'"bf16": \{"enabled": false\} but the Accelerator\'s mixed_precision is '
                                         r"'bf16'.*train in fp32 \(Accelerator\(mixed_precision='no'\)\)$"):
        _accelerator(mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=off))
    assert not torch.distributed.is_initialized()   # refused with nothing left behind: the next Accelerator starts clean
    accelerator = _accelerator(mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=BF16_ON))
    accelerator.strategy.teardown()
    assert accelerator.mixed_precision == "bf16"   # agreeing is fine


def test_zero3_init_flag_tells_transformers_and_a_model_built_after_is_partitioned():
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, GPT2Config
    from transformers.integrations import is_deepspeed_zero3_enabled

    accelerator = _accelerator(mixed_precision="bf16",
                               deepspeed_plugin=DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True))
    try:
        assert is_deepspeed_zero3_enabled()
        config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
        model = AutoModelForCausalLM.from_config(config)
        assert hasattr(model.transformer.wte.weight, "ds_id") and model.transformer.wte.weight.dtype == torch.bfloat16
        plugin = accelerator.state.deepspeed_plugin
        with plugin.zero3_init_context_manager(enable=False):   # e.g. a reload on the main process alone
            assert not is_deepspeed_zero3_enabled()
            assert not hasattr(AutoModelForCausalLM.from_config(config).transformer.wte.weight, "ds_id")
        assert is_deepspeed_zero3_enabled() and plugin.is_zero3_init_enabled()
    finally:
        accelerator.strategy.teardown()
    del accelerator, model, plugin   # the plugin held what told transformers
    gc.collect()
    for options, told in (({"zero_stage": 3}, True),   # Accelerate's default: on under ZeRO-3
                          ({"zero_stage": 3, "zero3_init_flag": False}, False), ({"zero_stage": 2}, False)):
        other = _accelerator(deepspeed_plugin=DeepSpeedPlugin(**options))
        other.strategy.teardown()
        assert is_deepspeed_zero3_enabled() is told, options
        assert other.state.deepspeed_plugin.zero3_init_flag is told, options
        del other   # its plugin held what told transformers
        gc.collect()
        assert not is_deepspeed_zero3_enabled()
    from cadence.state import AcceleratorState

    kept = _accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3))
    kept.strategy.teardown()
    AcceleratorState._reset_state()   # starts over (a notebook, a test), as Accelerate's drops the plugin
    assert not is_deepspeed_zero3_enabled() and kept is not None


def test_launched_zero3_init_with_a_bf16_config_builds_partitioned_and_trains_in_bf16(tmp_path):
    """`cadence launch --use_deepspeed --deepspeed_config_file ds.json --zero3_init_flag true` on 2 processes, the
    config turning bf16 on and no --mixed_precision: a GPT-2 from `from_config` after `Accelerator()` holds half of
    each weight per process from the start, in bf16, and trains."""
    pytest.importorskip("transformers")
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({**BF16_ON, "zero_optimization": {"stage": 3}}))
    proc = run_launch("accelerate_ds_precision.py", timeout=300,
                      flags=("--use_deepspeed", "--deepspeed_config_file", str(config), "--zero3_init_flag", "true"))
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert out["mixed_precision"] == "bf16" and out["told"]
    assert out["built"]["partitioned"] and out["built"]["dtype"] == "torch.bfloat16"
    assert out["prepared_dtype"] == "torch.bfloat16"
    assert out["last"] < out["first"]


def test_accelerator_state_gives_the_first_accelerators_deepspeed_plugin_while_it_lives():
    """Accelerate's one shared state holds the plugin the engine was built from: `AcceleratorState().deepspeed_plugin`
    is the Accelerator's own, with the engine's config (not one rebuilt from the launcher's settings)."""
    from cadence.state import AcceleratorState

    plugin = DeepSpeedPlugin(zero_stage=2, gradient_clipping=0.5)
    accelerator = _accelerator(deepspeed_plugin=plugin)
    try:
        state = AcceleratorState()
        assert state.deepspeed_plugin is plugin and state.distributed_type == "DEEPSPEED"
        assert state.deepspeed_plugin.deepspeed_config["gradient_clipping"] == 0.5
        assert state.deepspeed_plugin.deepspeed_config is accelerator.strategy.config
    finally:
        accelerator.strategy.teardown()
    del accelerator, state, plugin
    gc.collect()
    assert AcceleratorState().deepspeed_plugin is None   # held weakly: gone with its Accelerator (not launched so)


def test_zero3_init_defaults_off_where_transformers_is_not_installed(monkeypatch):
    """ZeRO-3 without transformers: nothing to tell, so the default is off and the Accelerator is built (Accelerate
    raises ImportError there); asked for in so many words, it still says transformers is missing. transformers is
    installed here: its absence is simulated for this one lookup."""
    import importlib.util

    from cadence.accelerate import plugins

    real = importlib.util.find_spec
    monkeypatch.setattr(plugins.importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    assert DeepSpeedPlugin(zero_stage=3).zero3_init_flag is False
    with pytest.raises(ImportError, match="transformers is not installed"):   # before any engine is built
        DeepSpeedPlugin(zero_stage=3, zero3_init_flag="true")
