"""Accelerate's nlp_example.py, on cadence: the same loop, with `from cadence import Accelerator`.

A tiny sequence classifier stands in for BERT (no download): Hugging Face-style dict batches,
`model(**batch).loss`, accumulation, a warm-up schedule, exact evaluation with
`gather_for_metrics`, and a resumable `save_state`.

    python examples/accelerate_nlp.py
    cadence launch --cpu --num_processes 2 examples/accelerate_nlp.py --gradient_accumulation_steps 2
    cadence launch --cpu --num_processes 2 --use_fsdp examples/accelerate_nlp.py
"""

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from cadence import Accelerator, set_seed   # was: from accelerate import Accelerator; from accelerate.utils import set_seed


class Output(dict):
    """transformers' ModelOutput in miniature: a dict whose keys are also attributes."""

    __getattr__ = dict.__getitem__


class TinyClassifier(nn.Module):
    """Mean of token embeddings, then a linear head; `loss` when `labels` are given (as transformers' models)."""

    def __init__(self, vocab: int = 8, dim: int = 16, n_labels: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, n_labels)

    def forward(self, input_ids, attention_mask, labels=None):
        h = (self.embed(input_ids) * attention_mask.unsqueeze(-1)).sum(1) / attention_mask.sum(1, keepdim=True)
        out = Output(logits=self.head(h))
        if labels is not None:
            out["loss"] = F.cross_entropy(out["logits"], labels)
        return out


def token_data(n: int, seq: int = 12, vocab: int = 8, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """`n` tokenized "sentences"; the label says whether token 1 occurs more often than token 2."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    labels = ((ids == 1).sum(1) > (ids == 2).sum(1)).long()
    return [{"input_ids": i, "attention_mask": torch.ones(seq, dtype=torch.long), "labels": y} for i, y in zip(ids, labels)]


def training_function(args: argparse.Namespace) -> float:
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)
    train_dl = DataLoader(token_data(512), shuffle=True, batch_size=args.batch_size)
    eval_dl = DataLoader(token_data(203, seed=1), batch_size=32)   # 203: the last batch is uneven on 2 processes
    model = TinyClassifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # the schedule is sized from the whole loader, before prepare: the prepared scheduler moves num_processes
    # steps per optimizer step, so it ends with the training on any number of processes (as in Accelerate)
    steps = args.num_epochs * math.ceil(len(train_dl) / accelerator.gradient_accumulation_steps)
    lr_scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=steps)
    model, optimizer, train_dl, eval_dl, lr_scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl,
                                                                            lr_scheduler)
    optimizer_steps = 0

    for epoch in range(args.num_epochs):
        model.train()
        for batch in train_dl:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                optimizer_steps += accelerator.sync_gradients
        model.eval()
        correct = seen = 0
        for batch in eval_dl:
            with torch.no_grad():
                predictions = model(**batch).logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct += (predictions == references).sum().item()
            seen += len(references)
        accelerator.print(f"epoch {epoch}: accuracy {correct / seen:.4f} on {seen} samples")
    if args.output_dir:
        accelerator.save_state(args.output_dir)
    accelerator.print(f"trained on {accelerator.num_processes} processes, {optimizer_steps} optimizer steps, "
                      f"schedule at {lr_scheduler.scheduler.last_epoch} of {steps}")
    accelerator.end_training()
    return correct / seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None)
    p.add_argument("--gradient_accumulation_steps", type=int, default=None)
    p.add_argument("--cpu", action="store_true", help="train on the CPU even when a GPU is there")
    p.add_argument("--num_epochs", type=int, default=4)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--output_dir", default=None, help="save_state here at the end")
    training_function(p.parse_args())


if __name__ == "__main__":
    main()
