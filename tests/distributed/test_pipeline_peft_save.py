"""`save_model` of a peft (LoRA) model trained under pipeline parallelism: the adapter in peft's layout, which
`PeftModel.from_pretrained` loads on a fresh base model in one process with the trained model's outputs, and the
merged model, which transformers' `from_pretrained` loads; its sharded checkpoint (frozen base weights, an optimizer
state for the adapter only) resumes in one process."""

import json
import sys

import pytest
import torch

from helpers import SCRIPTS, run_launch

peft = pytest.importorskip("peft")


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")   # the one-process resume reads the shards
def test_save_model_of_a_lora_llama_under_a_pipeline_writes_the_adapter_peft_loads_with_the_trained_outputs(tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

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
