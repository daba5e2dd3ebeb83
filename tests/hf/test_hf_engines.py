"""Tiny GPT-2 (tied lm_head/wte) and Llama fine-tuned by the Learner on 2 processes under DDP, FSDP2, ZeRO-2 and
ZeRO-3, fp32 and bf16 (also built under FSDP's cpu_ram_efficient_loading and ZeRO-3's zero3_init_flag; LoRA under
DDP and FSDP), then loaded back as a user would: `AutoModelForCausalLM.from_pretrained`, `PeftModel`.

One launch runs every engine in sequence (tests/scripts/hf_finetune.py, each run its own distrib_ctx); the tests
below read what it wrote.
"""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import run_launch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import LAYER, logits, stored, tiny_model  # noqa: E402

RUNS = [
    # GPT-2: every engine x precision; fp32 runs also save_state and learn.save, reloaded on the same engine
    *({"name": f"gpt2_{e}", "model": "gpt2", "engine": e, "checkpoint": True}
      for e in ("ddp", "fsdp", "zero2", "zero3")),
    *({"name": f"gpt2_{e}_bf16", "model": "gpt2", "engine": e, "precision": "bf16"}
      for e in ("ddp", "fsdp", "zero2", "zero3")),
    {"name": "llama_ddp", "model": "llama", "engine": "ddp"},
    {"name": "llama_fsdp_bf16", "model": "llama", "engine": "fsdp", "precision": "bf16"},
    {"name": "llama_zero2_bf16", "model": "llama", "engine": "zero2", "precision": "bf16"},
    {"name": "llama_zero3", "model": "llama", "engine": "zero3"},
    # built in the strategy's init_context: FSDP's cpu_ram_efficient_loading (meta on rank 1), ZeRO-3's zero.Init
    {"name": "llama_fsdp_low_ram", "model": "llama", "engine": "fsdp",
     "init_options": {"cpu_ram_efficient_loading": True}},
    *({"name": f"gpt2_zero3_init_{source}", "model": "gpt2", "engine": "zero3",
       "init_options": {"zero3_init_flag": True}, "source": source} for source in ("pretrained", "config")),
    {"name": "lora_ddp", "model": "gpt2", "engine": "ddp", "lora": True},
    {"name": "lora_fsdp", "model": "gpt2", "engine": "fsdp", "lora": True},
]
SHARDED = {"gpt2_fsdp", "gpt2_zero3", "gpt2_zero3_bf16", "llama_zero3", "llama_fsdp_bf16"}  # exported in 40 KB shards
for run in RUNS:
    if run["name"] in SHARDED:
        run["shard"] = "40KB"
