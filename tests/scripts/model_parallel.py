"""Launched on 2 or 4 processes by tests/distributed/test_model_parallel.py: `model_parallel.py CLIP VARIANT...`.

A tiny language model with tied input/output embeddings trained by the Learner under
`distrib_ctx(strategy="model_parallel", tp_size=2)` (dp = world // 2, FSDP2 over dp) with GradClip(CLIP),
once per VARIANT, one after the other in the same processes: `tp` (tensor parallel), `sp` (with sequence
parallelism), `loss_parallel` (the loss on logits sliced over the vocabulary), `bf16` (learn.to_bf16()), `hsdp`
(tp_size=1, dp_replicate_size=2: HSDP, shards replicated across two groups). Rank 0 prints
`CHECK <variant>:<name> ok` for each passed check against a hand-written one-process loop over the same global
batches (computed here, without cadence):
- losses and gradient norms per step, and the weights after training, equal the reference;
- the tie between embedding and output layer holds while sharded and after the context;
- the valid loss, get_preds (count and order over the dp group) equal the reference's;
- batches are identical within a tp group and differ across dp groups;
- every rank's model is the whole trained model after the context.
"""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import Callback, DataLoaders, GradClip, Learner
from cadence.distributed.env import rank, world_size

VOCAB, DIM, SEQ, N_TRAIN, N_VALID, BS, EPOCHS, LR = 16, 8, 6, 32, 12, 4, 2, 0.5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def parallelize(model, tp_mesh, head=None):
    """Megatron-style TP: embedding and output layer sliced over the vocabulary, MLPs column- then row-wise."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"embed": RowwiseParallel(input_layouts=Replicate()), "head": head or ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.blocks)):
        plan.update({f"blocks.{i}.fc1": ColwiseParallel(), f"blocks.{i}.fc2": RowwiseParallel()})
    parallelize_module(model, tp_mesh, plan)


def parallelize_sequence(model, tp_mesh):
    """TP with sequence parallelism: activations between the MLPs (and the norms) sharded over the sequence."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    plan = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    for i in range(len(model.blocks)):
        plan.update({f"blocks.{i}.norm": SequenceParallel(), f"blocks.{i}.fc1": ColwiseParallel(input_layouts=Shard(1)),
                     f"blocks.{i}.fc2": RowwiseParallel(output_layouts=Shard(1))})
    parallelize_module(model, tp_mesh, plan)


def parallelize_vocab_sliced(model, tp_mesh):
    """TP whose output layer leaves the logits sliced over the vocabulary, for `loss_parallel`."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    parallelize(model, tp_mesh, head=ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))


def make_model():
    torch.manual_seed(0)
    return TinyLM()


def lm_loss(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def global_batches(x, y, dp, bs=BS):
    """The one-process batches equal to step k of `dp` groups, each taking its contiguous share of the data."""
    share = len(x) // dp
    for k in range(share // bs):
        idx = torch.cat([torch.arange(g * share + k * bs, g * share + (k + 1) * bs) for g in range(dp)])
        yield x[idx], y[idx]


def reference(x, y, dp, clip, make=None, loss_func=lm_loss, bs=BS, epochs=EPOCHS, lr=LR):
    """Plain SGD in one process on the global batches, clipped: (model, losses, norms before clipping)."""
    model = (make or make_model)()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, norms = [], []
    for _ in range(epochs):
        for xb, yb in global_batches(x, y, dp, bs):
            loss = loss_func(model(xb), yb)
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return model, losses, norms


class Record(Callback):
    """Per step: the loss, the norm GradClip saw, and the batch's first token (to compare across ranks)."""

    def before_fit(self):
        self.losses, self.norms, self.firsts = [], [], []

    def after_batch(self):
        if self.training:
            self.losses.append(float(self.learn.loss))
            self.norms.append(float(getattr(self.learn, "grad_norm", float("nan"))))
            self.firsts.append(self.learn.xb[0].flatten()[:3].tolist())


def ok(variant, name):
    if rank() == 0:
        print(f"CHECK {variant}:{name} ok", flush=True)


VARIANTS = {"tp": (parallelize, {}), "sp": (parallelize_sequence, {}),
            "loss_parallel": (parallelize_vocab_sliced, {"loss_parallel": True}), "bf16": (parallelize, {}),
            "hsdp": (parallelize, {"dp_replicate_size": 2}),  # tp 1: FSDP2 over (dp_replicate 2, dp_shard world / 2)
            "hsdp_tp": (parallelize, {"dp_replicate_size": 2})}  # tp 2 inside FSDP2 over (dp_replicate 2, dp_shard)


def run(variant, clip, tp=2):
    plan, options = VARIANTS[variant]
    x, y = data(N_TRAIN, 1)
    xv, yv = data(N_VALID, 2)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=BS), DataLoader(TensorDataset(xv, yv), batch_size=BS),
                      device="cpu")
    record = Record()
    learn = Learner(dls, make_model(), loss_func=lm_loss, opt_func=torch.optim.SGD, lr=LR, cbs=[record, GradClip(clip)])
    if variant == "bf16":
        learn.to_bf16()
    with learn.distrib_ctx(strategy="model_parallel", tp_size=tp, parallelize=plan, **options):
        dp = world_size() // tp
        model = learn.model
        assert model.head.weight is model.embed.weight, "the tie must hold while sliced"
        ok(variant, "tied_while_sliced")
        learn.fit(EPOCHS)
        valid_loss = learn.validate()["valid_loss"]
        preds, targs = learn.get_preds()
        firsts = [None] * world_size()
        dist.all_gather_object(firsts, record.firsts)
    ref_model, ref_losses, ref_norms = reference(x, y, dp, clip)
    # bf16 compute against the fp32 reference: rounding-level agreement only
    rtol, atol = (0.15, 0.05) if variant == "bf16" else (1e-4, 1e-5)

    # batches: the tp ranks of a dp group see the same data, dp groups different data
    for r in range(world_size()):
        assert firsts[r] == firsts[(r // tp) * tp], f"rank {r} saw other batches than its tp group"
    if dp > 1:
        assert firsts[0] != firsts[tp], "dp groups saw the same batches"
    ok(variant, "batches_per_group")

    # dp group 0's loss is its share of the global batch: compared when dp == 1, else through the norms and weights
    if dp == 1:
        torch.testing.assert_close(torch.tensor(record.losses), torch.tensor(ref_losses), rtol=rtol, atol=atol)
    torch.testing.assert_close(torch.tensor(record.norms), torch.tensor(ref_norms), rtol=rtol, atol=atol)
    ok(variant, "losses_and_norms")

    plain = learn.model
    assert plain.head.weight is plain.embed.weight, "the tie must hold after the context"
    for (name, a), b in zip(ref_model.named_parameters(), plain.parameters()):
        assert b.dtype == torch.float32, f"{name} came back as {b.dtype}"
        torch.testing.assert_close(b.detach(), a.detach(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    ok(variant, "weights_equal_reference")

    with torch.no_grad():
        ref_logits = ref_model(xv)
    torch.testing.assert_close(torch.tensor(valid_loss), lm_loss(ref_logits, yv), rtol=rtol, atol=atol)
    assert preds.shape == ref_logits.shape and torch.equal(targs, yv), (preds.shape, ref_logits.shape)
    torch.testing.assert_close(preds.float(), ref_logits, rtol=rtol, atol=10 * atol)
    ok(variant, "valid_and_get_preds")


def main():
    clip = float(sys.argv[1])
    for variant in sys.argv[2:]:
        run(variant, clip, tp=1 if variant == "hsdp" else 2)


if __name__ == "__main__":
    main()
