"""Launched on 2 and 3 processes by tests/trainer/test_fastai_ddp.py; each check prints `CHECK <name> ok` on rank 0.

- get_preds (and tta, built on it): every item of the data set once, in data set order, from a shuffled drop_last loader
  (the train loader, ds_idx=0) and from the valid loader, with inputs, decoded classes and per-item losses;
- a validation set of 1 item: the fit's metrics, `get_preds(dl=)` and `validate(dl=)` count it once, as one process
  does (the other ranks have padding alone), with a loss_func and with a model that computes its loss;
- under to_bf16, a model computing its loss: a partly padded batch gives fp32 predictions too, FSDP2 included;
- get_preds(concat_dim=1) of a sequence-first model drops the padding along each tensor's batch dimension;
- fit(reset_opt=True): a new optimizer, counted afresh, the processes still equal;
- lr_find: one sweep on every process (the loss averaged over them), every process restored to the same weights;
- Recorder: `train_loss` is the mean of the processes' own smoothed losses (fastai's smoothing, written out
  here), equal on every process; with `train_metrics=True`, `train_accuracy` is over every process's batches;
- DistributedDL over DataLoader(sampler=BatchSampler(RandomSampler), batch_size=None) (Accelerate's pattern): the
  processes share one draw and together take every batch of it once (the last round padded);
- MixUp: a DDP fit with batch b per process equals one process (the same script, no distribution)
  fitting batches of b * world_size made of the same items: the same mixed inputs, bitwise, at every
  step, and the same weights after it.
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import Callback, DataLoaders, Learner, Order, Recorder, accuracy
from cadence.callbacks.mixup import MixUp
from cadence.distributed.env import rank, world_size

N_TRAIN, N_VALID, BS = 48, 37, 4   # 37 valid items: padded shards on 2 and 3 processes


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_TRAIN + N_VALID, 6, generator=g)
    y = (x @ torch.randn(6, 3, generator=g)).argmax(1)
    return x, y


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def check(name, ok):
    assert ok, name
    if rank() == 0:
        print(f"CHECK {name} ok", flush=True)


class SeeInputs(Callback):
    """Every training batch's inputs after MixUp (it runs after MixUp's before_batch), gathered over processes."""

    order = Order.DEFAULT + 1

    def before_fit(self):
        self.seen = []

    def before_batch(self):
        if self.training:
            self.seen.append(self.learn.strategy.gather(self.learn.xb[0]))


def check_get_preds(x, y):
    train = DataLoader(TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), batch_size=BS * 2 + 1, shuffle=True, drop_last=True)
    valid = DataLoader(TensorDataset(x[N_TRAIN:], y[N_TRAIN:]), batch_size=BS)
    learn = Learner(DataLoaders(train, valid, device="cpu"), model(), loss_func=nn.CrossEntropyLoss())
    with learn.no_bar(), learn.distrib_ctx():
        learn.fit(1, lr=0.1)
        inps, preds, targs, decoded, losses = learn.get_preds(ds_idx=0, with_input=True, with_decoded=True,
                                                              with_loss=True)
        vpreds, vtargs = learn.get_preds()
        tta, ttargs = learn.tta(n=2, batch_tfms=lambda t: t + 1)
    out = learn.model(x)
    check("get_preds_train_all_items_in_order", torch.equal(inps, x[:N_TRAIN]) and torch.equal(targs, y[:N_TRAIN]))
    check("get_preds_train_values", torch.allclose(preds, out[:N_TRAIN], atol=1e-6)
          and torch.equal(decoded, preds.argmax(1))
          and torch.allclose(losses, nn.functional.cross_entropy(out[:N_TRAIN], y[:N_TRAIN], reduction="none"),
                             atol=1e-6))
    check("get_preds_valid_all_items_in_order", torch.equal(vtargs, y[N_TRAIN:])
          and torch.allclose(vpreds, out[N_TRAIN:], atol=1e-6))
    check("tta_lerps_augmented_and_plain_in_order", torch.equal(ttargs, y[N_TRAIN:])
          and torch.allclose(tta, torch.lerp(learn.model(x[N_TRAIN:] + 1), out[N_TRAIN:], 0.25), atol=1e-6))


class DictModel(nn.Module):
    """A model computing its own loss from a dict batch, as a Hugging Face model does (the Learner's loss_func=None)."""

    def __init__(self):
        super().__init__()
        self.net = model()

    def forward(self, x, labels):
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def check_one_valid_item(x, y):
    """1 validation item on 2 or 3 processes: every rank but the first has padding alone."""
    train = DataLoader(TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), batch_size=BS)
    one = TensorDataset(x[N_TRAIN:N_TRAIN + 1], y[N_TRAIN:N_TRAIN + 1])
    learn = Learner(DataLoaders(train, DataLoader(one, batch_size=BS), device="cpu"), model(),
                    loss_func=nn.CrossEntropyLoss(), metrics=[accuracy, lambda p, t: float(len(t))])
    with learn.no_bar(), learn.distrib_ctx():
        learn.fit(1, lr=0.1)
        preds, targs, losses = learn.get_preds(dl=DataLoader(one, batch_size=BS), with_loss=True)
        again = learn.validate(dl=DataLoader(one, batch_size=BS))
    out = learn.model(x[N_TRAIN:N_TRAIN + 1])
    loss = nn.functional.cross_entropy(out, y[N_TRAIN:N_TRAIN + 1])
    row = learn.recorder.values[-1]
    check("one_valid_item_counted_once_on_every_process", row["<lambda>"] == 1.0
          and abs(row["valid_loss"] - float(loss)) < 1e-6 and row["accuracy"] == float(out.argmax(1) == y[N_TRAIN])
          and again == {k: row[k] for k in ("valid_loss", "accuracy", "<lambda>")})
    check("one_valid_item_get_preds", torch.allclose(preds, out, atol=1e-6) and torch.equal(targs, y[N_TRAIN:N_TRAIN + 1])
          and torch.allclose(losses, loss.reshape(1), atol=1e-6))
    dicts = [{"x": a, "labels": b} for a, b in zip(x[N_TRAIN:N_TRAIN + 1], y[N_TRAIN:N_TRAIN + 1])]
    learn = Learner(DataLoaders(DataLoader([{"x": a, "labels": b} for a, b in zip(x[:N_TRAIN], y[:N_TRAIN])],
                                           batch_size=BS), DataLoader(dicts, batch_size=BS), device="cpu"),
                    DictModel(), loss_func=None)
    with learn.no_bar(), learn.distrib_ctx():
        learn.fit(1, lr=0.1)
    out = learn.model.net(x[N_TRAIN:N_TRAIN + 1])
    check("one_valid_item_model_computed_loss", abs(learn.recorder.values[-1]["valid_loss"]
                                                    - float(nn.functional.cross_entropy(out, y[N_TRAIN:N_TRAIN + 1]))) < 1e-6)


