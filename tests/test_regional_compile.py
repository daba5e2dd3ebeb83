"""Regional compilation: each block of a repeated `nn.ModuleList` compiled once per class, in place.

`learn.compile(regional=True)`, `Learner(compile={..., "regional": True})`, `compile_model(..., regional=True)`
and Accelerate's `compile_regions` (from `cadence.utils`). A tiny Llama built from a config (no download),
`use_cache=False` (a KV cache keys each layer's graph on its index). Fast backends ("aot_eager", "eager")
keep the compiling tests short; `bench/compile_regions.py` measures the time it saves with inductor.
"""

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn
from torch.utils.data import DataLoader

from cadence import DataLoaders, Learner
from cadence.compile import (check_compile_options, compile_model, compile_regions, dynamo_env, has_compiled_regions,
                             is_compiled, normalize_dynamo_config, options_from_env, uncompile)
from helpers import REPO, run_launch

VOCAB, SEQ, LAYERS = 64, 16, 3


def tiny_llama(layers: int = LAYERS, seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                        use_cache=False, bos_token_id=0, eos_token_id=0))


def token_data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Sequences repeating a short random motif: learnt in a few steps."""
    motifs = torch.randint(0, VOCAB, (n, 4), generator=torch.Generator().manual_seed(seed))
    ids = motifs.repeat(1, SEQ // 4)
    return [{"input_ids": row, "labels": row} for row in ids]


def compiled_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if is_compiled(module)]


def keys_of(path: Path) -> set[str]:
    files = sorted(path.rglob("*.safetensors")) if path.is_dir() else [path]
    keys = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys |= set(f.keys())
    return keys


def test_regional_is_checked_first_and_travels_from_the_config_to_the_workers(tmp_path):
    from cadence.cli import build_parser
    from cadence.distributed.launch import launch_env, resolve_config

    with pytest.raises(TypeError, match="regional must be True or False, got 'yes'"):
        check_compile_options({"backend": "eager", "regional": "yes"})
    with pytest.raises(TypeError, match="regional must be True or False"):
        compile_model(nn.Linear(2, 2), backend="eager", regional=1)
    path = tmp_path / "accelerate.yaml"               # what `accelerate config` writes
    path.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\ndynamo_config:\n"
                    "  dynamo_backend: INDUCTOR\n  dynamo_use_regional_compilation: true\n")
    env = launch_env(resolve_config(build_parser().parse_args(["launch", "--config_file", str(path), "train.py"])))
    assert env["CADENCE_DYNAMO_USE_REGIONAL_COMPILATION"] == "1"
    assert options_from_env({k: v for k, v in env.items() if v is not None}) == {
        "backend": "inductor", "mode": None, "fullgraph": False, "dynamic": None, "regional": True}
    assert dynamo_env({"dynamo_backend": "eager"})["CADENCE_DYNAMO_USE_REGIONAL_COMPILATION"] is None   # unset
    with pytest.raises(ValueError, match="dynamo_use_regional_compilation must be true or false, got 'yes'"):
        normalize_dynamo_config({"dynamo_backend": "eager", "dynamo_use_regional_compilation": "yes"})


@pytest.mark.slow
def test_compile_regions_picks_the_regions_accelerate_picks_in_place_and_uncompiles():
    pytest.importorskip("accelerate")
    from accelerate.utils import compile_regions as accelerates
    from torch._dynamo.eval_frame import OptimizedModule

    from cadence.utils import compile_regions as from_utils

    model = tiny_llama()
    keys = list(model.state_dict())
    assert from_utils is compile_regions and compile_regions(model, backend="eager") is model   # in place
    theirs = accelerates(tiny_llama(), backend="eager")
    expected = [name.replace("._orig_mod", "") for name, m in theirs.named_modules() if isinstance(m, OptimizedModule)]
    assert compiled_names(model) == expected == [
        "model.embed_tokens", *(f"model.layers.{i}" for i in range(LAYERS)), "model.norm", "model.rotary_emb", "lm_head"]
    assert any("_orig_mod" in k for k in theirs.state_dict())          # what Accelerate's copy saves ...
    assert list(model.state_dict()) == keys                             # ... and cadence's model: its own names
    assert has_compiled_regions(model) and not is_compiled(model)      # the loop over the layers runs eagerly
    twin = copy.deepcopy(model)                                         # e.g. an EMA copy: runs its own weights
    assert twin.model.layers[1].forward.__self__ is twin.model.layers[1] and not has_compiled_regions(twin)
    compile_model(model, backend="eager")                               # whole, instead: the regions dropped
    assert compiled_names(model) == [""]
    compile_regions(model, backend="eager")
    assert uncompile(model) is model and not has_compiled_regions(model)

    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))  # no repeated blocks: whole, as Accelerate
    assert isinstance(accelerates(plain, backend="eager"), OptimizedModule)
    assert compile_regions(plain, backend="eager") is plain and compiled_names(plain) == [""]
    x = torch.randn(3, 4)
    assert torch.equal(plain(x), uncompile(plain)(x))


@pytest.mark.slow
def test_regional_learner_matches_eager_compiles_a_layer_once_trains_and_saves_plain_keys(tmp_path):
    from torch._dynamo.utils import counters

    dls = DataLoaders(DataLoader(token_data(48, seed=1), batch_size=8), DataLoader(token_data(16, seed=1), batch_size=8),
                      device="cpu")
    model, eager = tiny_llama(), tiny_llama()
    probe = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expected = eager(probe).logits
    graphs = counters["stats"]["unique_graphs"]
    learn = Learner(dls, model, loss_func=None, opt_func=torch.optim.AdamW, lr=1e-2, path=tmp_path,
                    compile={"backend": "aot_eager", "regional": True})
    learn.remove_cb(learn.progress)
    assert len(compiled_names(model)) == LAYERS + 4 and not is_compiled(model)
    with torch.no_grad():
        torch.testing.assert_close(model(probe).logits, expected)
    # one graph per compiled module, but one for all the layers: they share their compiled code
    assert counters["stats"]["unique_graphs"] - graphs == len(compiled_names(model)) - (LAYERS - 1)

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    first = learn.validate()["valid_loss"]
    learn.fit(3)
    assert learn.validate()["valid_loss"] < first * 0.9      # on sequences it trained on
    for i in range(LAYERS):                                              # gradients reached every layer
        name = f"model.layers.{i}.mlp.down_proj.weight"
        assert not torch.equal(before[name], model.get_parameter(name)), name

    file = learn.save("regional", with_opt=False)
    assert keys_of(file) == set(eager.state_dict())                     # no `_orig_mod.` anywhere
    plain = Learner(dls, eager, loss_func=None, path=tmp_path, compile=False)
    plain.load("regional", with_opt=False)
    with torch.no_grad():
        torch.testing.assert_close(eager(probe).logits, model(probe).logits)


_DDP_SCRIPT = '''
import json, sys
from pathlib import Path
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from cadence import DataLoaders, Learner, gather
from cadence.compile import has_compiled_regions, is_compiled
from cadence.distributed.env import rank
sys.path.insert(0, {tests!r})
from test_regional_compile import LAYERS, tiny_llama, token_data

out = Path(sys.argv[1])
dls = DataLoaders(DataLoader(token_data(64, seed=1), batch_size=8), DataLoader(token_data(16, seed=1), batch_size=8),
                  device="cpu")
model = tiny_llama()
learn = Learner(dls, model, loss_func=None, opt_func=torch.optim.AdamW, lr=1e-2, path=out,
                compile={{"backend": "aot_eager", "regional": True}})
result = {{}}
with learn.distrib_ctx():
    inner = learn.strategy.unwrap(learn.model)
    result["wrapped"] = isinstance(learn.model, DistributedDataParallel) and not is_compiled(learn.model)
    result["layers_compiled"] = all(is_compiled(layer) for layer in inner.model.layers) and not is_compiled(inner)
    first = learn.validate()["valid_loss"]
    learn.fit(2)
    result["loss"] = [first, learn.validate()["valid_loss"]]
    probe = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        logits = inner(probe).logits
    both = gather(logits[None])
    result["ranks_agree"] = torch.equal(both[0], both[1])
result["after"] = has_compiled_regions(learn.model) and not hasattr(learn.model, "module")
file = learn.save("regional", with_opt=False)
if rank() == 0:
    from safetensors import safe_open
    keys = set()
    for one in (sorted(file.rglob("*.safetensors")) if file.is_dir() else [file]):
        with safe_open(str(one), framework="pt") as f:
            keys |= set(f.keys())
    result["keys_plain"] = keys == set(tiny_llama().state_dict())
    (out / "result.json").write_text(json.dumps(result))
'''


@pytest.mark.slow
def test_regional_compile_trains_under_ddp_on_two_processes(tmp_path):
    script = tmp_path / "regional_ddp.py"
    script.write_text(_DDP_SCRIPT.format(tests=str(REPO / "tests")))
    run_launch(script, str(tmp_path), timeout=600)
    result = json.loads((tmp_path / "result.json").read_text())
    first, last = result.pop("loss")
    assert last < first * 0.9, (first, last)
    assert result == {"wrapped": True, "layers_compiled": True, "ranks_agree": True, "after": True, "keys_plain": True}
