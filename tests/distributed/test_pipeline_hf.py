"""A Hugging Face model under pipeline parallelism: `save_model` writes what `from_pretrained` reads (the whole
model's config, not a stage's), `learn.model.generate` inside `distrib_ctx` says to generate after the block, and
its sharded checkpoint resumed outside `distrib_ctx` says to resume inside it; and `save_model` of a peft (LoRA)
model writes the adapter in peft's layout, which `PeftModel.from_pretrained` loads on a fresh base model in one
process with the trained model's outputs, and the merged model, which transformers' `from_pretrained` loads."""

import json
import sys

import pytest
import torch

from helpers import SCRIPTS, run_launch

transformers = pytest.importorskip("transformers")


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")   # the one-process resume reads the shards
def test_save_model_under_a_pipeline_writes_the_config_and_from_pretrained_gives_the_trained_models_logits(tmp_path):
    from transformers import LlamaForCausalLM

    out = run_launch("pipeline_hf.py", str(tmp_path), nproc=2, timeout=300).stdout
    assert "CHECK generate_refused ok" in out, out
    assert "CHECK generate_after ok" in out, out
    assert "CHECK get_preds_ddp ok" in out, out      # a ModelOutput with a DynamicCache: its logits, over DDP
    export = tmp_path / "export"
    assert {"config.json", "generation_config.json", "model.safetensors"} <= {p.name for p in export.iterdir()}
    config = json.loads((export / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (32, 2, 128)

    sys.path.insert(0, str(SCRIPTS))
    try:
        from pipeline_hf import Stage, learner, make_model, motifs
    finally:
        sys.path.remove(str(SCRIPTS))
    loaded = LlamaForCausalLM.from_pretrained(export)
    trained = make_model()
    trained.load_state_dict(torch.load(tmp_path / "weights.pt"))  # the pipeline's weights, whole after the block
    ids = motifs(4, 3).tensors[0]
    assert torch.equal(_logits(loaded, ids), _logits(trained, ids))
    single = learner()                                             # the same fit on one process, no pipeline
    single.fit(1)
    torch.testing.assert_close(_logits(loaded, ids), _logits(single.model, ids), atol=1e-4, rtol=1e-4)

    # the pipeline's checkpoint (sharded) in a Learner outside distrib_ctx: refused, saying where it resumes ...
    checkpoint = max((tmp_path / "ckpt").glob("step-*"))
    plain = learner()
    with pytest.raises(ValueError, match=r"is a sharded checkpoint .*written by 2 processes.*distrib_ctx\(strategy="
                                         r"\"model_parallel\", tp_size=\.\.\., pp_size=\.\.\.\)"):
        plain.load_state(checkpoint)
    # ... and there, on this one process, it loads the trained weights
    inside = learner()
    with inside.distrib_ctx(strategy="model_parallel", pp_size=2, split=Stage):
        inside.load_state(checkpoint)
    assert torch.equal(_logits(inside.model, ids), _logits(trained, ids))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")   # the one-process resume reads the shards
def test_save_model_of_a_lora_llama_under_a_pipeline_writes_the_adapter_peft_loads_with_the_trained_outputs(tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    peft = pytest.importorskip("peft")
    run_launch("pipeline_peft.py", tmp_path, nproc=2, timeout=300)
    adapter = tmp_path / "adapter"
    files = {p.name for p in adapter.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "model.safetensors" not in files, files
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and sorted(config["target_modules"]) == ["q_proj", "v_proj"], config
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    assert len(weights) == 8 and all("lora_" in k for k in weights), sorted(weights)   # both stages' layers

    sys.path.insert(0, str(SCRIPTS))
    try:
        from pipeline_hf import make_model, motifs
        from pipeline_peft import make_peft_model, peft_learner, split
    finally:
        sys.path.remove(str(SCRIPTS))
    trained = make_peft_model()
    trained.load_state_dict(torch.load(tmp_path / "weights.pt"))    # the pipeline's model, whole after the block
    loaded = peft.PeftModel.from_pretrained(make_model(), adapter)  # a fresh base model, one process
    ids = motifs(4, 3).tensors[0]
    assert torch.equal(_logits(loaded, ids), _logits(trained, ids))
    assert not torch.allclose(_logits(loaded, ids), _logits(make_model(), ids))   # the adapter changes the outputs
    single = peft_learner()                                          # the same fit on one process, no pipeline
    single.fit(1)
    torch.testing.assert_close(_logits(loaded, ids), _logits(single.model, ids), atol=1e-4, rtol=1e-4)

    merged = LlamaForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(_logits(merged, ids), _logits(trained, ids), atol=1e-5, rtol=1e-5)

    resumed = peft_learner()
    with resumed.distrib_ctx(strategy="model_parallel", pp_size=2, split=split):
        resumed.load_state(max((tmp_path / "ckpt").glob("step-*")))
    assert torch.equal(_logits(resumed.model, ids), _logits(trained, ids))