def check_model_computed_loss_padded_batch(x, y):
    """A model computing its loss, under to_bf16, on DDP and FSDP2: the last validation batch, partly padding, runs
    on its real samples only, on every rank at once (FSDP2's forward gathers the parameters: a rank running the
    model again alone hung it); predictions fp32 as the others are (MixedPrecision's after_pred), loss by hand."""
    items = [{"x": a, "labels": b} for a, b in zip(x, y)]
    valid = items[N_TRAIN:N_TRAIN + 5]  # 5 items: the last shard is part padding on 2 and 3 processes
    for strategy in ("ddp", "fsdp"):
        learn = Learner(DataLoaders(DataLoader(items[:N_TRAIN], batch_size=BS), DataLoader(valid, batch_size=BS),
                                    device="cpu"), DictModel(), loss_func=None).to_bf16()
        with learn.no_bar(), learn.distrib_ctx(strategy=strategy):
            learn.fit(1, lr=0.1)
            preds, _ = learn.get_preds()
            again = learn.validate()["valid_loss"]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = learn.model.net(x[N_TRAIN:N_TRAIN + 5])
        by_hand = float(nn.functional.cross_entropy(out.float(), y[N_TRAIN:N_TRAIN + 5]))
        check(f"model_computed_loss_padded_batch_{strategy}", preds.dtype == torch.float32 and preds.shape == (5, 3)
              and torch.allclose(preds, out.float(), atol=0.05) and abs(again - by_hand) < 0.05
              and abs(learn.recorder.values[-1]["valid_loss"] - by_hand) < 0.05)


