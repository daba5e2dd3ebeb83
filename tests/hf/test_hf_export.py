"""One process: a tiny GPT-2 (tied) or Llama fine-tuned by the Learner, exported with `save_model`, loaded back with
transformers' and peft's own `from_pretrained`; the files match what transformers' `save_pretrained` writes."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import index_keys, lm_learner, logits, stored, tiny_model  # noqa: E402


@pytest.fixture(params=["gpt2", "llama"])
def trained(request):
    learn = lm_learner(request.param)
    learn.fit(1)
    return request.param, learn


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_save_model_writes_what_save_pretrained_writes_and_from_pretrained_loads_it(trained, shard, tmp_path):
    from transformers import AutoModelForCausalLM

    name, learn = trained
    learn.save_model(tmp_path / "ours", **({"max_shard_size": shard} if shard else {}))
    learn.model.save_pretrained(tmp_path / "theirs", **({"max_shard_size": shard} if shard else {}))
    ours, theirs = stored(tmp_path / "ours"), stored(tmp_path / "theirs")  # each fails on a tensor stored twice
    assert ours == theirs  # the same names (GPT-2: lm_head.weight left to the tie), the same dtypes
    assert ("lm_head.weight" in ours) is (name == "llama")
    if shard:
        assert len(list((tmp_path / "ours").glob("model-*.safetensors"))) > 2
        assert index_keys(tmp_path / "ours") == index_keys(tmp_path / "theirs")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config == json.loads((tmp_path / "theirs" / "config.json").read_text())   # architectures, dtype included
    assert config["model_type"] == name and config["dtype"] == "float32" and len(config["architectures"]) == 1
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.dtype == torch.float32
    torch.testing.assert_close(logits(model), logits(learn.model), rtol=0, atol=0)
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    assert tied is (name == "gpt2")


def test_a_bf16_fit_exports_fp32(tmp_path):
    from transformers import AutoModelForCausalLM

    learn = lm_learner("gpt2").to_bf16()
    learn.fit(1)
    learn.save_model(tmp_path)
    assert set(stored(tmp_path).values()) == {"F32"}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float32"   # the weights written
    assert AutoModelForCausalLM.from_pretrained(tmp_path).dtype == torch.float32


def test_learn_save_and_load_keep_the_tie(tmp_path):
    learn = lm_learner("gpt2")
    learn.path = tmp_path
    learn.fit(1)
    learn.save("tuned")
    other = lm_learner("gpt2", seed=1)
    other.path = tmp_path
    other.load("tuned")
    assert other.model.lm_head.weight is other.model.transformer.wte.weight
    torch.testing.assert_close(logits(other.model), logits(learn.model), rtol=0, atol=0)


def test_a_peft_model_saves_its_adapter_or_the_merged_model_as_asked(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    learn = lm_learner("gpt2", lora=True)
    learn.fit(1)
    trained = logits(learn.model)
    learn.save_model(tmp_path / "adapter")
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "model.safetensors" not in files
    assert stored(tmp_path / "adapter") and all("lora_" in k for k in stored(tmp_path / "adapter"))
    reloaded = PeftModel.from_pretrained(tiny_model("gpt2"), tmp_path / "adapter")
    torch.testing.assert_close(logits(reloaded), trained, rtol=0, atol=1e-6)

    learn.save_model(tmp_path / "merged", merge_adapter=True)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    merged = stored(tmp_path / "merged")
    assert not any("lora" in k for k in merged) and "lm_head.weight" not in merged
    torch.testing.assert_close(logits(model), trained, rtol=0, atol=1e-5)
    assert type(learn.model).__name__ == "PeftModel"  # merging worked on a copy: the Learner's model keeps its adapter
    torch.testing.assert_close(logits(learn.model), trained, rtol=0, atol=0)
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]

    from cadence.callbacks.checkpoint.export import save_model    # the Accelerator's save_model of a PeftModel

    save_model(learn, tmp_path / "whole", adapter_only=False)
    assert json.loads((tmp_path / "whole" / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]


def test_merge_adapter_without_an_adapter_is_refused_before_writing(tmp_path):
    learn = lm_learner("gpt2")
    with pytest.raises(ValueError, match=r"merge_adapter=True.*\(GPT2LMHeadModel\) has none"):
        learn.save_model(tmp_path / "x", merge_adapter=True)
    assert not (tmp_path / "x").exists()


def test_export_and_load_learner_keep_the_tie_and_the_models_own_loss(tmp_path):
    from cadence import load_learner

    learn = lm_learner("gpt2")
    learn.path = tmp_path
    learn.fit(1)
    learn.export("exported")
    loaded = load_learner(tmp_path / "exported", trust_pickle=True)
    model = loaded.model
    assert model.lm_head.weight is model.transformer.wte.weight          # one Parameter, trained as one
    torch.testing.assert_close(logits(model), logits(learn.model), rtol=0, atol=0)
    assert loaded.loss_func is None                                      # the model computes its loss, as it did
    assert loaded.validate(dl=learn.dls.valid) == learn.validate()
    own = load_learner(tmp_path / "exported", model=tiny_model("gpt2", seed=5))   # no unpickling: export.json says
    assert own.loss_func is None and own.validate(dl=learn.dls.valid) == learn.validate()   # it computed its loss


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_transformer_based_wrap_without_class_names_takes_the_models_own_layers(name):
    """Accelerate's fallback, the model's `_no_split_modules` (one process: checked, nothing sharded; 2 processes
    shard them: tests/hf/test_hf_engines.py)."""
    learn = lm_learner(name)
    with learn.distrib_ctx(strategy="fsdp", auto_wrap_policy="TRANSFORMER_BASED_WRAP"):
        learn.fit(1)                                   # refused before: "matches no layer"
    assert learn.step == 8 and learn.recorder.values[-1]["valid_loss"] is not None   # 64 sequences, batches of 8
