"""docs/accelerate.md's code, whole: `cadence launch --num_processes 2 docs/examples/accelerate_loop.py` (add
`--cpu` without GPUs), or `python docs/examples/accelerate_loop.py`; a few seconds on a CPU, writing ckpt/ under the
current directory. A tiny GPT-2 built from a config (no download). The page shows the section between the `--8<--`
markers; tests/test_docs_examples.py launches this file on 2 processes and checks that the schedule sized from the
whole loader ends with the training, that every sample was gathered once, and that the state was saved."""

import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler



def motifs(n: int, seed: int) -> list[dict]:
    """Sequences of 16 tokens repeating a random 4-token motif."""
    ids = torch.randint(0, 128, (n, 4), generator=torch.Generator().manual_seed(seed)).repeat(1, 4)
    return [{"input_ids": row, "labels": row} for row in ids]


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
train_dl, eval_dl, epochs = DataLoader(motifs(64, 1), batch_size=4), DataLoader(motifs(10, 2), batch_size=4), 1

# --8<-- [start:loop]
from cadence import Accelerator, ProjectConfiguration   # was: from accelerate import ...
accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=4,   # save_state() writes checkpoints/
                          project_config=ProjectConfiguration(".", automatic_checkpoint_naming=True))
scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0,
                          num_training_steps=epochs * len(train_dl) // 4)   # the whole loader's length
model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)
for batch in train_dl:
    with accelerator.accumulate(model):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step(); scheduler.step(); optimizer.zero_grad()
for batch in eval_dl:
    logits = model(**batch).logits
    preds, refs = accelerator.gather_for_metrics((logits.argmax(-1), batch["labels"]))   # each sample once
accelerator.save_state()                         # resumable; load_state() continues mid-epoch
# --8<-- [end:loop]
gathered = sum(len(accelerator.gather_for_metrics(batch["labels"])) for batch in eval_dl)
accelerator.print(f"eval samples gathered: {gathered} of {len(eval_dl.dataset)}")
accelerator.print(f"processes {accelerator.num_processes}: learning rate at the end {scheduler.get_last_lr()[0]}")
accelerator.end_training()
