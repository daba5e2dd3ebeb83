"""docs/huggingface.md's code, whole: `cadence launch --num_processes 2 docs/examples/huggingface.py` (add `--cpu`
without GPUs; a few seconds on a CPU, writing tuned/ under the current directory). A tiny GPT-2 built from a config
stands in for `from_pretrained("gpt2")` (no download). The page shows the section between the `--8<--` markers;
tests/test_docs_examples.py launches this file on 2 processes and checks that it trained (the validation loss
moved) and that the saved model reloads with the trained model's logits."""

import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config

from cadence import DataLoaders, Learner, rank


def motifs(n: int, seed: int) -> list[dict]:
    """Sequences of 16 tokens repeating a random 4-token motif: a language a tiny model learns in a few steps."""
    ids = torch.randint(0, 128, (n, 4), generator=torch.Generator().manual_seed(seed)).repeat(1, 4)
    return [{"input_ids": row, "labels": row} for row in ids]


torch.manual_seed(0)
dls = DataLoaders(DataLoader(motifs(64, 1), batch_size=8), DataLoader(motifs(16, 2), batch_size=8))
config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0)

# --8<-- [start:model]
from transformers import AutoModelForCausalLM

learn = Learner(dls, AutoModelForCausalLM.from_config(config), loss_func=None)   # or .from_pretrained("gpt2")
# --8<-- [end:model]
before = learn.validate()[0]
# --8<-- [start:fit]
with learn.distrib_ctx(strategy="fsdp", transformer_layer_cls_to_wrap="GPT2Block"):  # or "ddp", "deepspeed" + zero_stage
    learn.fit(1, lr=1e-4)
    learn.save_model("tuned")             # every rank calls it; config.json + model.safetensors (or shards + index)
model = AutoModelForCausalLM.from_pretrained("tuned")
# --8<-- [end:fit]
probe = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(99))
learn.model.eval()
model.eval()
with torch.no_grad():
    same = torch.allclose(model(probe).logits, learn.model(probe).logits, atol=1e-6)
if rank() == 0:
    print(f"valid loss: {before:.6f} before, {learn.recorder.values[-1]['valid_loss']:.6f} after")
    print(f"from_pretrained('tuned') gives the trained model's logits: {same}")
