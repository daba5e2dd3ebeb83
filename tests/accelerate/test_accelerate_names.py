"""Accelerate's names under cadence, each against Accelerate's documented behaviour (one process; the multi-process
ones are in test_accelerate_names_multiprocess.py).

The swap users make is mechanical: `accelerate` -> `cadence` in every import. Every name Accelerate 1.15's
examples (examples/*.py, examples/by_feature/*.py) import must be found there.
"""

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader

from cadence import (Accelerator, DataLoaderConfiguration, DDPCommunicationHookType, DeepSpeedPlugin,
                     DistributedDataParallelKwargs, DistributedType, FullyShardedDataParallelPlugin,
                     GradientAccumulationPlugin, PartialState, ProfileKwargs)
from cadence.accelerate.plugins import distributed_type_of

# Accelerate 1.15's DistributedType, as documented (utils/dataclasses.py)
ACCELERATE_DISTRIBUTED_TYPES = ["NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
                                "MULTI_XPU", "DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM", "MULTI_HPU", "MULTI_NEURON"]


def test_every_name_accelerates_examples_import_is_found_under_cadence():
    from cadence import Accelerator, DataLoaderConfiguration, DistributedType, FullyShardedDataParallelPlugin  # noqa: F401
    from cadence.local_sgd import LocalSGD  # noqa: F401
    from cadence.logging import get_logger  # noqa: F401
    from cadence.utils import (DDPCommunicationHookType, DistributedDataParallelKwargs, DummyOptim,  # noqa: F401
                               DummyScheduler, FullyShardedDataParallelPlugin, ProfileKwargs, find_executable_batch_size,
                               gather_object, is_npu_available, is_schedulefree_available, is_xpu_available,
                               patch_environment, set_seed, tqdm)
    from cadence.utils.dataclasses import DistributedType as FromDataclasses

    assert FromDataclasses is DistributedType


def test_distributed_type_has_accelerates_members_and_is_a_string():
    assert [t.name for t in DistributedType] == ACCELERATE_DISTRIBUTED_TYPES
    assert all(t.value == t.name for t in DistributedType)
    assert DistributedType.MULTI_GPU == "MULTI_GPU" and json.dumps(DistributedType.FSDP) == '"FSDP"'


def test_distributed_type_is_read_off_the_strategy():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert distributed_type_of("ddp", cpu, 2) == DistributedType.MULTI_CPU
    assert distributed_type_of("ddp", cuda, 2) == DistributedType.MULTI_GPU
    assert distributed_type_of("ddp", cpu, 1) == DistributedType.NO
    assert distributed_type_of("fsdp", cuda, 2) == DistributedType.FSDP
    assert distributed_type_of("deepspeed", cpu, 1) == DistributedType.DEEPSPEED
    assert distributed_type_of("model_parallel", cuda, 4) == DistributedType.FSDP
    accelerator = Accelerator(cpu=True)
    assert accelerator.distributed_type == DistributedType.NO == accelerator.state.distributed_type


def _loop(accelerator, n=8, bs=1):
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, dl = accelerator.prepare(model, opt, DataLoader(torch.ones(n, 2), batch_size=bs))
    steps = 0
    for x in dl:
        with accelerator.accumulate(model):
            accelerator.backward(model(x).sum())
            before = model.weight.detach().clone()
            opt.step()
            steps += not torch.equal(before, model.weight)
            opt.zero_grad()
    return steps


def test_gradient_accumulation_steps_is_settable_and_the_plugin_sets_it():
    accelerator = Accelerator(cpu=True)
    accelerator.gradient_accumulation_steps = 4     # automatic_gradient_accumulation.py does this after prepare
    assert accelerator.gradient_accumulation_steps == 4 and _loop(accelerator) == 2
    plugin = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    assert plugin.gradient_accumulation_steps == 2 and _loop(plugin) == 4
    with pytest.raises(ValueError, match="positive int"):
        accelerator.gradient_accumulation_steps = 0
    with pytest.raises(ValueError, match="not both"):
        Accelerator(cpu=True, gradient_accumulation_steps=2, gradient_accumulation_plugin=GradientAccumulationPlugin(2))
    with pytest.raises(ValueError, match="sync_with_dataloader"):
        GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=False)


def test_dataloader_configuration_split_batches_and_data_seed_are_honoured_and_the_rest_refused():
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    assert accelerator.split_batches and accelerator.even_batches

    def order(seed):
        acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(data_seed=seed))
        return torch.cat(list(acc.prepare(DataLoader(torch.arange(32), batch_size=8, shuffle=True)))).tolist()
    assert order(1) == order(1) != order(2)
    with pytest.raises(ValueError, match="even_batches"):
        DataLoaderConfiguration(even_batches=False)
    with pytest.raises(ValueError, match="dispatch_batches"):
        DataLoaderConfiguration(dispatch_batches=True)
    with pytest.raises(ValueError, match="even_batches"):
        with accelerator.join_uneven_inputs([], even_batches=False):
            pass


