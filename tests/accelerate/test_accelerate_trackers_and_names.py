"""The tracker API (`accelerator.trackers`, `get_tracker(...).tracker`), the names Accelerate's users import
(LoggerType, PrecisionType, AutocastKwargs, skip_first_batches, cpu_offload, ...) and GradientState's attributes,
each against real Accelerate run in a fresh process (it keeps process-wide singletons)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader

import cadence
from cadence import Accelerator, AutocastKwargs, cpu_offload, disk_offload, init_empty_weights, skip_first_batches
from cadence.accelerate.state import AcceleratorState
from cadence.utils import (LoggerType, PrecisionType, RNGType, broadcast_object_list, is_compiled_module,
                           is_peft_model, load_checkpoint_in_model, write_basic_config)


def _run(library: str, body: str, tmp_path) -> dict:
    """`body` (which sets `out`) run with `library` as `lib`, in a fresh process; `out` as JSON."""
    code = (f"import json, torch\nimport {library} as lib\nimport {library}.utils as lib_utils\n"
            f"from torch.utils.data import DataLoader\n{textwrap.dedent(body)}\nprint(json.dumps(out))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "ACCELERATE_MIXED_PRECISION": "no"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _both(body: str, tmp_path) -> tuple[dict, dict]:
    """(Accelerate's `out`, cadence's), each run in a directory of its own."""
    for lib in ("accelerate", "cadence"):
        (tmp_path / lib).mkdir()
    return _run("accelerate", body, tmp_path / "accelerate"), _run("cadence", body, tmp_path / "cadence")


TRACKERS = """
acc = lib.Accelerator(cpu=True, log_with=["tensorboard", "wandb"], project_dir="runs")
acc.init_trackers("proj", config={"lr": 0.1})
out = {"len": len(acc.trackers), "names": [t.name for t in acc.trackers], "first": acc.trackers[0].name,
       "last": acc.trackers[-1].name, "slice": [t.name for t in acc.trackers[:1]],
       "same": acc.trackers[1] is acc.get_tracker("wandb"),
       "facts": {t.name: {"tracker": type(t.tracker).__name__, "requires_logging_directory": t.requires_logging_directory,
                          "main_process_only": t.main_process_only,
                          "unwrapped_is_tracker": acc.get_tracker(t.name, unwrap=True) is t.tracker}
                 for t in acc.trackers},
       "wandb_lr": acc.get_tracker("wandb").tracker.config["lr"]}
acc.get_tracker("tensorboard").tracker.add_scalar("direct", 1.5, 7)
acc.end_training()
"""


def test_trackers_are_accelerates_list_and_each_tracker_gives_its_underlying_object(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    theirs, ours = _both(TRACKERS, tmp_path)
    assert ours == theirs, (ours, theirs)
    assert ours["facts"]["tensorboard"]["tracker"] == "SummaryWriter" and ours["facts"]["wandb"]["tracker"] == "Run"
    (events,) = (tmp_path / "cadence" / "runs").rglob("events.out.tfevents.*")   # what `.tracker` wrote is there
    tb = EventAccumulator(str(events.parent))
    tb.Reload()
    assert [(e.step, e.value) for e in tb.Scalars("direct")] == [(7, 1.5)]


def test_every_cadence_tracker_has_accelerates_attributes(tmp_path):
    from cadence.callbacks import CSVTracker, GeneralTracker, TensorBoardTracker, WandbTracker

    expected = {TensorBoardTracker: (True, True), WandbTracker: (False, False), CSVTracker: (True, True),
                GeneralTracker: (False, True)}
    for cls, (directory, main_only) in expected.items():
        assert (cls.requires_logging_directory, cls.main_process_only) == (directory, main_only), cls
        assert isinstance(cls.name, str)
    csv = CSVTracker(dir=tmp_path)
    assert csv.tracker is csv   # writes its own file: no object underneath


ENUMS = """
out = {name: [[m.name, str(m)] for m in getattr(lib_utils, name)] for name in ("LoggerType", "PrecisionType", "RNGType")}
out["contains"] = ["wandb" in lib_utils.LoggerType, "nope" in lib_utils.LoggerType]
out["list"] = lib_utils.PrecisionType.list()
out["str_equal"] = lib_utils.PrecisionType.BF16 == "bf16"
"""


def test_logger_precision_and_rng_types_are_accelerates_enums(tmp_path):
    theirs, ours = _both(ENUMS, tmp_path)
    assert ours == theirs
    acc = Accelerator(cpu=True, log_with=[LoggerType.TENSORBOARD], project_dir=tmp_path)
    acc.init_trackers("proj")
    assert acc.trackers[0].name == "tensorboard"
    acc.end_training()
    AcceleratorState._reset_state()  # one mixed precision per process, as Accelerate's AcceleratorState keeps
    assert Accelerator(cpu=True, mixed_precision=PrecisionType.BF16).mixed_precision == "bf16"
    assert Accelerator(cpu=True, rng_types=[RNGType.TORCH]).rng_types == ["torch"]


GRADIENT_STATE = """
acc = lib.Accelerator(cpu=True)
gs = acc.gradient_state
def facts():
    return [gs.end_of_dataloader, gs.remainder, gs.in_dataloader, gs.adjust_scheduler, gs.plugin_kwargs,
            gs.active_dataloader is None, gs.sync_with_dataloader]
out = {"before": facts(), "during": []}
for batch in acc.prepare(DataLoader(torch.arange(5.), batch_size=2)):
    out["during"].append(facts())
out["after"] = facts()
for batch in acc.prepare(DataLoader(torch.arange(4.), batch_size=2)):
    pass
out["after_even"] = facts()
for batch in acc.prepare(DataLoader(torch.arange(5.), batch_size=2, drop_last=True)):
    out["drop_last"] = facts()
