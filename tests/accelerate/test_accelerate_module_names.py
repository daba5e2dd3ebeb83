"""Scripts ported from Accelerate with `sed s/accelerate/cadence/` import Accelerate's modules (`cadence.state`,
`cadence.data_loader`, `cadence.hooks`, ...) and names, and read `AcceleratorState()` as Accelerate gives it."""

import importlib
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import accelerate
import accelerate.utils
import cadence
import cadence.utils
from cadence import Accelerator

# Accelerate's module -> the names of it that user code reaches for
USED = {
    "state": ["AcceleratorState", "PartialState", "GradientState", "is_initialized", "DistributedType",
              "SageMakerDistributedType"],
    "data_loader": ["skip_first_batches", "prepare_data_loader", "DataLoaderShard", "BatchSamplerShard",
                    "SeedableRandomSampler", "DataLoaderDispatcher", "SkipDataLoader", "IterableDatasetShard"],
    "hooks": ["ModelHook", "SequentialHook", "AlignDevicesHook", "add_hook_to_module", "remove_hook_from_module",
              "remove_hook_from_submodules", "UserCpuOffloadHook", "CpuOffload", "attach_align_device_hook"],
    "tracking": ["GeneralTracker", "on_main_process", "LoggerType", "TensorBoardTracker", "WandBTracker",
                 "CometMLTracker", "MLflowTracker", "filter_trackers"],
    "launchers": ["notebook_launcher", "debug_launcher", "PrepareForLaunch"],
    "optimizer": ["AcceleratedOptimizer"],
    "scheduler": ["AcceleratedScheduler"],
    "accelerator": ["Accelerator", "AcceleratorState", "AcceleratedOptimizer", "AcceleratedScheduler"],
    "checkpointing": ["MODEL_NAME", "OPTIMIZER_NAME", "SCHEDULER_NAME", "SCALER_NAME", "SAMPLER_NAME",
                      "RNG_STATE_NAME", "save_accelerator_state", "load_accelerator_state"],
    "big_modeling": ["cpu_offload", "disk_offload", "load_checkpoint_in_model", "dispatch_model",
                     "load_checkpoint_and_dispatch", "init_empty_weights"],
}
UTILS = ["is_clearml_available", "is_dvclive_available", "is_pandas_available", "is_matplotlib_available",
         "is_fp16_available", "is_fp8_available", "is_4bit_bnb_available", "is_8bit_bnb_available",
         "is_torchao_available", "RNG_STATE_NAME", "OPTIMIZER_NAME", "SCHEDULER_NAME", "SCALER_NAME", "SAMPLER_NAME",
         "MODEL_NAME", "check_device_map", "offload_state_dict", "offload_weight", "named_module_tensors",
         "retie_parameters", "convert_bytes", "calculate_maximum_sizes", "str_to_bool", "parse_flag_from_env",
         "GatheredParameters", "load_offloaded_weight"]


def _import_from(module: str, name: str) -> tuple[bool, str]:
    """(imported, the ImportError's message) for `from module import name`."""
    try:
        exec(f"from {module} import {name}", {})
        return True, ""
    except ImportError as error:
        return False, str(error)


@pytest.mark.parametrize("module", sorted(USED))
def test_each_used_name_imports_or_says_what_to_use_instead(module):
    real = importlib.import_module(f"accelerate.{module}")
    ours = importlib.import_module(f"cadence.{module}")
    for name in USED[module]:
        assert hasattr(real, name), f"accelerate.{module}.{name}"   # the lists name Accelerate's real names
        imported, message = _import_from(f"cadence.{module}", name)
        assert imported or f"(accelerate.{module}.{name}):" in message, (name, message)
    if module != "big_modeling":   # cadence's own big-model package has names of its own besides
        assert set(ours.__all__) <= set(dir(real)), set(ours.__all__) - set(dir(real))   # no invented names


def test_top_level_and_utils_names_import_or_say_what_to_use_instead():
    for name in ["is_rich_available", "prepare_pippy", "cpu_offload", "disk_offload", "load_checkpoint_in_model"]:
        imported, message = _import_from("cadence", name)
        assert imported or f"(accelerate.{name}):" in message, (name, message)
    for name in UTILS:
        assert hasattr(accelerate.utils, name), name
        imported, message = _import_from("cadence.utils", name)
        assert imported or f"(accelerate.utils.{name}):" in message, (name, message)
    assert not hasattr(cadence, "prepare_pippy") and not hasattr(cadence.utils, "GatheredParameters")


