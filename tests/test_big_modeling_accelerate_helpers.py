"""Accelerate's model-memory helpers under cadence (`cadence.utils` / `cadence`), compared with the real Accelerate
1.15 (imported here) on the same inputs, and the "balanced" device maps of `load_checkpoint_and_dispatch`."""

import accelerate
import accelerate.utils as A
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import cadence
import cadence.utils as C


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        return x + self.b(self.a(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 64)
        self.blocks = nn.ModuleList([Block() for _ in range(6)])
        self.head = nn.Linear(64, 100)
        self.register_buffer("mask", torch.ones(10, dtype=torch.bool))

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _empty():
    with cadence.init_empty_weights():
        return Net()


MEMORIES = [{0: "1MB", 1: "1MB", "cpu": "10MB"}, {0: 10**6, 1: 10**6, 2: 10**6, "cpu": 10**7},
            {0: 200000, 1: 300000, "cpu": 10**7}, {"cpu": 10**7}, {0: 10**6, "cpu": 10**7}, {0: 10**6, 1: 0, 2: 10**6}]


@pytest.mark.parametrize("max_memory", MEMORIES)
@pytest.mark.parametrize("no_split", [None, ["Block"]])
@pytest.mark.parametrize("low_zero", [False, True])
def test_get_balanced_memory_splits_as_accelerate(max_memory, no_split, low_zero):
    model = _empty()
    ours = C.get_balanced_memory(model, dict(max_memory), no_split_module_classes=no_split, low_zero=low_zero)
    theirs = A.get_balanced_memory(model, dict(max_memory), no_split_module_classes=no_split, low_zero=low_zero)
    assert ours == theirs and list(ours) == list(theirs)


def test_get_balanced_memory_literals_from_accelerate():
    # .venv/bin/python /tmp/fix_misc/ref_bal.py (Accelerate 1.15's get_balanced_memory on this Net, CPU only)
    model = _empty()
    assert C.get_balanced_memory(model, {0: 10**6, 1: 10**6, 2: 10**6, "cpu": 10**7}, ["Block"]) == {
        0: 125360.0, 1: 125360.0, 2: 1000000, "cpu": 10000000}
    assert C.get_balanced_memory(model, {0: 10**6, 1: 10**6, 2: 10**6, "cpu": 10**7}, low_zero=True) == {
        0: 0, 1: 148075.0, 2: 1000000, "cpu": 10000000}
    assert C.get_balanced_memory(model, {0: 10**6, 1: 10**6, "cpu": 10**7}, ["Block"], dtype=torch.float16) == {
        0: 83620.0, 1: 1000000, "cpu": 10000000}


@pytest.mark.parametrize("kwargs", [{}, {"dtype": torch.float16}, {"dtype": "bfloat16"}, {"buffers_only": True},
                                    {"special_dtypes": {"head.weight": torch.float64}}])
def test_compute_module_sizes_as_accelerate(kwargs):
    model = _empty()
    assert dict(C.compute_module_sizes(model, **kwargs)) == dict(A.compute_module_sizes(model, **kwargs))


def test_find_tied_parameters_as_accelerate():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    model[2].weight = model[1].weight = model[0].weight
    assert C.find_tied_parameters(model) == A.find_tied_parameters(model) == [["0.weight", "1.weight", "2.weight"]]
    assert C.find_tied_parameters(Net()) == A.find_tied_parameters(Net()) == []


@pytest.mark.parametrize("name", ["compute_module_sizes", "get_balanced_memory", "find_tied_parameters",
                                  "set_module_tensor_to_device", "load_state_dict", "dtype_byte_size"])
def test_parameter_names_match_accelerate(name):
    params = lambda fn: [(p.name, p.default) for p in __import__("inspect").signature(fn).parameters.values()]
    assert params(getattr(C, name)) == params(getattr(A, name))


def _set_results(lib):
    with lib.init_empty_weights():
        layer = nn.Linear(2, 2)
    out = []
    lib_utils = C if lib is cadence else A
    lib_utils.set_module_tensor_to_device(layer, "bias", "cpu", value=torch.tensor([1, 2]))  # cast to float32
    out.append((layer.bias.dtype, layer.bias.tolist(), type(layer.bias).__name__, layer.bias.requires_grad))
    lib_utils.set_module_tensor_to_device(layer, "weight", "cpu", value=torch.ones(2, 2), dtype=torch.float16)
    out.append((layer.weight.dtype, layer.weight.device.type))
    model = nn.Sequential(nn.Linear(2, 2))
    model.register_buffer("steps", torch.zeros(2, dtype=torch.int64))
    lib_utils.set_module_tensor_to_device(model, "steps", "meta", dtype=torch.float16)
    out.append((model.steps.dtype, model.steps.device.type))
    weight = model[0].weight
    lib_utils.set_module_tensor_to_device(model, "0.weight", "cpu")
    out.append(model[0].weight is weight)
    for call in (lambda: lib_utils.set_module_tensor_to_device(model, "0.nope", "cpu"),
                 lambda: lib_utils.set_module_tensor_to_device(model, "0.weight", "cpu", value=torch.ones(3))):
        with pytest.raises(ValueError):
            call()
    with lib.init_empty_weights():
        empty = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="meta"):
        lib_utils.set_module_tensor_to_device(empty, "weight", "cpu")
    return out


