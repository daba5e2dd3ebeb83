"""Against Accelerate 1.15: `TorchDynamoPlugin`, one mixed precision per process, and the
`accelerate.utils` names cadence has not (a clear ImportError saying what to use)."""

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from cadence import Accelerator, DeepSpeedPlugin, DistributedType
from cadence.accelerate.state import AcceleratorState
from cadence.compile import is_compiled
from cadence.utils import DynamoBackend, TorchDynamoPlugin

ALREADY = "AcceleratorState has already been initialized and cannot be changed"


# ---------------------------------------------------------------------- TorchDynamoPlugin
def test_dynamo_plugin_compiles_prepared_models_in_place_and_is_the_states():
    plugin = TorchDynamoPlugin(backend="eager", dynamic=False)
    accelerator = Accelerator(cpu=True, dynamo_plugin=plugin)
    assert accelerator.state.dynamo_plugin is plugin and accelerator.dynamo_backend == "eager"
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    expected = model(x)
    prepared = accelerator.prepare(model)
    assert is_compiled(prepared) and sorted(prepared.state_dict()) == ["bias", "weight"]
    assert torch.allclose(prepared(x), expected)


def test_dynamo_plugin_fields_defaults_and_kwargs_are_accelerates():
    plugin = TorchDynamoPlugin(backend="inductor", dynamic=False)
    assert repr(plugin) == ("TorchDynamoPlugin(backend=<DynamoBackend.INDUCTOR: 'INDUCTOR'>, mode='default', fullgraph="
                            "False, dynamic=False, options=None, disable=False, use_regional_compilation=False)")
    assert plugin.to_kwargs() == {"backend": "inductor", "dynamic": False}
    assert plugin.backend == DynamoBackend.INDUCTOR == "INDUCTOR"
    assert TorchDynamoPlugin(backend=DynamoBackend.EAGER, fullgraph=True, disable=True).to_kwargs() == {
        "backend": "eager", "fullgraph": True, "disable": True}
    assert Accelerator(cpu=True).state.dynamo_plugin.backend == DynamoBackend.NO
    assert Accelerator(cpu=True, dynamo_backend="aot_eager").state.dynamo_plugin.backend == DynamoBackend.AOT_EAGER


def test_dynamo_plugin_reads_the_launchers_settings(monkeypatch):
    monkeypatch.setenv("CADENCE_DYNAMO_BACKEND", "aot_eager")
    monkeypatch.setenv("CADENCE_DYNAMO_MODE", "max-autotune")
    monkeypatch.setenv("CADENCE_DYNAMO_USE_DYNAMIC", "0")
    assert TorchDynamoPlugin().to_kwargs() == {"backend": "aot_eager", "mode": "max-autotune", "dynamic": False}
    assert TorchDynamoPlugin(backend="no").backend == DynamoBackend.NO   # a field given wins
    accelerator = Accelerator(cpu=True)
    assert accelerator.state.dynamo_plugin.backend == DynamoBackend.AOT_EAGER
    assert accelerator.compile_options == {"backend": "aot_eager", "mode": "max-autotune", "dynamic": False}


def test_dynamo_plugin_refusals_say_what_to_change():
    with pytest.raises(ValueError, match="both `dynamo_plugin` and `dynamo_backend`"):
        Accelerator(cpu=True, dynamo_backend="eager", dynamo_plugin=TorchDynamoPlugin(backend="eager"))
    with pytest.raises(ValueError, match="'foo'.*use one of no, eager, aot_eager, inductor"):
        TorchDynamoPlugin(backend="foo")
    with pytest.raises(ValueError, match="use_regional_compilation='yes'"):
        TorchDynamoPlugin(backend="inductor", use_regional_compilation="yes")
    with pytest.raises(ValueError, match="compile mode 'fastest' does not exist"):
        Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="eager", mode="fastest"))
    with pytest.raises(ValueError, match="backend 'onnxrt' does not exist in torch"):   # Accelerate's name, torch's not
        Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="onnxrt"))


# ---------------------------------------------------------------------- one mixed precision per process
def test_a_second_accelerator_cannot_change_the_mixed_precision():
    first = Accelerator(cpu=True, mixed_precision="bf16")
    for other in ("fp16", "no"):
        with pytest.raises(ValueError) as error:
            Accelerator(cpu=True, mixed_precision=other)
        message = str(error.value)
        assert message.startswith(f"{ALREADY}, restart your runtime completely and pass `mixed_precision='{other}'` "
                                  f"to `Accelerator()`.")
        assert "first Accelerator set mixed_precision='bf16'" in message
    assert Accelerator(cpu=True, mixed_precision="bf16").mixed_precision == "bf16"
    shared = Accelerator(cpu=True)   # no mixed_precision: the first one's, as Accelerate's shared state gives
    assert shared.mixed_precision == shared.state.mixed_precision == "bf16" and shared.native_amp
    assert first.mixed_precision == "bf16"
    with pytest.raises(ValueError, match="precision must be one of"):   # a typo is named as a typo
        Accelerator(cpu=True, mixed_precision="BF16")