def test_save_writes_what_torch_and_safetensors_read_back(tmp_path):
    accelerator = Accelerator(cpu=True)
    state = {"w": torch.arange(4.0), "b": torch.ones(2)}
    accelerator.save(state, tmp_path / "w.pt")
    accelerator.save(state, tmp_path / "w.safetensors", safe_serialization=True)
    for loaded in (torch.load(tmp_path / "w.pt"), load_file(tmp_path / "w.safetensors")):
        assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    with pytest.raises(TypeError, match="dict of tensors"):
        accelerator.save({"step": 3}, tmp_path / "x.safetensors", safe_serialization=True)


def test_profile_records_the_ops_and_writes_a_chrome_trace(tmp_path):
    handler = ProfileKwargs(activities=["cpu"], record_shapes=True, output_trace_dir=str(tmp_path / "trace"))
    accelerator = Accelerator(cpu=True, kwargs_handlers=[handler])
    with accelerator.profile() as prof:
        torch.randn(8, 8) @ torch.randn(8, 8)
    assert "aten::mm" in {e.key for e in prof.key_averages()}
    trace = json.loads((tmp_path / "trace" / "profile_0.json").read_text())
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    with pytest.raises(ValueError, match="activities"):
        ProfileKwargs(activities=["gpu"]).build()


def test_ddp_comm_hook_types_become_torchs_hooks():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    assert [t.value for t in DDPCommunicationHookType] == ["no", "fp16", "bf16", "power_sgd", "batched_power_sgd"]
    assert DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16).to_kwargs()["comm_hook"] is \
        default_hooks.fp16_compress_hook
    options = DistributedDataParallelKwargs(comm_hook="power_sgd", comm_wrapper="bf16",
                                            comm_state_option={"matrix_approximation_rank": 2}).to_kwargs()
    assert isinstance(options["comm_state"], powerSGD_hook.PowerSGDState)
    assert options["comm_state"].matrix_approximation_rank == 2
    assert "bf16_compress_wrapper" in options["comm_hook"].__qualname__
    assert DistributedDataParallelKwargs().to_kwargs() == {}   # NO: DDP's own averaging (cadence's default)
    with pytest.raises(ValueError, match="wraps a comm_hook"):
        DistributedDataParallelKwargs(comm_wrapper="fp16")
    with pytest.raises(ValueError, match="does not exist"):
        DistributedDataParallelKwargs(comm_hook="int8")


def test_fsdp_plugin_maps_onto_cadences_fsdp_options_and_refuses_what_fsdp2_cannot_do():
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.fully_sharded_data_parallel import FullStateDictConfig

    plugin = FullyShardedDataParallelPlugin(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, cpu_offload=True,
                                            auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["GPT2Block"], activation_checkpointing=True,
                                            state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=False))
    assert plugin.strategy_options() == {
        "sharding_strategy": "SHARD_GRAD_OP", "offload_params": True, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": ["GPT2Block"], "activation_checkpointing": True}
    assert FullyShardedDataParallelPlugin(reshard_after_forward=False).strategy_options() == {
        "sharding_strategy": "SHARD_GRAD_OP"}
    with pytest.raises(ValueError, match="mixed_precision"):
        FullyShardedDataParallelPlugin(mixed_precision_policy={"param_dtype": torch.bfloat16})
    with pytest.raises(ValueError, match="sharding_strategy"):
        FullyShardedDataParallelPlugin(sharding_strategy="QUARTER_SHARD")
    # one process: Accelerate runs without FSDP, and so does cadence
    assert Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin()).distributed_type == DistributedType.NO


