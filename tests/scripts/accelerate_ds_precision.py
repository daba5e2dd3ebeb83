"""An Accelerate-style script under `cadence launch --use_deepspeed --deepspeed_config_file ds.json --zero3_init_flag
true` (a config turning bf16 on, no --mixed_precision): the Accelerator's precision is the config's, and a GPT-2 built
with `from_config` after `Accelerator()` is partitioned as it is built, then prepared and trained.
Used by tests/accelerate/test_accelerate_deepspeed_config_precision.py; prints one JSON line on the main process."""

import json

import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, GPT2Config
from transformers.integrations import is_deepspeed_zero3_enabled

from cadence import Accelerator

accelerator = Accelerator()
told = is_deepspeed_zero3_enabled()
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
weight = model.transformer.wte.weight
built = {"partitioned": hasattr(weight, "ds_id"), "local_numel": weight.numel(), "full_numel": 64 * 32,
         "dtype": str(weight.dtype)}
ids = torch.randint(0, 64, (32, 4), generator=torch.Generator().manual_seed(1)).repeat(1, 4)
dl = DataLoader([{"input_ids": r, "labels": r} for r in ids], batch_size=4)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
model, optimizer, dl = accelerator.prepare(model, optimizer, dl)
losses = []
for _ in range(3):
    for batch in dl:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
if accelerator.is_main_process:
    print(json.dumps({"mixed_precision": accelerator.mixed_precision, "told": told, "built": built,
                      "prepared_dtype": str(next(model.parameters()).dtype), "first": losses[0], "last": losses[-1]}),
          flush=True)
accelerator.end_training()
