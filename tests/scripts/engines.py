"""Launched on 2 (or 4) processes by tests/distributed/test_engines.py: one Learner, several engines.

argv: OUT_DIR STRATEGY [json options]. Options: "accum" (GradAccum steps), "clip" (GradClip max_norm),
"precision" ("bf16"), "epochs", "strategy_kwargs" (dict for distrib_ctx), "count_comms" (count the
gradient collectives of each micro-step), "save_ckpt" / "load_ckpt" (the strategy's checkpoint methods),
"checkpoint" (a Checkpoint callback's directory, every 5 steps), "kill_at" (rank 1 dies by SIGKILL after
that step), "resume" (fit resumes from the Checkpoint's latest), "first_context_epochs" (epochs trained in an
earlier `distrib_ctx` of the same engine, left before the main one: the optimizer state crosses over).
Rank 0 writes OUT_DIR/weights.safetensors (the full weights after training, via save_model) and
OUT_DIR/result.json.
"""

import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import Callback, Checkpoint, DataLoaders, GradAccum, GradClip, Learner, MixedPrecision, Order
from cadence.distributed import Strategy, get_strategy
from cadence.distributed.env import rank
from cadence.distributed.shm_allreduce import SharedMemoryAllReduce

N, BS = 96, 4


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin, self.norm = nn.Linear(width, width), nn.LayerNorm(width)

    def forward(self, x):
        return x + torch.relu(self.norm(self.lin(x)))


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), Block(16), Block(16), nn.Linear(16, 3))


class KillAt(Callback):
    """Rank 1 dies by SIGKILL right after optimizer step `at` (and its checkpoint), mid-epoch."""
    order = Order.CHECKPOINT + 10

    def __init__(self, at):
        self.at = at

    def after_batch(self):
        if self.training and self.learn.step == self.at and rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def learner(opts, strategy=None):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 6, generator=g)
    y = (x @ torch.randn(6, 3, generator=g)).argmax(1)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=BS), DataLoader(TensorDataset(x, y), batch_size=8),
                      device="cpu")
    cbs = []
    if opts.get("accum"):
        cbs.append(GradAccum(steps=opts["accum"]))
    if opts.get("clip"):
        cbs.append(GradClip(opts["clip"]))
    if opts.get("precision"):
        cbs.append(MixedPrecision(opts["precision"]))
    if opts.get("checkpoint"):
        cbs.append(Checkpoint(opts["checkpoint"], every_n_steps=5, keep_last=2))
    if opts.get("kill_at"):
        cbs.append(KillAt(opts["kill_at"]))
    with strategy.init_context() if strategy is not None else contextlib.nullcontext():
        model = make_model()  # with cpu_ram_efficient_loading, only rank 0 holds real weights here
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=torch.optim.AdamW, lr=1e-2, cbs=cbs)
    learn.remove_cb(learn.progress)
    return learn


def _kind(op) -> str:
    return "reduce_scatter" if "reduce_scatter" in str(op) else "all_reduce"


class CountComms:
    """Per training micro-step, the reduce collectives issued, by kind ("all_reduce", "reduce_scatter"), and
    the buckets DDP averaged through shared memory ("shared_memory_all_reduce": no collective is issued)."""

    def __init__(self):
        from torch.distributed.tensor.debug import CommDebugMode

        self.mode, self.per_batch, self.shared = CommDebugMode, [], 0

    def wrap(self, learn):
        original, average = learn.one_batch, SharedMemoryAllReduce.average_

        def counted_average(state, flat):
            self.shared += 1
            return average(state, flat)
        SharedMemoryAllReduce.average_ = counted_average

        def one_batch(i, batch):
            self.shared = 0
            with self.mode() as mode:
                original(i, batch)
            if learn.training:
                counts = {_kind(k): v for k, v in mode.get_comm_counts().items() if "reduce" in str(k)}
                self.per_batch.append(counts | ({"shared_memory_all_reduce": self.shared} if self.shared else {}))
        learn.one_batch = one_batch


def main():
    out, strategy = Path(sys.argv[1]), sys.argv[2]
    strategy = None if strategy == "launcher" else strategy  # "launcher": the one `cadence launch` chose
    opts = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    if opts.get("engine_instance"):  # built first, so the model can be built in its init_context()
        strategy = get_strategy(strategy, **opts.pop("strategy_kwargs", {}))
    learn = learner(opts, strategy if isinstance(strategy, Strategy) else None)
    if rank() == 1 and opts.get("engine_instance"):
        print("RANK1_META", next(learn.model.parameters()).is_meta)
    counter = CountComms() if opts.get("count_comms") else None
    if opts.get("first_context_epochs"):
        with learn.distrib_ctx(strategy=strategy, **opts.get("strategy_kwargs", {})):
            learn.fit(opts["first_context_epochs"])
    with learn.distrib_ctx(strategy=strategy, **opts.get("strategy_kwargs", {})):
        if counter:
            counter.wrap(learn)
        if opts.get("load_ckpt"):
            learn.strategy.load_checkpoint(Path(opts["load_ckpt"]), learn.model, learn.opt)
        if opts.get("epochs", 2):
            learn.fit(opts.get("epochs", 2), resume="latest" if opts.get("resume") else None)
        if opts.get("save_ckpt"):
            learn.strategy.save_checkpoint(Path(opts["save_ckpt"]), learn.model, learn.opt)
        learn.save_model(out)
        valid = learn.validate()
        engine = {"name": learn.strategy.name, "sharding": getattr(learn.strategy, "sharding", None),
                  "groups": sum(type(m).__name__.startswith("FSDP") for m in learn.model.modules()),
                  "precision": learn.strategy.precision.name}
        opt_state = learn.strategy.optimizer_state_dict(learn.model, learn.opt)
    if rank() == 0 and opt_state["state"]:  # the first parameter's Adam moment, by name or id: the same either way
        first = next(iter(opt_state["state"].values()))
        torch.save(first["exp_avg"], out / "exp_avg.pt")
    result = {"valid_loss": valid["valid_loss"], "world": int(os.environ.get("WORLD_SIZE", 1)),
              "comms": counter.per_batch if counter else None, "model_type": type(learn.model).__name__,
              "grad_norm": getattr(learn, "grad_norm", None), "engine": engine}
    if rank() == 0:
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