def test_deepspeed_plugin_and_partial_state_deepspeed_plugin(monkeypatch):
    plugin = DeepSpeedPlugin(zero_stage=2, gradient_clipping=1.0, offload_optimizer_device="cpu")
    assert plugin.deepspeed_config["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert plugin.deepspeed_config["gradient_clipping"] == 1.0 and "optimizer" not in plugin.deepspeed_config
    assert PartialState().deepspeed_plugin is None
    monkeypatch.setenv("CADENCE_STRATEGY", "deepspeed")
    monkeypatch.setenv("CADENCE_DEEPSPEED_CONFIG", json.dumps({"deepspeed_zero_stage": 3}))
    assert PartialState().deepspeed_plugin.deepspeed_config["zero_optimization"]["stage"] == 3
    with pytest.raises(ValueError, match="zero_stage"):
        DeepSpeedPlugin(zero_stage=4)


class ScheduleFreeSGD(torch.optim.SGD):
    """A schedule-free-style optimizer: `eval()` swaps in other weights, `train()` swaps them back."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.mode = "train"

    def train(self):
        self.mode = "train"

    def eval(self):
        self.mode = "eval"


def test_prepared_optimizer_passes_train_and_eval_through_and_models_get_no_sync():
    accelerator = Accelerator(cpu=True)
    model = nn.Linear(2, 1)
    model, opt = accelerator.prepare(model, ScheduleFreeSGD(model.parameters(), lr=0.1))
    opt.eval()
    assert opt.optimizer.mode == "eval"
    opt.train()
    assert opt.optimizer.mode == "train"
    plain = accelerator.prepare(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1))
    plain.train()                                      # a torch optimizer has no modes: nothing to switch
    with model.no_sync():                              # LocalSGD and Accelerate's examples call it on the model
        accelerator.backward(model(torch.ones(1, 2)).sum())
    assert model.weight.grad is not None


def test_get_logger_logs_on_the_main_process_at_the_level_asked(caplog):
    from cadence.logging import get_logger

    logger = get_logger("cadence.test.names", log_level="INFO")
    with caplog.at_level(logging.INFO, logger="cadence.test.names"):
        logger.info("once")
        logger.info("everywhere", main_process_only=False)
        logger.info("in order", main_process_only=False, in_order=True)
    assert [r.getMessage() for r in caplog.records] == ["[RANK 0] once", "[RANK 0] everywhere", "[RANK 0] in order"]
    assert logger.logger.level == logging.INFO


def test_is_available_checks_answer_without_importing():
    from cadence import utils

    checks = {name: getattr(utils, name)() for name in utils.__all__
              if name.startswith("is_") and name.endswith("_available")}   # not is_peft_model, is_compiled_module
    assert all(isinstance(v, bool) for v in checks.values())
    assert checks["is_transformers_available"] and checks["is_deepspeed_available"]
    assert not checks["is_xpu_available"] and not checks["is_cuda_available"]   # this CPU machine


def test_patch_environment_and_synchronize_rng_states_on_one_process(monkeypatch):
    from cadence.utils import patch_environment, synchronize_rng_states

    monkeypatch.delenv("CADENCE_TEST_VAR", raising=False)
    with patch_environment(cadence_test_var=1):
        assert os.environ["CADENCE_TEST_VAR"] == "1"
    assert "CADENCE_TEST_VAR" not in os.environ
    torch.manual_seed(3)
    synchronize_rng_states(["torch"])
    assert torch.equal(torch.rand(2), torch.manual_seed(3) and torch.rand(2))
    with pytest.raises(ValueError, match="not 'xla'"):
        synchronize_rng_states(["xla"])


def test_ddp_options_under_another_engine_are_not_used_and_a_warning_says_so():
    # Accelerate uses DistributedDataParallelKwargs only under DDP; an FSDP run of a script that sets them must start
    with pytest.warns(UserWarning, match="DistributedDataParallelKwargs options are DDP's"):
        accelerator = Accelerator(cpu=True, strategy="fsdp",
                                  kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    assert accelerator.strategy.name == "fsdp"


def test_the_accelerate_modules_never_import_accelerate():
    code = ("import sys, cadence, cadence.utils, cadence.utils.dataclasses, cadence.logging, cadence.local_sgd\n"
            "cadence.Accelerator(cpu=True)\n"
            "print('accelerate' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_accelerator_state_deepspeed_plugin_is_the_engines_config_or_none(monkeypatch):
    monkeypatch.setenv("CADENCE_STRATEGY", "deepspeed")
    monkeypatch.setenv("CADENCE_DEEPSPEED_CONFIG", json.dumps({"deepspeed_zero_stage": 2}))
    assert Accelerator(cpu=True, strategy="ddp").state.deepspeed_plugin is None   # the Accelerator's engine decides
    accelerator = Accelerator(cpu=True)
    assert accelerator.distributed_type == DistributedType.DEEPSPEED
    assert accelerator.state.deepspeed_plugin.deepspeed_config is accelerator.strategy.config
    assert accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]["stage"] == 2
    accelerator.strategy.teardown()


def test_a_deepspeed_config_fixing_the_accumulation_sets_the_accelerators_window():
    # Accelerate: "Gradient accumulation steps mismatch ... Using DeepSpeed's value"; the loss is scaled once
    accelerator = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=0, gradient_accumulation_steps=2))
    assert accelerator.gradient_accumulation_steps == 2
    torch.manual_seed(0)
    model, xs = nn.Linear(3, 1), torch.randn(4, 3)
    reference = nn.Linear(3, 1)
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, dl = accelerator.prepare(model, opt, DataLoader(xs, batch_size=1))
    for x in dl:
        with accelerator.accumulate(model):
            accelerator.backward(model(x).pow(2).sum())
            opt.step()
            opt.zero_grad()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for window in xs.split(2):                      # by hand: one step per window on the mean of its losses
        reference(window).pow(2).sum(1).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    trained = accelerator.get_state_dict(model)
    assert torch.allclose(trained["weight"], reference.weight, atol=1e-6)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        accelerator.gradient_accumulation_steps = 4
    accelerator.strategy.teardown()


def test_accelerates_other_constructor_arguments_are_taken_or_refused_naming_what_to_use():
    for name in ("megatron_lm_plugin", "torch_tp_plugin"):
        with pytest.raises(ValueError, match=f"{name}: .*model_parallel"):
            Accelerator(cpu=True, **{name: object()})
    with pytest.raises(ValueError, match="dynamo_plugin: .*dynamo_backend"):
        Accelerator(cpu=True, dynamo_plugin=object())
    with pytest.raises(ValueError, match=r"rng_types \['xla'\]"):
        Accelerator(cpu=True, rng_types=["torch", "xla"])
    with pytest.raises(ValueError, match="deepspeed_plugins with 2 plugins"):
        Accelerator(cpu=True, deepspeed_plugins={"a": DeepSpeedPlugin(zero_stage=2), "b": DeepSpeedPlugin(zero_stage=3)})
    accelerator = Accelerator(cpu=True, deepspeed_plugins={"student": DeepSpeedPlugin(zero_stage=2)})
    assert accelerator.distributed_type == DistributedType.DEEPSPEED
    assert accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]["stage"] == 2
    accelerator.strategy.teardown()


def test_even_batches_and_sync_gradients_are_settable_as_in_accelerate():
    accelerator = Accelerator(cpu=True)
    accelerator.even_batches = True
    with pytest.raises(ValueError, match="even_batches=False"):
        accelerator.even_batches = False
    model = nn.Linear(2, 1)
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = model.weight.detach().clone()
    accelerator.sync_gradients = False                 # a prepared optimizer waits, as on an accumulation micro-step
    accelerator.backward(model(torch.ones(1, 2)).sum())
    opt.step()
    assert torch.equal(model.weight, before) and not accelerator.sync_gradients
    accelerator.sync_gradients = True
    opt.step()
    assert torch.allclose(model.weight, before - 0.1)   # d(sum)/dw = 1 for each weight


ATTRIBUTES_READ = ("native_amp", "fp8_enabled", "has_fp8_handler", "delayed_fp8_autocast", "fp8_recipe_handler",
                   "autocast_handler", "has_lomo_optimizer", "mixed_precision", "is_main_process", "num_processes")


def _public_names_and_values(library: str, mixed_precision: str) -> dict:
    """dir() of `library`'s Accelerator and its state, a few attributes' values and the state's repr, in a fresh
    process (real Accelerate keeps process-wide singletons)."""
    code = (f"import json, torch\nfrom {library} import Accelerator, PartialState\n"
            f"from {library}.utils import DistributedDataParallelKwargs as K\n"
            f"a = Accelerator(cpu=True, mixed_precision={mixed_precision!r}, kwargs_handlers=[K(bucket_cap_mb=5)])\n"
            f"print(json.dumps({{'names': sorted(n for n in dir(a) if not n.startswith('_')),\n"
            f"  'state_names': sorted(n for n in dir(PartialState()) if not n.startswith('_')),\n"
            f"  'values': {{n: repr(getattr(a, n)) for n in {ATTRIBUTES_READ!r}}},\n"
            f"  'handler': a.ddp_handler.bucket_cap_mb, 'scaler': a.scaler is None, 'log_with': list(a.log_with),\n"
            f"  'repr': repr(a.state), 'partial_repr': repr(PartialState())}}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, check=True,
                         env={**os.environ, "ACCELERATE_MIXED_PRECISION": mixed_precision})
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_the_accelerator_and_its_state_answer_every_public_name_accelerates_do(mixed_precision):
    """What Accelerate's own scripts read (`accelerator.fp8_recipe_handler` in examples/config_yaml_templates/run_me.py,
    `PartialState().destroy_process_group()` in its inference examples, `print(accelerator.state)`), found and equal."""
    theirs, ours = (_public_names_and_values(lib, mixed_precision) for lib in ("accelerate", "cadence"))
    assert set(theirs["names"]) - set(ours["names"]) == {"flag_tensor"}   # set_trigger's tensor, internal to it
    assert set(theirs["state_names"]) <= set(ours["state_names"]), set(theirs["state_names"]) - set(ours["state_names"])
    for key in ("values", "handler", "scaler", "log_with", "repr", "partial_repr"):
        assert ours[key] == theirs[key], (key, ours[key], theirs[key])