"""


def test_gradient_state_answers_as_accelerates_before_during_and_after_a_loop(tmp_path):
    theirs, ours = _both(GRADIENT_STATE, tmp_path)
    assert ours == theirs
    assert ours["during"][-1][:3] == [True, 1, True] and ours["after"][:3] == [False, -1, False]


AUTOCAST = """
from {lib}.utils import AutocastKwargs
def dtypes(handler):
    acc = lib.Accelerator(cpu=True, mixed_precision="bf16", kwargs_handlers=[handler] if handler else None)
    inner = torch.nn.Sequential(torch.nn.Linear(2, 2))
    seen = []   # the layer's output dtype: the prepared model's own output comes back in fp32
    inner[0].register_forward_hook(lambda m, i, o: seen.append(str(o.dtype)))
    model = acc.prepare(inner)
    out = model(torch.ones(1, 2))
    with acc.autocast(autocast_handler=AutocastKwargs(enabled=False)):
        block_off = torch.is_autocast_enabled("cpu")
    with acc.autocast():
        block_default = torch.is_autocast_enabled("cpu")
    return [seen[0], str(out.dtype), block_off, block_default, repr(acc.autocast_handler)]
out = {{"none": dtypes(None), "off": dtypes(AutocastKwargs(enabled=False)),
        "no_cache": dtypes(AutocastKwargs(cache_enabled=False))}}
"""


def test_autocast_kwargs_is_honoured_in_kwargs_handlers_and_in_autocast_as_in_accelerate(tmp_path):
    theirs = _run("accelerate", AUTOCAST.format(lib="accelerate"), tmp_path)
    ours = _run("cadence", AUTOCAST.format(lib="cadence"), tmp_path)
    assert ours == theirs
    assert ours["off"][0] == "torch.float32" and ours["none"][0] == "torch.bfloat16"
    assert "AutocastKwargs(enabled=False" in ours["off"][-1]
    with pytest.raises(ValueError, match="two AutocastKwargs"):
        Accelerator(cpu=True, kwargs_handlers=[AutocastKwargs(), AutocastKwargs(enabled=False)])


SKIP = """
dl = lib.skip_first_batches(DataLoader(torch.arange(10), batch_size=3), 2)
out = {"batches": [b.tolist() for b in dl], "again": [b.tolist() for b in dl], "len": len(dl)}
"""


def test_top_level_skip_first_batches_skips_a_plain_loader_as_accelerates(tmp_path):
    theirs, ours = _both(SKIP, tmp_path)
    assert ours == theirs == {"batches": [[6, 7, 8], [9]], "again": [[6, 7, 8], [9]], "len": 2}
    acc = Accelerator(cpu=True)
    prepared = acc.prepare(DataLoader(torch.arange(6), batch_size=2))
    assert [b.tolist() for b in skip_first_batches(prepared, 2)] == [[4, 5]]
    with pytest.raises(TypeError, match="torch DataLoader or a loader returned by prepare"):
        skip_first_batches([1, 2, 3], 1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.a(x).relu())


def test_load_checkpoint_in_model_cpu_offload_and_disk_offload_give_the_models_outputs(tmp_path):
    torch.manual_seed(0)
    ref, x = Net(), torch.randn(3, 4)
    save_file(ref.state_dict(), tmp_path / "model.safetensors")
    with init_empty_weights():
        model = Net()
    assert load_checkpoint_in_model(model, tmp_path) is None
    assert not any(p.is_meta for p in model.parameters()) and torch.equal(model(x), ref(x))
    half = Net()
    load_checkpoint_in_model(half, tmp_path / "model.safetensors", dtype=torch.float16)
    assert half.a.weight.dtype == torch.float16 and isinstance(half.a.weight, nn.Parameter)
    with pytest.raises(ValueError, match="missing keys"):
        load_checkpoint_in_model(nn.Linear(4, 4), tmp_path, strict=True)
    with pytest.raises(ValueError, match="load_checkpoint_and_dispatch"):
        load_checkpoint_in_model(Net(), tmp_path, device_map={"": "disk"})
    expected = ref(x)
    on_disk = Net()
    on_disk.load_state_dict(ref.state_dict())
    out = disk_offload(on_disk, tmp_path / "offload", execution_device="cpu")(x)
    assert torch.allclose(out, expected) and list((tmp_path / "offload").glob("*.safetensors"))
    on_cpu = Net()
    on_cpu.load_state_dict(ref.state_dict())
    assert torch.allclose(cpu_offload(on_cpu)(x), expected)


def test_write_basic_config_writes_cadences_config_once(tmp_path):
    from cadence.distributed.config import load_config

    path = write_basic_config(mixed_precision="bf16", save_location=tmp_path / "cfg.yaml")
    config = load_config(path)
    gpus = torch.cuda.device_count()
    assert (config.mixed_precision, config.num_processes, config.use_cpu) == ("bf16", max(gpus, 1), gpus == 0)
    assert write_basic_config(save_location=path) is False   # an existing file is left alone, as Accelerate's


def test_small_utils_answer_as_accelerates():
    objects = [{"a": 1}, "b"]
    assert broadcast_object_list(objects) is objects == [{"a": 1}, "b"]
    net = nn.Linear(2, 2)
    assert is_peft_model(net) is False and is_compiled_module(net) is False
    assert is_compiled_module(torch.compile(net)) is True
    for name in ("LoggerType", "PrecisionType", "broadcast_object_list", "load_checkpoint_in_model",
                 "write_basic_config", "is_peft_model", "AutocastKwargs"):
        assert hasattr(cadence.utils, name), name
    for name in ("skip_first_batches", "cpu_offload", "disk_offload", "AutocastKwargs", "load_checkpoint_in_model"):
        assert name in cadence.__all__, name