def test_set_module_tensor_to_device_as_accelerate():
    assert _set_results(cadence) == _set_results(accelerate)


@pytest.mark.parametrize("suffix", [".safetensors", ".bin"])
def test_load_state_dict_as_accelerate(tmp_path, suffix):
    state = {k: v.contiguous() for k, v in Net().state_dict().items()}
    path = str(tmp_path / f"w{suffix}")
    save_file(state, path, metadata={"format": "pt"}) if suffix == ".safetensors" else torch.save(state, path)
    for device_map in (None, {"": "cpu"}, {"emb": "cpu", "blocks": "disk", "head": "cpu"}):
        ours, theirs = C.load_state_dict(path, device_map), A.load_state_dict(path, device_map)
        assert sorted(ours) == sorted(theirs)
        assert all(torch.equal(ours[k], theirs[k]) and ours[k].device == theirs[k].device for k in ours)


def test_load_state_dict_refuses_code_in_a_pickle(tmp_path):
    torch.save({"w": torch.ones(1), "obj": Block}, tmp_path / "evil.bin")
    with pytest.raises(Exception, match="[Ww]eights only|weights_only|Unsupported"):
        C.load_state_dict(str(tmp_path / "evil.bin"))


class Recorded(nn.Linear):
    """A layer that records where it is moved (no GPU here: the execution device is the CPU)."""

    def __init__(self, log, name):
        super().__init__(2, 2)
        self.log, self.name = log, name

    def to(self, *args, **kwargs):
        self.log.append((self.name, str(args[0])))
        return super().to(*args, **kwargs)


def _offload_moves(lib):
    log = []
    first, hook_1 = lib.cpu_offload_with_hook(Recorded(log, "first"), "cpu")
    second, hook_2 = lib.cpu_offload_with_hook(Recorded(log, "second"), "cpu", prev_module_hook=hook_1)
    first(torch.ones(1, 2))
    second(first(torch.ones(1, 2)))
    hook_2.offload()
    hook_2.remove()
    second(torch.ones(1, 2))
    return [(name, torch.device(d).type) for name, d in log]


def test_cpu_offload_with_hook_moves_the_model_as_accelerates():
    assert "cpu_offload_with_hook" in cadence.__all__
    ours, theirs = _offload_moves(cadence), _offload_moves(accelerate)
    # both move each model to the CPU when hooked; the CPU being the execution device here, cadence moves nothing
    # more (Accelerate compares torch.device("cpu") with the string "cpu" and moves again, to where it is)
    assert ours[:2] == theirs[:2] == [("first", "cpu"), ("second", "cpu")]
    assert ours == [("first", "cpu"), ("second", "cpu"), ("second", "cpu")]   # the last: hook_2.offload()
    log = []
    layer, hook = cadence.cpu_offload_with_hook(Recorded(log, "layer"), "meta")
    with torch.device("meta"):
        layer(torch.ones(1, 2))               # moved to the execution device, inputs with it
    assert layer.weight.is_meta and log[-1] == ("layer", "meta")
    hook.remove()
    layer(torch.ones(1, 2, device="meta"))    # no hook: stays
    assert log[-1] == ("layer", "meta") and len(log) == 2


def _dispatched_map(lib, path, device_map):
    with lib.init_empty_weights():
        model = Net()
    return lib.load_checkpoint_and_dispatch(model, path, device_map=device_map,
                                            no_split_module_classes=["Block"]).hf_device_map


@pytest.mark.parametrize("device_map", ["balanced", "balanced_low_0"])
def test_balanced_device_maps_load_as_accelerate_on_a_cpu_machine(tmp_path, device_map):
    torch.manual_seed(0)
    ref = Net()
    path = str(tmp_path / "model.safetensors")
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path, metadata={"format": "pt"})
    assert _dispatched_map(cadence, path, device_map) == _dispatched_map(accelerate, path, device_map) == {"": "cpu"}
    with cadence.init_empty_weights():
        model = Net()
    model = cadence.load_checkpoint_and_dispatch(model, path, device_map=device_map)
    x = torch.tensor([[1, 2, 3]])
    assert torch.equal(model(x), ref(x))


def test_an_unknown_device_map_strategy_is_named():
    with pytest.raises(ValueError, match="'balance'"):
        cadence.big_modeling.dispatch.auto_device_map(_empty(), "balance")


def test_cpu_offload_with_hook_moves_the_inputs_at_every_call():
    """The model stays on its execution device after the first call; the inputs of every later call still go there
    ("meta" stands in for a GPU: a CPU input reaching a model on another device fails)."""
    from cadence import cpu_offload_with_hook

    model, hook = cpu_offload_with_hook(torch.nn.Linear(4, 2), execution_device="meta")
    for _ in range(2):
        assert model(torch.ones(1, 4)).device.type == "meta"
    assert model.weight.device.type == "meta"   # it stays there until hook.offload()