def test_the_first_accelerators_precision_comes_from_the_launcher_and_a_reset_forgets_it(monkeypatch):
    monkeypatch.setenv("CADENCE_MIXED_PRECISION", "fp16")
    assert Accelerator(cpu=True).mixed_precision == "fp16"
    with pytest.raises(ValueError, match=ALREADY):
        Accelerator(cpu=True, mixed_precision="bf16")
    AcceleratorState._reset_state(True)
    assert Accelerator(cpu=True, mixed_precision="bf16").mixed_precision == "bf16"


def test_a_failed_first_accelerator_fixes_nothing():
    with pytest.raises(ValueError, match="tracker"):
        Accelerator(cpu=True, mixed_precision="fp16", log_with="no_such_tracker")
    assert Accelerator(cpu=True, mixed_precision="bf16").mixed_precision == "bf16"


def test_under_deepspeed_the_engines_config_decides_and_nothing_is_checked():
    Accelerator(cpu=True, mixed_precision="bf16")
    accelerator = Accelerator(cpu=True, mixed_precision="no", deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
    try:
        assert accelerator.distributed_type == DistributedType.DEEPSPEED
    finally:
        accelerator.strategy.teardown()   # the gloo group of one DeepSpeed needs


# ---------------------------------------------------------------------- accelerate.utils names
def test_accelerates_example_imports_that_were_missing_are_found_or_refused_with_a_replacement():
    from cadence.utils import TorchDynamoPlugin as FromUtils  # examples/torch_native_parallelism/fsdp2_fp8.py
    from cadence.utils.dataclasses import DynamoBackend as FromDataclasses

    assert FromUtils is TorchDynamoPlugin and FromDataclasses is DynamoBackend
    expected = {
        "FP8RecipeKwargs": "fp8 training is not in cadence; train in bf16",
        "AORecipeKwargs": "fp8 training is not in cadence",
        "convert_model_to_fp8_ao": "fp8 training is not in cadence",
        "PrepareForLaunch": "cadence's launchers .*notebook_launcher",
        "DeepSpeedSequenceParallelConfig": "Accelerate's sequence parallelism .* is not in cadence",
        "MegatronLMDummyScheduler": "Megatron-LM is not part of cadence; .*ParallelismConfig",
    }
    for name, replacement in expected.items():
        prefix = f"^cadence.utils has no {name} \\(accelerate.utils.{name}\\): "
        with pytest.raises(ImportError, match=prefix + f".*{replacement}"):
            exec(f"from cadence.utils import {name}")
    with pytest.raises(ImportError, match="cadence.utils.dataclasses has no FP8RecipeKwargs"):
        from cadence.utils.dataclasses import FP8RecipeKwargs  # noqa: F401
    import cadence.utils

    assert not hasattr(cadence.utils, "no_such_name")   # any other name: Python's own AttributeError


# ---------------------------------------------------------------------- side by side with Accelerate 1.15
_ACCELERATE = """
import json, os
from accelerate import Accelerator
from accelerate.utils import TorchDynamoPlugin
out = {"kwargs": TorchDynamoPlugin(backend="inductor", dynamic=False).to_kwargs(),
       "repr": repr(TorchDynamoPlugin(backend="inductor", dynamic=False))}
Accelerator(cpu=True, mixed_precision="bf16")
out["shared"] = Accelerator(cpu=True).mixed_precision
try:
    Accelerator(cpu=True, mixed_precision="fp16")
except ValueError as e:
    out["error"] = str(e)
print(json.dumps(out))
"""


def test_the_same_as_accelerate_side_by_side():
    pytest.importorskip("accelerate")
    import accelerate.utils

    from cadence.utils.unavailable import REPLACEMENTS

    assert [n for n in REPLACEMENTS if not hasattr(accelerate.utils, n)] == []   # every one is Accelerate's
    env = {"PATH": "/usr/bin:/bin", "ACCELERATE_USE_CPU": "true"}
    theirs = json.loads(subprocess.run([sys.executable, "-c", _ACCELERATE], capture_output=True, text=True, env=env,
                                       check=True, timeout=120).stdout.splitlines()[-1])
    plugin = TorchDynamoPlugin(backend="inductor", dynamic=False)
    assert theirs["kwargs"] == plugin.to_kwargs() and theirs["repr"] == repr(plugin)
    Accelerator(cpu=True, mixed_precision="bf16")
    assert theirs["shared"] == Accelerator(cpu=True).mixed_precision == "bf16"
    with pytest.raises(ValueError) as error:
        Accelerator(cpu=True, mixed_precision="fp16")
    assert str(error.value).startswith(theirs["error"])
