"""torch.compile: Learner(compile=...), learn.compile(), the launcher's dynamo settings, weights without `_orig_mod.`.

Fast backends ("eager", "aot_eager", or a counting backend) keep these quick; one test runs inductor
when a C compiler exists. Importing torch._dynamo costs seconds on a loaded machine, so most are slow.
"""

import copy
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch._dynamo.utils import counters

from cadence import Checkpoint, Learner
from cadence.compile import is_compiled, options_from_env, uncompile
from cadence.distributed.config import from_dict
from helpers import cadence_env, run_launch


def keys_of(path):
    """Tensor names in a safetensors file, or in every one under a directory (learn.save may write either)."""
    path = Path(path)
    keys = set()
    for file in sorted(path.rglob("*.safetensors")) if path.is_dir() else [path]:
        with safe_open(str(file), framework="pt") as f:
            keys |= set(f.keys())
    return keys


def plain_keys():
    return {"0.weight", "0.bias", "2.weight", "2.bias"}


def counting_backend(calls):
    def backend(gm, example_inputs):  # a real torch.compile backend: runs the captured graph eagerly
        calls.append(len(gm.graph.nodes))
        return gm.forward
    return backend


@pytest.mark.slow
def test_compiled_learner_trains_saves_and_loads_into_an_uncompiled_model(dls, model, tmp_path):
    calls = []
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), path=tmp_path, compile={"backend": counting_backend(calls)},
                    cbs=Checkpoint(tmp_path / "checkpoints", every_epoch=True))
    before = learn.validate()["valid_loss"]
    learn.fit(3, lr=1e-2)
    assert calls, "the model never went through torch.compile"
    assert learn.validate()["valid_loss"] < before
    file = learn.save("compiled")
    learn.save_model(tmp_path / "export")
    learn.save_state(tmp_path / "state")
    written = [file, *(tmp_path / "export").rglob("*.safetensors"), *(tmp_path / "state").rglob("*.safetensors"),
               *(tmp_path / "checkpoints").rglob("*.safetensors")]
    assert len(written) >= 6                                      # 3 epoch checkpoints among them
    for path in written:
        assert keys_of(path) == plain_keys(), path

    torch.manual_seed(1)
    plain = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    fresh = Learner(dls, plain, loss_func=nn.CrossEntropyLoss(), path=tmp_path, compile=False)
    fresh.load("compiled")
    x = dls.valid.dataset.tensors[0]
    with torch.no_grad():
        assert torch.equal(plain(x), learn.model(x))
    fresh.fit(1)                                                   # the other way: a compiled Learner loads it back
    fresh.save("plain")
    learn.load("plain")
    with torch.no_grad():
        assert torch.equal(learn.model(x), plain(x)) and is_compiled(learn.model)


@pytest.mark.slow
def test_a_model_the_user_compiled_saves_without_the_prefix_and_old_prefixed_files_load(dls, model, tmp_path):
    compiled = torch.compile(model, backend="eager")
    assert set(compiled.state_dict()) == {f"_orig_mod.{k}" for k in plain_keys()}   # what torch itself writes
    learn = Learner(dls, compiled, loss_func=nn.CrossEntropyLoss(), path=tmp_path)
    learn.fit(1)
    assert keys_of(learn.save("mine", with_opt=False)) == plain_keys()

    save_file({k: v.contiguous() for k, v in compiled.state_dict().items()}, str(tmp_path / "models" / "old.safetensors"))
    torch.manual_seed(3)
    other = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    Learner(dls, other, loss_func=nn.CrossEntropyLoss(), path=tmp_path).load("old", with_opt=False)
    for k, v in model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k


@pytest.mark.slow
def test_learn_compile_recompiles_in_place_and_checks_options_first(dls, model):
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss())
    assert learn.compile_options is None and not is_compiled(model)
    with pytest.raises(ValueError, match="'not_a_backend' does not exist.*inductor"):
        learn.compile(backend="not_a_backend")
    with pytest.raises(TypeError, match=r"unknown torch.compile option\(s\) \['modes'\]"):
        learn.compile(backend="eager", modes="max-autotune")
    with pytest.raises(ValueError, match="compile mode 'fastest'"):
        Learner(dls, model, loss_func=nn.CrossEntropyLoss(), compile={"mode": "fastest"})
    assert not is_compiled(model)                      # refused before anything compiled
    learn.compile(backend="aot_eager")
    assert learn.model is model and is_compiled(model)
    learn.fit(1)
    assert set(model.state_dict()) == plain_keys()
    twin = copy.deepcopy(model)                                   # e.g. an EMA copy: runs its own weights
    with torch.no_grad():
        twin[2].bias.add_(1.0)
        x = torch.randn(4, 8)
        assert torch.allclose(twin(x), model(x) + 1.0)
    assert uncompile(twin) is twin and "forward" not in vars(twin)
    buffer = io.BytesIO()
    torch.save(model, buffer)                                     # the whole module, pickled
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x)) and not is_compiled(loaded)


