"""Hugging Face models through big-model dispatch: `save_pretrained` output loads over CPU and disk, ties hold,
`out.logits` and `model.generate()` work and give what the plain model gives.

Real transformers models built from configs (no downloads): tiny GPT-2 (lm_head tied to wte, which
`save_pretrained` stores once) and tiny Llama (untied).
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig  # noqa: E402

from cadence.big_modeling import dispatch_model, init_empty_weights, load_checkpoint_and_dispatch  # noqa: E402

GPT2 = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64)
LLAMA = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False)
# some layers in memory, some on disk; GPT-2's tied lm_head sits with its wte, so the tie can hold in memory
GPT2_MAP = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.h.0": "disk", "transformer.h.1": "cpu",
            "transformer.ln_f": "disk", "lm_head": "cpu"}
LLAMA_MAP = {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu", "model.norm": "disk",
             "model.rotary_emb": "cpu", "lm_head": "disk"}
CASES = [pytest.param(GPT2, GPT2_MAP, id="gpt2-tied"), pytest.param(LLAMA, LLAMA_MAP, id="llama")]
# GPT-2 saved in shards with transformers' own index (which leaves out lm_head.weight), Llama in one file
SAVED = [pytest.param(GPT2, GPT2_MAP, "40KB", id="gpt2-tied-sharded"), pytest.param(LLAMA, LLAMA_MAP, "1GB", id="llama")]


def trained(config):
    """The model with weights moved well away from their init, so that greedy generation varies its tokens."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def generate(model, ids):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("config, device_map, max_shard_size", SAVED)
def test_load_checkpoint_and_dispatch_of_save_pretrained_generates_the_plain_models_tokens(tmp_path, config, device_map,
                                                                                           max_shard_size):
    plain = trained(config)
    plain.save_pretrained(tmp_path / "export", max_shard_size=max_shard_size)
    assert (tmp_path / "export" / "model.safetensors.index.json").is_file() == (max_shard_size == "40KB")
    ids = torch.tensor([[5, 17, 99, 3], [42, 7, 7, 120]])
    expected_tokens = generate(plain, ids)
    assert len(set(expected_tokens[0, 4:].tolist())) > 3                     # a test that can see tokens differ
    with torch.no_grad():
        expected_logits = plain(ids).logits

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config).eval()
    model = load_checkpoint_and_dispatch(model, tmp_path / "export", device_map=device_map,
                                         offload_folder=tmp_path / "offload")
    assert model.hf_device_map == device_map
    with torch.no_grad():
        out = model(ids)
    assert type(out) is type(plain(ids))                                      # the ModelOutput class, not a dict
    assert torch.equal(out.logits, expected_logits)
    assert torch.equal(generate(model, ids), expected_tokens)
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.transformer.wte.weight          # stored once, loaded once, still tied


@pytest.mark.parametrize("config, device_map", CASES)
def test_dispatch_model_writes_disk_layers_to_the_offload_folder_and_generates_the_same(tmp_path, config, device_map):
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    expected = generate(trained(config), ids)
    model = dispatch_model(trained(config), device_map, offload_dir=tmp_path / "offload")
    assert sorted(p.name for p in (tmp_path / "offload").glob("*.safetensors"))    # disk layers went there
    assert torch.equal(generate(model, ids), expected)
    with torch.no_grad():
        assert model(ids).logits.shape == (1, 5, 128)
