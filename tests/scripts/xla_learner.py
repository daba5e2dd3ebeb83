"""The Learner on torch_xla's CPU device (PJRT_DEVICE=CPU), run by tests/xla in the XLA environment.

Each mode writes a JSON report to `--out`; references are computed here with the plain-CPU Learner
(the same code path every other test checks against hand-written loops) or by hand:

  equal    XLA vs plain CPU after 2 epochs, for SGD, AdamW, GradAccum, GradClip, bf16: max |weight diff|
  counts   graphs compiled per epoch and executions per optimizer step on a ragged data set; the
           validation loss next to a hand-computed mean over every validation sample
  per_fit  graphs compiled, executions and host transfers of a fit(1) next to a hand-written epoch
  train    train with a Checkpoint every step, optionally SIGKILL itself at a step; resume="auto"
  spmd     (CPU_NUM_DEVICES=N) data parallel, FSDPv2 (a Hugging Face model's ModelOutput too), 2-D meshes
           against the plain-CPU run; a bad mesh
"""

import argparse
import contextlib
import json
import os
import signal
import sys
import threading

import torch_xla  # the XLA device must exist before the first backward of the process (autograd sizes its queues)
import torch_xla.runtime as xr

if os.environ.get("CADENCE_XLA_SPMD") == "1":
    xr.use_spmd()  # before any tensor is on the device
torch_xla.device()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from cadence.callbacks.accumulate import GradAccum  # noqa: E402
from cadence.callbacks.checkpoint import Checkpoint  # noqa: E402
from cadence.callbacks.clip import GradClip  # noqa: E402
from cadence.callbacks.precision import MixedPrecision  # noqa: E402
from cadence.distributed.xla import XLA  # noqa: E402
from cadence.trainer.callback import Callback  # noqa: E402
from cadence.trainer.data import DataLoaders  # noqa: E402
from cadence.trainer.learner import Learner  # noqa: E402

N_TRAIN, N_VALID, BS = 70, 30, 16  # neither a multiple of the batch size: ragged last batches


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_TRAIN + N_VALID, 8, generator=g)
    y = (x[:, :4].sum(1) > x[:, 4:].sum(1)).long()
    return x, y


def dls(shuffle=False):
    x, y = data()
    train = TensorDataset(x[:N_TRAIN], y[:N_TRAIN])
    valid = TensorDataset(x[N_TRAIN:], y[N_TRAIN:])
    return DataLoaders(DataLoader(train, batch_size=BS, shuffle=shuffle), DataLoader(valid, batch_size=BS))


def model(dropout=0.0):
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), *([nn.Dropout(dropout)] if dropout else []), nn.Linear(32, 2))


OPTS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}
CASES = {  # name -> (optimizer, lr, callbacks)
    "sgd": ("sgd", 0.1, lambda: []),
    "adamw": ("adamw", 1e-2, lambda: []),
    "accum": ("sgd", 0.1, lambda: [GradAccum(steps=2)]),
    "clip": ("adamw", 1e-2, lambda: [GradClip(0.05)]),
    "bf16": ("sgd", 0.1, lambda: [MixedPrecision("bf16")]),
}


def learner(case, dropout=0.0, **kw):
    opt, lr, cbs = CASES[case]
    return Learner(dls(**kw), model(dropout), loss_func=F.cross_entropy, opt_func=OPTS[opt], lr=lr, cbs=cbs())


def weights(learn):
    return {k: v.detach().cpu().float() for k, v in learn.strategy.unwrap(learn.model).state_dict().items()}


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


class Shardings(Callback):
    """The XLA sharding of the first training batch's input and of the first weight (empty: not sharded)."""

    def before_batch(self):
        if not hasattr(self, "specs"):
            spec = torch_xla._XLAC._get_xla_sharding_spec
            self.specs = {"input": spec(self.learn.xb[0]), "weight": spec(next(self.learn.model.parameters()))}


def fit_xla(case, epochs=2, **strategy_kwargs):
    learn, shardings = learner(case), Shardings()
    with learn.distrib_ctx(strategy="xla", **strategy_kwargs):
        learn.fit(epochs, cbs=shardings)
        out = weights(learn), learn.recorder.values, shardings.specs
    return out