FULL = [r["name"] for r in RUNS if not r.get("lora")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    proc = run_launch("hf_finetune.py", out, json.dumps(RUNS), timeout=600)
    assert f"HF RUNS DONE {len(RUNS)}" in proc.stdout
    return out, proc


def result(out: Path, name: str) -> dict:
    return json.loads((out / name / "result.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_tied_weights_stay_tied_after_every_engine_and_through_its_checkpoints(runs):
    out, _ = runs
    for run in RUNS:
        assert result(out, run["name"])["tied"] is (run["model"] == "gpt2"), run["name"]
        # FSDP named no layer class: it sharded the model's own (`_no_split_modules`), as Accelerate does
        groups = result(out, run["name"])["fsdp_groups"]
        assert groups == ([f"FSDP{LAYER[run['model']]}"] if run["engine"] == "fsdp" else []), (run["name"], groups)
    for engine in ("ddp", "fsdp", "zero2", "zero3"):  # saved inside the engine, loaded into a fresh Learner on it
        r = result(out, f"gpt2_{engine}")
        for how in ("load_state", "load"):
            assert r[how] == {"tied": True, "max_diff": 0.0}, (engine, how, r)
        saved = stored(out / f"gpt2_{engine}" / "saved")  # learn.save's weights: the tied weight stored once
        assert "transformer.wte.weight" in saved and "lm_head.weight" not in saved, (engine, sorted(saved))


@pytest.mark.slow
@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", FULL)
def test_every_engine_exports_what_from_pretrained_loads_in_fp32_with_the_trained_logits(runs, name):
    from transformers import AutoModelForCausalLM

    out, _ = runs
    export = out / name / "export"
    files = stored(export)  # fails if a tensor is stored twice
    assert set(files.values()) == {"F32"}, files  # the master precision, even from a bf16 engine
    if name.startswith("gpt2"):  # the tied weight stored once, under the name transformers keeps
        assert "transformer.wte.weight" in files and "lm_head.weight" not in files
    else:
        assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(files)
    assert (export / "model.safetensors.index.json").is_file() == (name in SHARDED)
    model, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.dtype == torch.float32
    torch.testing.assert_close(logits(model), torch.load(out / name / "logits.pt"), rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_fp32_engines_train_alike_and_bf16_close(runs):
    out, _ = runs
    reference = torch.load(out / "gpt2_ddp" / "logits.pt")
    for name in ("gpt2_fsdp", "gpt2_zero2", "gpt2_zero3"):
        torch.testing.assert_close(torch.load(out / name / "logits.pt"), reference, rtol=1e-4, atol=1e-4)
    # Llama's rotary inv_freq is in no state dict: ZeRO-3 and FSDP (also when rank 1 built the model on the meta
    # device) must train and give back the model DDP does
    for name in ("llama_zero3", "llama_fsdp_low_ram"):
        torch.testing.assert_close(torch.load(out / name / "logits.pt"), torch.load(out / "llama_ddp" / "logits.pt"),
                                   rtol=1e-4, atol=1e-4)
    # built under zero.Init (zero3_init_flag): from_pretrained loads into the partitions, from_config initialises them
    torch.testing.assert_close(torch.load(out / "gpt2_zero3_init_pretrained" / "logits.pt"), reference,
                               rtol=1e-4, atol=1e-4)
    first = result(out, "gpt2_zero3_init_config")["losses"][0]
    assert abs(first - math.log(128)) < 0.1, first  # GPT-2's init (std 0.02): a uniform guess over the vocabulary
    moved = (reference - logits(tiny_model("gpt2"))).norm()  # what training changed
    for name in ("gpt2_ddp_bf16", "gpt2_fsdp_bf16", "gpt2_zero2_bf16", "gpt2_zero3_bf16"):  # bf16 lands near fp32
        assert (torch.load(out / name / "logits.pt") - reference).norm() < moved / 10, name
    for run in RUNS:  # a few steps lower the loss on every engine
        losses = result(out, run["name"])["losses"]
        assert losses[-1] < losses[0] or min(losses[1:]) < losses[0], (run["name"], losses)


@pytest.mark.slow
@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", ["lora_ddp", "lora_fsdp"])
def test_lora_adapter_saved_in_peft_layout_reloads_with_the_trained_logits(runs, name):
    from peft import PeftModel

    out, _ = runs
    export = out / name / "export"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in export.iterdir()}
    assert not (export / "model.safetensors").exists()
    assert all("lora_" in k for k in stored(export)), stored(export)  # the adapter alone
    model = PeftModel.from_pretrained(tiny_model("gpt2"), export)  # the untouched base + the adapter
    torch.testing.assert_close(logits(model), torch.load(out / name / "logits.pt"), rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_generate_inside_every_engine_gives_the_plain_models_tokens(runs):
    """`learn.model.generate` mid-training (a peft model under FSDP2 too: peft calls the inner model, not the
    sharded root's forward) gives the tokens the model gives after the context; bf16 ones need only run."""
    out, _ = runs
    for run in RUNS:
        generated = result(out, run["name"])["generated"]
        assert isinstance(generated["inside"], list), (run["name"], generated["inside"])
        assert len(generated["inside"][0]) == 8, (run["name"], generated)
        if run.get("precision") != "bf16":
            assert generated["inside"] == generated["after"], (run["name"], generated)


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_zero3_prints_no_deprecation_flood(runs):
    _, proc = runs
    flood = [line for line in (proc.stdout + proc.stderr).splitlines() if "is deprecated. Please use" in line]
    assert not flood, f"{len(flood)} lines such as {flood[:2]}"
