"""Launched on 2 or 4 processes by tests/distributed/test_model_parallel.py: a tiny Llama (tied embeddings,
built from a config) fine-tuned by the Learner (dict batches, the model's own loss) under
`distrib_ctx(strategy="model_parallel", tp_size=2)` with no parallelize function: the model's own
tensor-parallel plan slices it. Rank 0 prints `CHECK <name> ok` for each check against a hand-written
one-process loop over the same global batches: per-step losses (dp=1), weights after training, the tie.
"""

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM

from cadence import Callback, DataLoaders, Learner
from cadence.distributed.env import rank, world_size

BS, SEQ, N, EPOCHS, LR = 2, 12, 16, 2, 1e-2


class Tokens(Dataset):
    def __init__(self, n, seed):
        self.ids = torch.randint(0, 96, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=True))


def reference(ds, dp):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    share, losses = len(ds) // dp, []
    for _ in range(EPOCHS):
        for k in range(share // BS):
            idx = torch.cat([torch.arange(g * share + k * BS, g * share + (k + 1) * BS) for g in range(dp)])
            loss = model(input_ids=ds.ids[idx], labels=ds.ids[idx]).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return model, losses


class Losses(Callback):
    def before_fit(self):
        self.values = []

    def after_batch(self):
        if self.training:
            self.values.append(float(self.learn.loss))


def ok(name):
    if rank() == 0:
        print(f"CHECK {name} ok", flush=True)


def main():
    ds = Tokens(N, 1)
    dls = DataLoaders(DataLoader(ds, batch_size=BS), DataLoader(Tokens(4, 2), batch_size=BS), device="cpu")
    losses = Losses()
    learn = Learner(dls, make_model(), loss_func=None, opt_func=torch.optim.AdamW, lr=LR, cbs=[losses])
    with learn.distrib_ctx(strategy="model_parallel", tp_size=2):
        dp = world_size() // 2
        model = learn.model
        assert type(model.model.layers[0].mlp.up_proj.weight).__name__ == "DTensor", "the model's plan was not applied"
        assert model.lm_head.weight is model.model.embed_tokens.weight, "tie lost while sliced"
        learn.fit(EPOCHS)
    ref, ref_losses = reference(ds, dp)
    if dp == 1:
        torch.testing.assert_close(torch.tensor(losses.values), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
    ok("losses")
    plain = learn.model
    assert plain.lm_head.weight is plain.model.embed_tokens.weight, "tie lost after the context"
    for (name, a), b in zip(ref.named_parameters(), plain.parameters()):  # AdamW magnifies rounding: 1e-4 of lr 1e-2
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-3, atol=1e-4, msg=lambda m: f"{name}: {m}")
    ok("weights")


if __name__ == "__main__":
    main()
