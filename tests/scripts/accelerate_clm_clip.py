"""Launched on 2 processes by tests/accelerate/test_clip_deepspeed.py: a run_clm_no_trainer-style loop with clipping.

argv: OUT_JSON ENGINE... Each ENGINE ("ddp", "fsdp", "zero2", "zero3") trains a tiny GPT-2 (tied lm_head) from
the same seed on the same data with `accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)` before every
step; rank 0 writes {engine: {"losses" (per step, each rank's), "norms", "distributed_type"}} to OUT_JSON. The FSDP and
DeepSpeed runs are configured the Accelerate way (fsdp_plugin=, deepspeed_plugin=).
"""

import json
import sys

import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from cadence import Accelerator, DeepSpeedPlugin, FullyShardedDataParallelPlugin
from cadence.utils import set_seed

MAX_NORM, LR, STEPS_PER_EPOCH, EPOCHS, BS, SEQ = 0.5, 1e-2, 3, 2, 2, 16


def data() -> torch.Tensor:
    """2 processes x STEPS_PER_EPOCH x BS sequences: rank r's step t batch is the loader's batch 2t + r (Accelerate's
    layout: batches dealt to the ranks in turn), rows [(2t + r) * BS, (2t + r + 1) * BS)."""
    return torch.randint(0, 128, (2 * STEPS_PER_EPOCH * BS, SEQ), generator=torch.Generator().manual_seed(1))


def model() -> GPT2LMHeadModel:
    set_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def accelerator(engine: str) -> Accelerator:
    if engine == "ddp":
        return Accelerator(cpu=True, strategy="ddp")
    if engine == "fsdp":
        return Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["GPT2Block"]))
    return Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=int(engine[-1])))


def train(engine: str) -> dict:
    acc = accelerator(engine)
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    net, opt, dl = acc.prepare(net, opt, DataLoader(data(), batch_size=BS))
    losses, norms = [], []
    for _ in range(EPOCHS):
        net.train()
        for batch in dl:
            with acc.accumulate(net):
                loss = net(input_ids=batch, labels=batch).loss
                acc.backward(loss)
                if acc.sync_gradients:
                    norms.append(float(acc.clip_grad_norm_(net.parameters(), MAX_NORM)))
                opt.step()
                opt.zero_grad()
            losses.append(acc.gather(loss.detach().reshape(1)).tolist())
    return {"losses": losses, "norms": norms, "distributed_type": acc.distributed_type.value,
            "part": clip_a_part(acc, net, dl)}


def grad_norm(params) -> float | None:
    from torch.distributed.tensor import DTensor

    grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads))) if grads else None   # ZeRO: partitioned


def clip_a_part(acc: Accelerator, net, dl) -> dict:
    """clip_grad_norm_ over the transformer blocks alone (not the embeddings): their own norm, the rest untouched."""
    batch = next(iter(dl))
    acc.backward(net(input_ids=batch, labels=batch).loss)
    inner = acc.unwrap_model(net)
    part = list(inner.transformer.h.parameters())
    rest = [p for p in inner.parameters() if all(p is not q for q in part)]
    before = {"part": grad_norm(part), "rest": grad_norm(rest)}
    try:
        returned = float(acc.clip_grad_norm_(part, 1e-3))
    except ValueError as e:   # an engine that clips inside its own step
        return {"refused": str(e)}
    return {"returned": returned, **before, "part_after": grad_norm(part), "rest_after": grad_norm(rest)}


def main() -> None:
    out, engines = sys.argv[1], sys.argv[2:]
    results = {engine: train(engine) for engine in engines}
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
