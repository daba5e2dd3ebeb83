"""Tiny transformers models built from configs (no downloads), token data and a Learner over them, for tests/hf/.

GPT-2 ties `lm_head.weight` to `transformer.wte.weight`; Llama keeps them apart. No dropout, so runs on
different engines can be compared. Also imported by tests/scripts/hf_finetune.py.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from cadence import DataLoaders, Learner

VOCAB, SEQ = 128, 16
LAYER = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer"}
ENGINES = {
    "ddp": lambda layer: dict(strategy="ddp"),
    # no class names: the model's own `_no_split_modules` (Accelerate's default), `layer` for the other engines' sake
    "fsdp": lambda layer: dict(strategy="fsdp", auto_wrap_policy="TRANSFORMER_BASED_WRAP"),
    "zero2": lambda layer: dict(strategy="deepspeed", zero_stage=2),
    "zero3": lambda layer: dict(strategy="deepspeed", zero_stage=3),
}


def tiny_model(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if name == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
                                          bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                          attn_pdrop=0.0))
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                        num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=64, bos_token_id=0, eos_token_id=0))


def token_data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Sequences that repeat a short random motif: a language a tiny model learns in a few steps."""
    g = torch.Generator().manual_seed(seed)
    motifs = torch.randint(0, VOCAB, (n, 4), generator=g)
    ids = motifs.repeat(1, SEQ // 4)
    return [{"input_ids": row, "labels": row} for row in ids]


def lm_learner(name: str, seed: int = 0, lora: bool = False, init_context=None, source: str | Path | None = None
               ) -> Learner:
    """A Learner fine-tuning tiny `name` on dict batches, the model computing its own loss (loss_func=None).

    `init_context`: the strategy's, to build the model in (FSDP's cpu_ram_efficient_loading: meta on ranks > 0).
    `source`: how the model is built: its class (None), `AutoModelForCausalLM.from_config` ("config") or
    `from_pretrained` of a directory.
    """
    from transformers import AutoModelForCausalLM

    dls = DataLoaders(DataLoader(token_data(64, seed=1), batch_size=8),
                      DataLoader(token_data(16, seed=2), batch_size=8), device="cpu")
    config = tiny_model(name).config if source == "config" else None
    with init_context or contextlib.nullcontext():
        model = (tiny_model(name, seed) if source is None else AutoModelForCausalLM.from_config(config)
                 if source == "config" else AutoModelForCausalLM.from_pretrained(source))
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = ["c_attn"] if name == "gpt2" else ["q_proj", "v_proj"]
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, fan_in_fan_out=name == "gpt2",
                          init_lora_weights=False)  # random B: the adapter changes the logits from the start
        model = get_peft_model(model, lora)
    learn = Learner(dls, model, loss_func=None, opt_func=torch.optim.AdamW, lr=1e-2)
    learn.remove_cb(learn.progress)
    return learn


def probe() -> torch.Tensor:
    """Token ids no training batch holds, to compare models by their logits."""
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(99))


def logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(probe()).logits.float()


def stored(directory: str | Path) -> dict[str, str]:
    """Every tensor the safetensors files of `directory` hold -> its dtype (each file's keys, not the index)."""
    found = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                assert key not in found, f"{key} stored twice ({file.name})"
                found[key] = str(f.get_slice(key).get_dtype())
    return found


def index_keys(directory: str | Path) -> set[str]:
    return set(json.loads((Path(directory) / "model.safetensors.index.json").read_text())["weight_map"])
