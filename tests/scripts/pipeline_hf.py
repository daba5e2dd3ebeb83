"""Launched on 2 processes by tests/distributed/test_pipeline_hf.py: a tiny Llama (built from a config) cut into
2 pipeline stages by a user's `split` function (the stages name its layers their own way) and fine-tuned with a
loss_func under `distrib_ctx(strategy="model_parallel", pp_size=2)` with a Checkpoint (OUT/ckpt); inside the block `save_model(OUT/export)` and
`learn.model.generate` (refused, naming what to do); after it `generate` on the whole model, then `get_preds` under
DDP (the model's output holds a key/value cache: its logits are gathered). Rank 0 writes the weights after the
pipeline block to OUT/weights.pt and prints `CHECK <name> ok`. Usage: `pipeline_hf.py OUT`.
`learner()` is imported by the test, which trains the same model on one process.
"""

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

from cadence import Checkpoint, DataLoaders, Learner

PROMPT = torch.tensor([[5, 6, 7, 8, 5, 6, 7]])


def make_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                        bos_token_id=0, eos_token_id=0))


def motifs(n: int, seed: int) -> TensorDataset:
    ids = torch.randint(0, 128, (n, 4), generator=torch.Generator().manual_seed(seed)).repeat(1, 4)
    return TensorDataset(ids, ids)


def lm_loss(pred, labels):
    logits = getattr(pred, "logits", pred)
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


class Stage(nn.Module):
    """Stage `stage` of the Llama: its own names for the model's layers (embed, layers, norm, head)."""

    def __init__(self, model, stage, num_stages):
        super().__init__()
        m, first, last = model.model, stage == 0, stage == num_stages - 1
        share = -(-len(m.layers) // num_stages)
        self.first, self.last = first, last
        self.embed = m.embed_tokens if first else None
        self.layers = nn.ModuleList(list(m.layers)[stage * share:(stage + 1) * share])
        self.rotary = m.rotary_emb
        self.norm = m.norm if last else None
        self.head = model.lm_head if last else None

    def forward(self, x):
        h = self.embed(x) if self.first else x
        pos = torch.arange(h.shape[1], device=h.device)[None].expand(h.shape[0], -1)
        pe = self.rotary(h, pos)
        for layer in self.layers:
            h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
            h = h[0] if isinstance(h, tuple) else h
        return self.head(self.norm(h)) if self.last else h


def learner(model=None, train_rows: int = 32) -> Learner:
    """`model` (a new `make_model()` by default) with `train_rows` rows of motifs to learn; no progress bar."""
    dls = DataLoaders(DataLoader(motifs(train_rows, 1), batch_size=8), DataLoader(motifs(8, 2), batch_size=8),
                      device="cpu")
    learn = Learner(dls, model if model is not None else make_model(), loss_func=lm_loss,
                    opt_func=torch.optim.AdamW, lr=1e-2)
    learn.remove_cb(learn.progress)
    return learn


def main(out: str) -> None:
    from cadence.distributed.env import rank

    learn = learner()
    with learn.distrib_ctx(strategy="model_parallel", pp_size=2, pp_schedule="1F1B", pp_microbatches=4,
                           split=Stage):
        learn.fit(1, cbs=Checkpoint(f"{out}/ckpt"))   # model_parallel's sharded format
        learn.save_model(f"{out}/export")
        try:
            learn.model.generate(PROMPT, max_new_tokens=4, do_sample=False)
        except RuntimeError as e:
            if "pipeline parallelism" in str(e) and "after the distrib_ctx block" in str(e) and rank() == 0:
                print("CHECK generate_refused ok", flush=True)
    tokens = learn.model.generate(PROMPT, max_new_tokens=4, do_sample=False)
    if rank() == 0:
        assert tokens.shape == (1, PROMPT.shape[1] + 4), tokens.shape
        print("CHECK generate_after ok", flush=True)
        torch.save({k: v.detach().clone() for k, v in learn.model.state_dict().items()}, f"{out}/weights.pt")
    with learn.distrib_ctx(strategy="ddp"):   # get_preds of the model's output (logits and a DynamicCache) over DDP
        preds, targs = learn.get_preds()
    if rank() == 0:
        ids = learn.dls.valid.dataset.tensors[0]
        learn.model.eval()
        with torch.no_grad():
            expected = learn.model(ids).logits
        assert isinstance(preds, torch.Tensor) and torch.allclose(preds, expected, atol=1e-5), type(preds)
        assert torch.equal(targs, ids)
        print("CHECK get_preds_ddp ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
