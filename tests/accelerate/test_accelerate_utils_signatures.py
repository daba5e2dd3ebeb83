"""`cadence.utils` against the real `accelerate.utils` (1.15, imported here): the same calls, keywords and results on
one process, the same parameter names and defaults, and the collectives' semantics on 2 processes
(`cadence launch`; the expected values follow Accelerate's `utils/operations.py`)."""

import inspect
import json
from collections import namedtuple

import accelerate
import accelerate.utils as A
import pytest
import torch
from torch import nn

import cadence
import cadence.utils as C
from helpers import run_launch

Pair = namedtuple("Pair", "x y")


def _same(a, b) -> bool:
    """Equal values of the same types, tensors compared by dtype and content, containers recursively."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _outcome(fn):
    try:
        return fn()
    except Exception as e:  # the same kind of failure on both sides
        return type(e)


T = torch.tensor([1.0, 2.0])
CALLS = {
    "broadcast(t, from_process=0)": lambda U: U.broadcast(T.clone(), from_process=0),
    "broadcast(nested)": lambda U: U.broadcast({"a": [T.clone()]}),
    "reduce(t) default": lambda U: U.reduce(T.clone()),
    "reduce(t, reduction='sum')": lambda U: U.reduce(T.clone(), reduction="sum"),
    "reduce(t, 'sum', 2.0)": lambda U: U.reduce(T.clone(), "sum", 2.0),
    "reduce(t, 'mean', scale=2.0)": lambda U: U.reduce(T.clone(), "mean", scale=2.0),
    "reduce(t, reduction='none')": lambda U: U.reduce(T.clone(), reduction="none"),
    "reduce(int, 'mean')": lambda U: U.reduce(torch.tensor([3]), "mean"),
    "reduce(nested)": lambda U: U.reduce({"a": (T, Pair(T, T))}, "max"),
    "reduce([1, 2])": lambda U: U.reduce([1, 2]),
    "gather(tensor=t)": lambda U: U.gather(tensor=T),
    "gather([1, 2])": lambda U: U.gather([1, 2]),
    "gather(0-d)": lambda U: U.gather(torch.tensor(3.0)),
    "pad_across_processes(tensor=t, ...)": lambda U: U.pad_across_processes(tensor=T, dim=0, pad_index=0, pad_first=False),
    "send_to_device(skip_keys='b')": lambda U: U.send_to_device({"a": T, "b": T}, "cpu", non_blocking=True, skip_keys="b"),
    "send_to_device(skip_keys=list)": lambda U: U.send_to_device([{"a": T, "b": 1}], torch.device("cpu"), skip_keys=["a"]),
    "send_to_device(namedtuple)": lambda U: U.send_to_device(Pair(T, "s"), "cpu"),
    "concatenate(lists)": lambda U: U.concatenate([[T, {"k": T}], [T, {"k": T}]]),
    "concatenate(dim=1)": lambda U: U.concatenate([torch.ones(2, 1), torch.zeros(2, 2)], dim=1),
    "concatenate([5])": lambda U: U.concatenate([5]),
    "concatenate(strings)": lambda U: U.concatenate(["a", "b"]),
    "find_batch_size(dict)": lambda U: U.find_batch_size({"a": torch.ones(3, 2), "b": torch.ones(5)}),
    "find_batch_size(list)": lambda U: U.find_batch_size([(torch.ones(4),), T]),
    "find_batch_size([])": lambda U: U.find_batch_size([]),
    "find_batch_size('x')": lambda U: U.find_batch_size(["x"]),
    "ignorant_find_batch_size": lambda U: U.ignorant_find_batch_size({}),
    "recursively_apply": lambda U: U.recursively_apply(lambda x, k, m=1: x * k * m, {"a": T, "b": ["s", (T,)]}, 2, m=3),
    "recursively_apply(test_type)": lambda U: U.recursively_apply(str.upper, ["a", 1], test_type=lambda o: isinstance(o, str)),
    "recursively_apply(error_on_other_type)": lambda U: U.recursively_apply(abs, [T, "s"], error_on_other_type=True),
    "convert_to_fp32": lambda U: U.convert_to_fp32({"h": T.half(), "b": [T.bfloat16()], "i": torch.ones(1, dtype=torch.long)}),
    "listify": lambda U: U.listify({"a": T.bfloat16(), "b": [torch.tensor(3)]}),
    "find_device": lambda U: (U.find_device({"a": "s", "b": [T]}), U.find_device(["s"])),
    "honor_type": lambda U: (U.honor_type(Pair(1, 2), iter([3, 4])), U.honor_type([1], iter((5,)))),
    "is_namedtuple": lambda U: (U.is_namedtuple(Pair(1, 2)), U.is_namedtuple((1, 2))),
    "is_torch_tensor": lambda U: (U.is_torch_tensor(T), U.is_torch_tensor(1.0)),
    "is_torch_version": lambda U: [U.is_torch_version(op, v) for op in (">", ">=", "==", "!=", "<=", "<")
                                   for v in ("2.0", torch.__version__, "99")],
    "compare_versions": lambda U: [U.compare_versions("numpy", op, "1.0") for op in (">", "==", "!=", "<")],
    "compare_versions(bad op)": lambda U: U.compare_versions("torch", "~=", "2.0"),
    "get_max_memory(dict)": lambda U: U.get_max_memory({"disk": "1GB", "cpu": "5Mb", 0: 12}),
    "get_max_memory() devices": lambda U: sorted(map(str, U.get_max_memory())),
    "get_max_memory(bad device)": lambda U: U.get_max_memory({"tpu": 1}),
    "convert_file_size_to_int": lambda U: [U.convert_file_size_to_int(s) for s in ("1GiB", "3MB", "8Mb", "2kb", 7)],
    "constants": lambda U: [U.WEIGHTS_NAME, U.SAFE_WEIGHTS_NAME, U.WEIGHTS_INDEX_NAME, U.SAFE_WEIGHTS_INDEX_NAME,
                            U.MODEL_NAME, U.SAFE_MODEL_NAME],
}


@pytest.mark.parametrize("call", list(CALLS))
def test_same_call_same_result_on_one_process(call):
    ours, theirs = _outcome(lambda: CALLS[call](C)), _outcome(lambda: CALLS[call](A))
    assert _same(ours, theirs), f"{call}: cadence {ours!r}, accelerate {theirs!r}"


def test_one_process_returns_what_accelerate_returns():
    items = [1, 2]
    assert C.gather(items) is items and A.gather(items) is items
    t = torch.ones(2)
    out = C.reduce(t, "sum")
    assert out is not t and torch.equal(out, t)   # a copy, as Accelerate's


def test_set_seed_deterministic():
    was = torch.are_deterministic_algorithms_enabled()
    try:
        draws = []
        for U in (C, A):
            torch.use_deterministic_algorithms(False)
            U.set_seed(1, deterministic=True)
            draws.append((torch.rand(3), torch.are_deterministic_algorithms_enabled()))
        assert torch.equal(draws[0][0], draws[1][0]) and draws[0][1] is draws[1][1] is True
    finally:
        torch.use_deterministic_algorithms(was)


def test_convert_outputs_to_fp32_wraps_a_forward():
    torch.manual_seed(0)
    outs = []
    for U in (C, A):
        net = nn.Linear(2, 2).to(torch.bfloat16)
        plain = net.forward
        net.forward = U.convert_outputs_to_fp32(net.forward)
        outs.append(net(torch.ones(1, 2, dtype=torch.bfloat16)))
        assert inspect.unwrap(net.forward) == plain
    assert outs[0].dtype == outs[1].dtype == torch.float32


@pytest.mark.parametrize("keep", [True, False])
def test_extract_model_from_parallel_keep_torch_compile(keep):
    results = []
    for U in (C, A):
        net = nn.Linear(2, 2)
        compiled = torch.compile(nn.DataParallel(net))
        out = U.extract_model_from_parallel(compiled, keep_torch_compile=keep)
        results.append((out is compiled, (out._orig_mod if keep else out) is net))
    assert results[0] == results[1] == (keep, True)


def test_accelerator_keywords():
    outs = []
    for lib in (cadence, accelerate):
        acc = lib.Accelerator(cpu=True)
        model = acc.prepare(nn.Linear(2, 2))
        outs.append((acc.reduce(T.clone(), reduction="none"), acc.reduce(T.clone()), acc.reduce(T.clone(), "mean", 2.0),
                     type(acc.unwrap_model(model, keep_torch_compile=False)), acc.gather([1, 2])))
    assert _same(outs[0], outs[1]), outs


@pytest.mark.parametrize("keep", [True, False])
def test_unwrap_model_of_a_compiled_model(keep):
    """A model compiled before `prepare`: Accelerate gives back its compile wrapper (`_orig_mod.` names) unless
    `keep_torch_compile=False`; the 2-process case is in `test_collectives_on_two_processes`."""
    outs = []
    for lib in (cadence, accelerate):
        net = nn.Linear(2, 2)
        acc = lib.Accelerator(cpu=True)
        out = acc.unwrap_model(acc.prepare(torch.compile(net, backend="eager")), keep_torch_compile=keep)
        outs.append((type(out).__name__, list(out.state_dict()), getattr(out, "_orig_mod", out) is net))
    assert outs[0] == outs[1] == ("OptimizedModule" if keep else "Linear",
                                  ["_orig_mod.weight", "_orig_mod.bias"] if keep else ["weight", "bias"], True)


SIGNATURES = ["broadcast", "reduce", "gather", "gather_object", "pad_across_processes", "broadcast_object_list",
              "send_to_device", "set_seed", "concatenate", "find_batch_size", "ignorant_find_batch_size",
              "recursively_apply", "convert_to_fp32", "convert_outputs_to_fp32", "listify", "find_device", "honor_type",
              "is_namedtuple", "is_torch_tensor", "is_torch_version", "compare_versions", "get_max_memory",
              "convert_file_size_to_int", "extract_model_from_parallel"]


def _params(fn):
    """(name, kind, default) of each parameter; a function default by its name (each library has its own)."""
    return [(p.name, p.kind, getattr(p.default, "__name__", p.default))
            for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", SIGNATURES)
def test_parameter_names_and_defaults_match(name):
    assert _params(getattr(C, name)) == _params(getattr(A, name))


@pytest.mark.parametrize("method", ["reduce", "gather", "pad_across_processes", "unwrap_model"])
def test_accelerator_method_parameters_match(method):
    assert _params(getattr(cadence.Accelerator, method)) == _params(getattr(accelerate.Accelerator, method))


SCRIPT = '''
import json, torch
from cadence import Accelerator
from cadence.utils import broadcast, gather, reduce
acc = Accelerator()
r = acc.process_index
t = torch.tensor([r + 1.0, 10.0 * (r + 1)])
out = {"broadcast": broadcast(torch.tensor([float(r)]), from_process=1).tolist(),
       "broadcast nested": broadcast({"a": [torch.tensor([r])]}, from_process=1)["a"][0].tolist(),
       "gather": gather(tensor=torch.tensor([r])).tolist(),
       "acc.reduce": acc.reduce(t.clone()).tolist(),
       "acc.reduce scale": acc.reduce(t.clone(), "sum", scale=2.0).tolist()}
for red in ("mean", "sum", "max", "min", "none"):
    out[red] = reduce(t.clone(), reduction=red).tolist()
for name, call in [("int mean", lambda: reduce(torch.tensor([r + 1]), "mean")), ("gather ints", lambda: gather([1, 2])),
                   ("broadcast ints", lambda: broadcast([1, 2]))]:
    try:
        out[name] = call().tolist()
    except Exception as e:
        out[name] = type(e).__name__
net = torch.nn.Linear(2, 2)
model = acc.prepare(torch.compile(net, backend="eager"))     # DDP around the compiled module
for keep in (True, False):
    inner = acc.unwrap_model(model, keep_torch_compile=keep)
    out[f"unwrap keep={keep}"] = [type(inner).__name__, list(inner.state_dict()), getattr(inner, "_orig_mod", inner) is net]
print("RESULT", r, json.dumps(out), flush=True)
'''


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_collectives_on_two_processes(tmp_path):
    script = tmp_path / "utils_collectives.py"
    script.write_text(SCRIPT)
    proc = run_launch(script, nproc=2, timeout=200)
    results = {int(line.split()[1]): json.loads(line.split(" ", 2)[2])
               for line in proc.stdout.splitlines() if line.startswith("RESULT ")}
    assert sorted(results) == [0, 1], proc.stdout + proc.stderr
    for out in results.values():
        assert out["broadcast"] == [1.0] and out["broadcast nested"] == [1] and out["gather"] == [0, 1]
        assert out["mean"] == [1.5, 15.0] and out["sum"] == out["none"] == out["acc.reduce"] == [3.0, 30.0]
        assert out["max"] == [2.0, 20.0] and out["min"] == [1.0, 10.0]
        assert out["acc.reduce scale"] == [3.0, 30.0]   # as Accelerate: `scale` applies on XLA only
        assert out["int mean"] == "RuntimeError" and out["gather ints"] == out["broadcast ints"] == "TypeError"
        # Accelerate 1.15 under `accelerate launch --cpu --num_processes 2`: the same two answers
        assert out["unwrap keep=True"] == ["OptimizedModule", ["_orig_mod.weight", "_orig_mod.bias"], True]
        assert out["unwrap keep=False"] == ["Linear", ["weight", "bias"], True]