def hf_learner():
    """A tiny Llama (transformers) that computes its own loss from dict batches: its output is a ModelOutput."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    net = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=64))
    ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(1))
    rows = [{"input_ids": r, "labels": r} for r in ids]
    return Learner(DataLoaders(DataLoader(rows, batch_size=8), DataLoader(rows[:8], batch_size=8)), net,
                   loss_func=None, opt_func=torch.optim.SGD, lr=0.1)


def fit_cpu(case, epochs=2):
    learn = learner(case)
    learn.fit(epochs)
    return weights(learn), learn.recorder.values


def bf16_by_hand(epochs=2):
    """The bf16 case as a hand-written torch_xla loop: autocast on the XLA device, a sync per step."""
    device = torch_xla.device()
    net = model().to(device)
    opt = torch.optim.SGD(net.parameters(), lr=CASES["bf16"][1])
    for _ in range(epochs):
        for xb, yb in dls().train:
            with torch.autocast("xla", dtype=torch.bfloat16):
                loss = F.cross_entropy(net(xb.to(device)), yb.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch_xla.sync()
    return {k: v.detach().cpu().float() for k, v in net.state_dict().items()}


def equal(args):
    """fp32 cases against the plain-CPU Learner; bf16 against a hand-written torch_xla loop (bf16 rounds
    differently on XLA and on the CPU backend: that difference is reported as bf16_vs_cpu)."""
    report = {}
    for case in CASES:
        (wx, vx, _), (wc, vc) = fit_xla(case), fit_cpu(case)
        report[case] = {"weights": max_diff(wx, wc),
                        "valid_loss": max(abs(a["valid_loss"] - b["valid_loss"]) for a, b in zip(vx, vc))}
        if case == "bf16":
            report["bf16_vs_cpu"] = report.pop(case)
            report[case] = {"weights": max_diff(wx, bf16_by_hand())}
    return report


class Counts(Callback):
    """XLA.counts() at the end of every epoch and after every optimizer step."""

    def before_fit(self):
        self.epochs, self.steps, self.start = [], [], XLA.counts()

    def after_step(self):
        self.steps.append(XLA.counts())

    def after_epoch(self):
        self.epochs.append(XLA.counts())

    def before_batch(self):
        if self.learn.training and self.learn.iter == 1:   # the first step's graph (and the last epoch's leftovers) ran
            self.second_step = XLA.counts()

    def before_validate(self):
        self.steps.append(("v", XLA.counts()))
        end = self.steps[-1][1]                  # the last step's graph ran at its zero_grad
        self.outputs_per_step = (end["outputs"] - self.second_step["outputs"]) / (len(self.learn.dls.train) - 1)


def hand_outputs_per_step():
    """Device buffers per step of the hand-written torch_xla loop doing what the "clip" case does."""
    import torch_xla

    device = torch_xla.device()
    net = model().to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    batches = [(xb.to(device), yb.to(device)) for xb, yb in dls().train]
    for epoch in range(2):                       # the first epoch compiles
        start = XLA.counts()
        for xb, yb in batches:
            F.cross_entropy(net(xb), yb).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch_xla.sync()
    return (XLA.counts()["outputs"] - start["outputs"]) / len(batches)


def counts(args):
    learn = learner("clip", shuffle=True)  # AdamW and GradClip: the norm stays on the device, no extra execution
    cb = Counts()
    with learn.distrib_ctx(strategy="xla"):
        learn.fit(3, cbs=cb)
        hand = hand_outputs_per_step()
        # every validation sample once: the mean loss over all of them, computed by hand on the CPU
        plain = learn.strategy.unwrap(learn.model)
        w = {k: v.cpu() for k, v in plain.state_dict().items()}
    ref = model()
    ref.load_state_dict(w)
    x, y = data()
    with torch.no_grad():
        by_hand = F.cross_entropy(ref(x[N_TRAIN:]), y[N_TRAIN:]).item()
    return {"epochs": cb.epochs, "start": cb.start, "steps": cb.steps, "steps_per_epoch": len(learn.dls.train),
            "valid_loss": learn.recorder.values[-1]["valid_loss"], "valid_by_hand": by_hand,
            "outputs_per_step": cb.outputs_per_step, "hand_outputs_per_step": hand}


def per_fit(args):
    """What a fit(1) of the Learner costs on the device next to a hand-written epoch of the same steps (bench/xla.py's
    comparison, small): graphs compiled, executions, transfers, in the first fit / epoch and in the next."""
    x, y = data()
    train = DataLoader(TensorDataset(x[:64], y[:64]), batch_size=16)  # 4 full batches, no validation
    # SGD: its scalars are the same every step (AdamW's bias corrections are new values each step, uploaded unless
    # XLA's cache of small constants still holds them from the other loop's same step: counts that depend on order)
    learn = Learner(DataLoaders(train), model(), loss_func=F.cross_entropy, opt_func=torch.optim.SGD, lr=0.1)

    def used(run):
        before = XLA.counts()
        run()
        after = XLA.counts()
        return {k: after[k] - before[k] for k in after}

    device = torch_xla.device()
    net = model().to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def hand_epoch():
        for xb, yb in train:
            loss = F.cross_entropy(net(xb.to(device)), yb.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch_xla.sync()

    with learn.distrib_ctx(strategy="xla"):  # the Learner first: its graphs are not in the cache before it
        threads = set()  # where the backward ran: a gradient hook runs on the thread that runs the backward
        next(learn.model.parameters()).register_hook(lambda grad: threads.add(threading.get_ident()))
        fits = [used(lambda: learn.fit(1)) for _ in range(2)]
        hand = [used(hand_epoch) for _ in range(2)]
    return {"steps": len(train), "learner": fits, "hand": hand,
            "backward_on_the_calling_thread": threads == {threading.get_ident()}}


class FirstStep(Callback):
    """The optimizer step count when the first training batch starts (> 0 in a resumed fit)."""

    def before_batch(self):
        if self.learn.training and not hasattr(self, "first"):
            self.first = self.learn.step


class Die(Callback):
    def __init__(self, step):
        self.at = step

    def after_step(self):
        if self.learn.step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def train(args):
    learn = learner("adamw", dropout=0.3, shuffle=True)   # dropout draws from XLA's generator: checkpointed too
    learn.path = args.dir
    first = FirstStep()
    cbs = [Checkpoint(every_n_steps=1, every_epoch=False), first] + ([Die(args.kill_at)] if args.kill_at else [])
    with learn.distrib_ctx(strategy="xla"):
        learn.fit(2, cbs=cbs, resume="auto")
        w = weights(learn)
    torch.save(w, os.path.join(args.dir, "final.pt"))
    return {"steps": learn.step, "first_step": first.first}


def spmd(args):
    n = xr.global_runtime_device_count()
    report = {"devices": n}
    ref = {case: fit_cpu(case)[0] for case in ("sgd", "adamw")}
    meshes = {"dp": {}, "fsdp": {"fsdp": True}}
    if n == 4:
        meshes = {"dp": {}, "fsdp": {"fsdp": True}, "2x2": {"fsdp": True, "mesh_shape": (2, 2)}}
    for name, kw in meshes.items():
        for case in ("sgd", "adamw"):
            w, _, specs = fit_xla(case, spmd=True, **kw)
            report[f"{name}-{case}"] = {"diff": max_diff(w, ref[case]), **specs}
    hf = {}
    for where in ("cpu", "xla"):   # a Hugging Face model computing its own loss returns a ModelOutput
        learn = hf_learner()
        with learn.distrib_ctx(strategy="xla", spmd=True, fsdp=True) if where == "xla" else contextlib.nullcontext():
            learn.fit(1)
            hf[where] = weights(learn), [list(r) for r in learn.recorder.values]
    report["hf-fsdp"] = {"diff": max_diff(hf["xla"][0], hf["cpu"][0]), "rows": [hf["xla"][1], hf["cpu"][1]]}
    try:
        XLA(spmd=True, mesh_shape=(n + 1,)).setup_environment()
        report["bad_mesh"] = None
    except ValueError as e:
        report["bad_mesh"] = str(e)
    return report


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["equal", "counts", "per_fit", "train", "spmd"])
    p.add_argument("--out", required=True)
    p.add_argument("--dir", default=".")
    p.add_argument("--kill-at", type=int, default=0)
    a = p.parse_args()
    result = globals()[a.mode](a)
    with open(a.out, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