def test_accelerator_state_reads_the_accelerator_built_before_it():
    from cadence.state import AcceleratorState, PartialState, is_initialized
    assert not is_initialized() and AcceleratorState().mixed_precision is None
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    state = AcceleratorState()
    assert is_initialized()
    assert {"no": torch.float32, "bf16": torch.bfloat16}[state.mixed_precision] is torch.bfloat16
    assert (state.distributed_type, state.num_processes, state.process_index, state.device, state.deepspeed_plugin) \
        == (accelerator.distributed_type, 1, 0, accelerator.device, None)
    assert PartialState().num_processes == 1


def test_constants_name_the_files_save_state_writes_in_accelerates_layout(tmp_path):
    from cadence.checkpointing import OPTIMIZER_NAME, RNG_STATE_NAME
    for name in ["RNG_STATE_NAME", "OPTIMIZER_NAME", "SCHEDULER_NAME", "SCALER_NAME", "SAMPLER_NAME", "MODEL_NAME"]:
        assert getattr(cadence.utils, name) == getattr(accelerate.utils, name), name
    accelerator = Accelerator(cpu=True)
    model = nn.Linear(2, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.save_state(tmp_path / "ckpt", safe_serialization=False)
    names = os.listdir(tmp_path / "ckpt")
    assert f"{OPTIMIZER_NAME}.bin" in names and f"{RNG_STATE_NAME}_0.pkl" in names and \
        f"{cadence.utils.MODEL_NAME}.bin" in names


def test_model_helpers_answer_as_accelerates():
    from cadence import utils as ours
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    model.register_buffer("scratch", torch.zeros(2), persistent=False)
    assert ours.calculate_maximum_sizes(model) == accelerate.utils.calculate_maximum_sizes(model)
    for size in [10, 1536, 1 << 20, 5 * (1 << 40), 1 << 60]:
        assert ours.convert_bytes(size) == accelerate.utils.convert_bytes(size)
    for kwargs in [{}, {"recurse": True}, {"recurse": True, "remove_non_persistent": True}, {"include_buffers": False}]:
        assert [n for n, _ in ours.named_module_tensors(model, **kwargs)] == \
            [n for n, _ in accelerate.utils.named_module_tensors(model, **kwargs)]
    for value in ["YES", "off", "1"]:
        assert ours.str_to_bool(value) == accelerate.utils.str_to_bool(value)
        assert ours.str_to_bool(value, to_bool=True) is accelerate.utils.str_to_bool(value, to_bool=True)
    with pytest.raises(ValueError, match="maybe"):
        ours.str_to_bool("maybe")
    ours.check_device_map(model, {"0": "cpu", "1": "cpu", "2": "cpu"})
    with pytest.raises(ValueError, match="2.weight, 2.bias"):
        ours.check_device_map(model, {"0": "cpu", "1": "cpu"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours.check_device_map(model, {"": "cpu", "nope": "cpu"})
    assert "nope" in str(caught[0].message)


def test_parse_flag_from_env(monkeypatch):
    monkeypatch.setenv("CADENCE_TEST_FLAG", "yes")
    assert cadence.utils.parse_flag_from_env("CADENCE_TEST_FLAG") is True
    assert cadence.utils.parse_flag_from_env("CADENCE_TEST_FLAG_UNSET", default=True) is True


def test_retie_parameters_ties_a_broken_pair_again():
    model = nn.Sequential(nn.Embedding(4, 3), nn.Linear(3, 4, bias=False))
    model[1].weight = model[0].weight
    tied = cadence.utils.find_tied_parameters(model)
    model[1].weight = nn.Parameter(torch.empty(4, 3, device="meta"))
    cadence.utils.retie_parameters(model, tied)
    assert model[1].weight is model[0].weight


def test_offload_folder_is_read_by_accelerate_and_reads_accelerates(tmp_path):
    weights = {"a": torch.randn(2, 3).bfloat16(), "b": torch.tensor(3.0), "c": torch.arange(4)}
    for write, read, folder in [(cadence.utils.offload_state_dict, accelerate.utils.load_offloaded_weight, "ours"),
                                (accelerate.utils.offload_state_dict, cadence.utils.load_offloaded_weight, "theirs")]:
        write(tmp_path / folder, weights)
        index = json.loads((tmp_path / folder / "index.json").read_text())
        for name, tensor in weights.items():
            assert torch.equal(read(str(tmp_path / folder / f"{name}.dat"), index[name]), tensor), (folder, name)


def test_prepare_data_loader_deals_batches_as_accelerates():
    from accelerate.data_loader import prepare_data_loader as theirs
    from cadence.data_loader import DataLoaderShard, prepare_data_loader
    for index in range(2):
        ours = prepare_data_loader(DataLoader(range(10), batch_size=2), num_processes=2, process_index=index)
        assert isinstance(ours, DataLoaderShard)
        assert [b.tolist() for b in ours] == \
            [b.tolist() for b in theirs(DataLoader(range(10), batch_size=2), num_processes=2, process_index=index)]
    with pytest.raises(ValueError, match="split_batches"):
        prepare_data_loader(DataLoader(range(4)), split_batches=True)


def test_hooks_run_around_forward_and_remove_takes_cadences_dispatch_hooks_off(tmp_path):
    from cadence.hooks import AlignDevicesHook, ModelHook, add_hook_to_module, remove_hook_from_module

    class Double(ModelHook):
        def post_forward(self, module, output):
            return output * 2

    class AddOne(ModelHook):
        def pre_forward(self, module, x):
            return (x + 1,), {}

    layer, x = nn.Linear(2, 2), torch.ones(1, 2)
    plain = layer(x)
    add_hook_to_module(layer, Double())
    add_hook_to_module(layer, AddOne(), append=True)
    assert torch.allclose(layer(x), 2 * nn.functional.linear(x + 1, layer.weight, layer.bias))
    assert torch.equal(remove_hook_from_module(layer)(x), plain) and "forward" not in layer.__dict__
    add_hook_to_module(layer, AlignDevicesHook("cpu", io_same_device=True))
    assert torch.equal(layer(x), plain)
    with pytest.raises(ValueError, match="disk_offload"):
        AlignDevicesHook("cpu", offload=True)

    real = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    torch.save(real.state_dict(), tmp_path / "w.bin")
    with cadence.init_empty_weights():
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model = cadence.load_checkpoint_and_dispatch(model, str(tmp_path / "w.bin"), device_map={"": "cpu"})
    assert any(m._forward_pre_hooks for m in model.modules())
    remove_hook_from_module(model, recurse=True)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert torch.allclose(model(torch.ones(3, 4)), real(torch.ones(3, 4)))


NLP_STYLE = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from cadence import (Accelerator, DistributedType, PartialState, cpu_offload, disk_offload, load_checkpoint_in_model,
                     is_rich_available)
from cadence.utils import (set_seed, gather_object, ProjectConfiguration, GradientAccumulationPlugin, LoggerType,
                           tqdm, is_pandas_available, RNG_STATE_NAME, str_to_bool)
from cadence.logging import get_logger
from cadence.state import AcceleratorState, GradientState, is_initialized
from cadence.data_loader import skip_first_batches, prepare_data_loader
from cadence.hooks import remove_hook_from_module, add_hook_to_module, AlignDevicesHook
from cadence.tracking import GeneralTracker, on_main_process
from cadence.optimizer import AcceleratedOptimizer
from cadence.scheduler import AcceleratedScheduler
from cadence.launchers import notebook_launcher, debug_launcher
from cadence.accelerator import Accelerator as A2
from cadence.checkpointing import OPTIMIZER_NAME
from cadence.big_modeling import cpu_offload, disk_offload, load_checkpoint_in_model

logger = get_logger(__name__)
set_seed(0)
acc = Accelerator(mixed_precision="bf16", project_config=ProjectConfiguration(project_dir="run",
                  automatic_checkpoint_naming=True), gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
dtype = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[AcceleratorState().mixed_precision]
model = nn.Linear(4, 2); opt = torch.optim.SGD(model.parameters(), 0.1)
sched = torch.optim.lr_scheduler.StepLR(opt, 1)
dl = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 2)), batch_size=4)
model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
assert isinstance(opt, AcceleratedOptimizer) and isinstance(sched, AcceleratedScheduler)
for x, y in tqdm(skip_first_batches(dl, 1), disable=not acc.is_local_main_process):
    with acc.accumulate(model):
        acc.backward(((model(x) - y) ** 2).mean()); opt.step(); sched.step(); opt.zero_grad()
acc.save_state()
print("done", dtype, is_initialized(), gather_object([acc.process_index]))
"""


def test_an_accelerate_script_swapped_to_cadence_runs(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(NLP_STYLE))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done torch.bfloat16 True [0]" in out.stdout
    assert (tmp_path / "run" / "checkpoints" / "checkpoint_0").is_dir()


def test_utils_save_and_load_as_accelerates(tmp_path):
    """`accelerate.utils.save` / `load`: a state written by the main process and read back, numpy RNG states
    included, with `weights_only` (no code unpickled); `safe_serialization` writes safetensors."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from cadence.utils import load, save

    state = {"w": torch.arange(3.0), "rng": np.random.get_state()}
    save(state, tmp_path / "state.pt")
    back = load(tmp_path / "state.pt")
    assert torch.equal(back["w"], state["w"]) and np.array_equal(back["rng"][1], state["rng"][1])
    save({"w": torch.ones(2)}, tmp_path / "w.safetensors", safe_serialization=True)
    assert torch.equal(load_file(tmp_path / "w.safetensors")["w"], torch.ones(2))
