"""Launched on 2 processes by tests/distributed/test_deepspeed.py: several trainings in one launch.

argv: OUT_DIR RUNS_JSON. RUNS_JSON is a list of runs, each a dict: "name", "strategy" ("ddp",
"deepspeed", or null: the launcher's), "kwargs" (for distrib_ctx), "accum", "clip", "precision", "bs" (batch size, default 4),
"epochs" (default 2), "expect_error" (the run must raise ValueError before training: its message is
written instead), "kwargs": {"zero3_init_flag": true} builds the model
in the strategy's init_context (the "untrained" result is then the first parameter's size as built and its partition's),
"native_ckpt" (train one epoch, save the engine's own checkpoint, then a new Learner
loads it and trains the remaining epochs). Each run writes OUT_DIR/<name>/model.safetensors (save_model:
full fp32 weights) and OUT_DIR/<name>/preds.pt (get_preds on the validation set, under the engine); rank 0
writes OUT_DIR/results.json with every run's validation loss, steps and errors.
"""

import contextlib
import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import DataLoaders, GradAccum, GradClip, Learner, MixedPrecision
from cadence.distributed import get_strategy
from cadence.distributed.env import rank, setup_distrib
from engines import make_model  # the model tests/distributed/test_engines.py trains

N = 96


def learner(run, strategy=None):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 6, generator=g)
    y = (x @ torch.randn(6, 3, generator=g)).argmax(1)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=run.get("bs", 4)),
                      DataLoader(TensorDataset(x, y), batch_size=8), device="cpu")
    cbs = [GradAccum(steps=run["accum"])] if run.get("accum") else []
    cbs += [GradClip(run["clip"])] if run.get("clip") else []
    cbs += [MixedPrecision(run["precision"])] if run.get("precision") else []
    with strategy.init_context() if strategy is not None else contextlib.nullcontext():
        model = make_model()  # zero3_init_flag: each rank holds only its partition from the start
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=torch.optim.AdamW, lr=1e-2, cbs=cbs)
    learn.remove_cb(learn.progress)
    return learn


def fit(run, out, stack):
    """The Learner after training inside its distrib_ctx (entered on `stack`), and its untrained loss."""
    ctx = lambda learn: stack.enter_context(learn.distrib_ctx(strategy=run["strategy"], **run.get("kwargs", {})))
    if run.get("kwargs", {}).get("zero3_init_flag"):  # the strategy first: the model is built in its init_context
        strategy = get_strategy(run["strategy"], **run["kwargs"])
        learn = learner(run, strategy)
        first = next(learn.model.parameters())
        built = {"numel": first.numel(), "partition_numel": first.ds_tensor.numel()}
        stack.enter_context(learn.distrib_ctx(strategy=strategy))
        learn.fit(run.get("epochs", 2))
        return learn, built
    learn = learner(run)
    untrained = learn.validate()["valid_loss"]
    if not run.get("native_ckpt"):
        ctx(learn)
        learn.fit(run.get("epochs", 2))
        return learn, untrained
    # one epoch and the engine's own checkpoint; a new Learner loads it and trains the other epochs
    ckpt = out / run["name"] / "native"
    with learn.distrib_ctx(strategy=run["strategy"], **run.get("kwargs", {})):
        learn.fit(1)
        learn.strategy.save_checkpoint(ckpt, learn.model, learn.opt)
    learn = learner(run)
    ctx(learn)
    learn.strategy.load_checkpoint(ckpt, learn.model, learn.opt)
    learn.fit(run.get("epochs", 2) - 1)
    return learn, untrained


def train(run, out):
    with contextlib.ExitStack() as stack:
        try:
            learn, untrained = fit(run, out, stack)
        except ValueError as e:
            if not run.get("expect_error"):
                raise
            return {"error": str(e)}
        learn.save_model(out / run["name"])
        valid = learn.validate()["valid_loss"]
        preds = learn.get_preds()[0]
        engine = type(learn.model).__name__
    if rank() == 0:
        torch.save(preds, out / run["name"] / "preds.pt")
    return {"valid_loss": valid, "untrained": untrained, "step": learn.step, "engine": engine,
            "released": type(learn.model).__name__, "grad_norm": getattr(learn, "grad_norm", None),
            "lr": learn.opt.param_groups[0]["lr"]}


def main():
    out, runs = Path(sys.argv[1]), json.loads(sys.argv[2])
    setup_distrib()  # one group for every run
    results = {run["name"]: train(run, out) for run in runs}
    if rank() == 0:
        (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