@pytest.mark.slow
def test_launcher_settings_reach_the_learner_through_the_environment(dls, model, monkeypatch):
    monkeypatch.setenv("CADENCE_DYNAMO_BACKEND", "AOT_EAGER")
    monkeypatch.setenv("CADENCE_DYNAMO_USE_DYNAMIC", "0")
    assert options_from_env() == {"backend": "aot_eager", "mode": None, "fullgraph": False, "dynamic": False}
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss())
    assert learn.compile_options["backend"] == "aot_eager" and is_compiled(model)
    assert Learner(dls, nn.Linear(8, 3), loss_func=nn.CrossEntropyLoss(), compile=False).compile_options is None
    monkeypatch.setenv("CADENCE_DYNAMO_BACKEND", "no")
    assert options_from_env() is None


def test_accelerate_dynamo_config_is_read_and_checked():
    assert from_dict({"dynamo_config": {"dynamo_backend": "INDUCTOR", "dynamo_mode": "max-autotune"}}).dynamo_config == \
        {"dynamo_backend": "inductor", "dynamo_mode": "max-autotune"}
    assert from_dict({"dynamo_backend": "EAGER"}).dynamo_config == {"dynamo_backend": "eager"}   # the older format
    assert from_dict({"dynamo_backend": "NO"}).dynamo_config == {}
    with pytest.raises(ValueError, match="dynamo_config: unknown key.*dynamo_fullgraph"):
        from_dict({"dynamo_config": {"dynamo_backend": "eager", "dynamo_fullgraph": True}}, "acc.yaml")


def test_config_file_and_flags_become_the_workers_dynamo_variables(tmp_path):
    from cadence.cli import build_parser
    from cadence.distributed.launch import launch_env, resolve_config

    path = tmp_path / "accelerate.yaml"
    path.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n"
                    "dynamo_config:\n  dynamo_backend: AOT_EAGER\n  dynamo_mode: default\n  dynamo_use_fullgraph: true\n")
    args = build_parser().parse_args(["launch", "--config_file", str(path), "--dynamo_mode", "max-autotune",
                                      "--dynamo_use_dynamic", "false", "train.py"])
    env = launch_env(resolve_config(args))
    assert {k: v for k, v in env.items() if "DYNAMO" in k} == {
        "CADENCE_DYNAMO_BACKEND": "aot_eager", "CADENCE_DYNAMO_MODE": "max-autotune",   # the flag wins
        "CADENCE_DYNAMO_USE_FULLGRAPH": "1", "CADENCE_DYNAMO_USE_DYNAMIC": "0",
        "CADENCE_DYNAMO_USE_REGIONAL_COMPILATION": None}
    assert options_from_env({k: v for k, v in env.items() if v is not None}) == {
        "backend": "aot_eager", "mode": "max-autotune", "fullgraph": True, "dynamic": False}
    plain = launch_env(resolve_config(build_parser().parse_args(["launch", "--cpu", "train.py"])))
    assert plain["CADENCE_DYNAMO_BACKEND"] is None                                       # unset in the workers
    regional = launch_env(resolve_config(build_parser().parse_args(
        ["launch", "--cpu", "--dynamo_backend", "eager", "--dynamo_use_regional_compilation", "true", "train.py"])))
    assert regional["CADENCE_DYNAMO_USE_REGIONAL_COMPILATION"] == "1"
    assert options_from_env({k: v for k, v in regional.items() if v is not None})["regional"] is True


@pytest.mark.slow
def test_launch_refuses_an_unknown_backend_before_any_worker_starts(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cadence.cli", "launch", "--cpu", "--dynamo_backend", "indcutor",
                           "no_such_script.py"], capture_output=True, text=True, timeout=120, env=cadence_env())
    assert proc.returncode == 2
    assert "'indcutor' does not exist" in proc.stderr and "inductor" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("engine", [(), pytest.param(("--use_fsdp",), marks=pytest.mark.long)], ids=["ddp", "fsdp"])
def test_launch_dynamo_backend_compiles_the_module_inside_the_wrapper_on_two_processes(tmp_path, engine):
    proc = run_launch("compile_ddp.py", str(tmp_path), flags=("--dynamo_backend", "aot_eager", *engine), timeout=400)
    checks = [line for line in proc.stdout.splitlines() if line.startswith("CHECK")]
    assert checks == ["CHECK module inside the wrapper compiled ok", "CHECK graphs captured ok", "CHECK ranks agree ok", "CHECK plain module compiled after ok",
                      "CHECK saved keys ok"], proc.stdout + proc.stderr
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["keys"] == sorted(["0.weight", "0.bias", "2.weight", "2.bias"])


def _has_c_compiler() -> bool:
    return shutil.which("cc") is not None and subprocess.run(["cc", "--version"], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _has_c_compiler(), reason="inductor needs a C compiler on the CPU")
def test_inductor_compiled_learner_matches_the_eager_model(dls, model):
    eager = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    eager.load_state_dict(model.state_dict())
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), compile=True)   # torch.compile's default: inductor
    x = dls.valid.dataset.tensors[0]
    graphs = counters["stats"]["unique_graphs"]
    preds, _ = learn.get_preds()
    assert counters["stats"]["unique_graphs"] > graphs
    with torch.no_grad():
        torch.testing.assert_close(preds, eager(x))
    learn.fit(1)
    assert set(model.state_dict()) == plain_keys()