class SeqFirst(nn.Module):
    """Outputs (2, batch, 3), sequence first, from batch-first inputs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 3)

    def forward(self, x):
        return torch.stack([self.lin(x), -self.lin(x)])


def seq_first(items):
    """Inputs batch first, targets sequence first: (2, batch)."""
    return torch.stack([a for a, _ in items]), torch.stack([b for _, b in items]).expand(2, -1)


def check_concat_dim_with_padding(x, y):
    """get_preds(concat_dim=1) of a sequence-first model over 5 items: the last shard's padding is dropped along the
    batch dimension of each tensor (dim 1 of the outputs and targets, dim 0 of the inputs)."""
    valid = TensorDataset(x[N_TRAIN:N_TRAIN + 5], y[N_TRAIN:N_TRAIN + 5])
    learn = Learner(DataLoaders(DataLoader(TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), batch_size=BS),
                                DataLoader(valid, batch_size=BS, collate_fn=seq_first), device="cpu"), SeqFirst(),
                    loss_func=lambda p, t: nn.functional.cross_entropy(p.flatten(0, 1), t.flatten()))
    with learn.no_bar(), learn.distrib_ctx():
        preds, targs = learn.get_preds(concat_dim=1)
    with torch.no_grad():
        out = learn.model(x[N_TRAIN:N_TRAIN + 5])
    check("get_preds_concat_dim_drops_padding_along_the_batch", preds.shape == (2, 5, 3)
          and torch.allclose(preds, out, atol=1e-6) and torch.equal(targs, y[N_TRAIN:N_TRAIN + 5].expand(2, -1)))


def check_reset_opt(x, y):
    """fit(reset_opt=True) under DDP: a new Adam, its steps counted afresh, the same weights on every process."""
    learn = Learner(DataLoaders(DataLoader(TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), batch_size=BS), device="cpu"),
                    model(), loss_func=nn.CrossEntropyLoss(), opt_func=torch.optim.Adam)
    with learn.no_bar(), learn.distrib_ctx():
        learn.fit(2, lr=1e-2)
        learn.fit(1, lr=1e-2, reset_opt=True)
        steps = {s["step"].item() for s in learn.opt.state.values()}
        first = learn.strategy.gather(next(learn.model.parameters()).detach().flatten()[None])
    per_rank = -(-N_TRAIN // world_size()) // BS   # the rank's batches in one epoch (the shard rounded up)
    check("reset_opt_counts_afresh_under_ddp", steps == {float(per_rank)} and all(torch.equal(first[0], f) for f in first))


def check_lr_find(x, y):
    """lr_find under DDP: the sweep records the loss averaged over the processes, so every process stops at the
    same batch, suggests the same rate and restores the same weights (a rank stopping early would hang the rest)."""
    train = DataLoader(TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), batch_size=2, shuffle=True)
    learn = Learner(DataLoaders(train, device="cpu"), model(), loss_func=nn.CrossEntropyLoss())
    with learn.no_bar(), learn.distrib_ctx():
        torch.manual_seed(rank())                    # nothing in the sweep may depend on a process's own draws
        found = learn.lr_find(num_it=60, end_lr=1e3, show_plot=False)
        every = learn.strategy.gather(torch.tensor([found.valley, len(learn.lr_finder.losses),
                                                    *learn.lr_finder.losses[:5]], dtype=torch.float64))
        weights = learn.strategy.gather(torch.cat([p.detach().reshape(-1) for p in learn.model.parameters()]))
    every, weights = every.reshape(world_size(), -1), weights.reshape(world_size(), -1)
    check("lr_find_one_sweep_on_every_process", (every == every[0]).all() and every[0, 1] < 60
          and (weights == weights[0]).all() and torch.allclose(weights[0], torch.cat(
              [p.reshape(-1) for p in model().parameters()])))


class TrainHits(Callback):
    def before_fit(self):
        self.raw, self.hits = [], 0

    def after_loss(self):
        if self.training:
            self.raw.append(self.learn.loss.item())
            self.hits += int((self.learn.pred.argmax(1) == self.learn.y).sum())


def check_recorder(x, y):
    train = DataLoader(TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), batch_size=BS)
    valid = DataLoader(TensorDataset(x[N_TRAIN:], y[N_TRAIN:]), batch_size=BS)
    learn = Learner(DataLoaders(train, valid, device="cpu"), model(), loss_func=nn.CrossEntropyLoss(), cbs=TrainHits())
    learn.remove_cb(learn.recorder).add_cb(Recorder([accuracy], train_metrics=True))
    with learn.no_bar(), learn.distrib_ctx():
        learn.fit(2, lr=0.1)
        val, mine = 0.0, []
        for i, loss in enumerate(learn.train_hits.raw, 1):
            val = 0.98 * val + 0.02 * loss
            mine.append(val / (1 - 0.98 ** i))
        ends = learn.strategy.gather(torch.tensor([mine[len(mine) // 2 - 1], mine[-1]], dtype=torch.float64))
        hits = learn.strategy.all_sum(torch.tensor(float(learn.train_hits.hits)))
        values = learn.strategy.gather(torch.tensor([r["train_loss"] for r in learn.recorder.values]))
    means = ends.reshape(world_size(), 2).mean(0)
    check("recorder_losses_are_this_process_smoothed", len(learn.recorder.losses) == len(mine)
          and all(abs(a - b) < 1e-9 for a, b in zip(learn.recorder.losses, mine)))
    check("recorder_train_loss_is_the_mean_over_processes",
          torch.allclose(values.reshape(world_size(), 2), means.float().expand(world_size(), 2)))
    # no padding (48 items on 2 or 3 processes, batches of 4): each epoch's accuracy is its hits / 48
    check("recorder_train_accuracy_over_all_processes",
          abs(sum(r["train_accuracy"] for r in learn.recorder.values) - float(hits) / N_TRAIN) < 1e-6)


def check_batch_sampler_as_sampler():
    from torch.utils.data import BatchSampler, RandomSampler

    from cadence.distributed import DistributedDL, setup_distrib, teardown_distrib
    from cadence.distributed.ops import gather_object

    setup_distrib()                                # a process group for the shared seed and the gather
    ds = TensorDataset(torch.arange(30))
    dl = DataLoader(ds, sampler=BatchSampler(RandomSampler(ds), batch_size=4, drop_last=False), batch_size=None)
    ddl = DistributedDL(dl)                        # rank, world size and the shared seed from the process group
    every = gather_object([b[0].tolist() for b in ddl])
    teardown_distrib()
    steps = [b for step in zip(*every) for b in step]           # step by step, rank by rank
    real = steps[:8]                                              # 30 items: 8 batches (the last of 2)
    check("batch_sampler_as_sampler_every_batch_once", sorted(i for b in real for i in b) == list(range(30))
          and len({len(m) for m in every}) == 1 and steps[8:] == real[:len(steps) - 8])


def check_mixup(x, y):
    n = world_size()
    train = DataLoader(TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), batch_size=BS)
    learn = Learner(DataLoaders(train, device="cpu"), model(), loss_func=nn.CrossEntropyLoss(),
                    opt_func=torch.optim.SGD, lr=0.1, cbs=SeeInputs())
    with learn.no_bar(), learn.distrib_ctx():
        # the global batch of step t: each process's batch t, in rank order (contiguous shards)
        steps = [sum((learn.dls.train.get_idxs(r)[t * BS:(t + 1) * BS] for r in range(n)), [])
                 for t in range(len(learn.dls.train))]
        torch.manual_seed(7)
        learn.fit(2, cbs=MixUp(0.4))
        ddp = ({k: v.clone() for k, v in learn.strategy.unwrap(learn.model).state_dict().items()}, learn.see_inputs.seen)

    one = Learner(DataLoaders(DataLoader(TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), batch_sampler=steps), device="cpu"),
                  model(), loss_func=nn.CrossEntropyLoss(), opt_func=torch.optim.SGD, lr=0.1, cbs=SeeInputs())
    torch.manual_seed(7)
    with one.no_bar():
        one.fit(2, cbs=MixUp(0.4))
    check("mixup_same_mixed_inputs", len(ddp[1]) == len(one.see_inputs.seen) == 2 * len(steps)
          and all(torch.equal(a, b) for a, b in zip(ddp[1], one.see_inputs.seen)))
    check("mixup_same_weights", all(torch.allclose(ddp[0][k], v, atol=1e-6) for k, v in one.model.state_dict().items()))
    check("mixup_inputs_were_mixed", not torch.equal(one.see_inputs.seen[0], x[steps[0]]))


if __name__ == "__main__":
    x, y = data()
    check_get_preds(x, y)
    check_one_valid_item(x, y)
    check_model_computed_loss_padded_batch(x, y)
    check_concat_dim_with_padding(x, y)
    check_reset_opt(x, y)
    check_lr_find(x, y)
    check_recorder(x, y)
    check_batch_sampler_as_sampler()
    check_mixup(x, y)
