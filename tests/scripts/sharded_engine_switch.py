"""Launched by tests/distributed/test_sharded_engine_switch.py: a sharded checkpoint of one engine resumed by the other.

  sharded_engine_switch.py learner --ckpt DIR --out FILE --engine fsdp|model_parallel [--model lm|seq] [--tp T]
                                   [--pp P] [--snapshot-at STEP]... [--stop-at STEP]
  sharded_engine_switch.py accelerator OUT save|load

learner: one epoch of `fit(1, lr)` with AdamW of a tiny model, a Checkpoint every 2 steps in DIR, `resume="auto"`,
under `distrib_ctx(strategy=ENGINE)`: `fsdp` (FSDP2 over every process) or `model_parallel` (`lm`: model_parallel.py's
tied language model sliced over `--tp`; `seq`: pipeline.py's nn.Sequential cut into `--pp` stages before child 4,
1F1B). `--stop-at`: the fit stops after that optimizer step, its checkpoint written. Rank 0 saves `snapshot()` (full
weights, full optimizer state, step) to FILE.start when a resumed fit starts (what was loaded) and to FILE.N after step
N of `--snapshot-at` and `--stop-at` (its checkpoint written), and the trained weights to FILE. Run without the
launcher, it trains the plain model on the global batches of one dp group (the test's reference); `learner_for()`
builds its Learner for the test.

accelerator: an Accelerate-style loop on model_parallel_2d.py's language model with AdamW and a StepLR. `save`:
`ParallelismConfig(tp_size=2)`, 2 steps, `save_state(OUT/ckpt)`, `snapshot()` (its step the scheduler's, with its lr)
to OUT/saved.pt, 2 more steps, weights to OUT/unswitched.pt. `load`: `ParallelismConfig(tp_size=1, dp_shard_size=2)`
(plain FSDP2), `load_state(OUT/ckpt)`, snapshot to OUT/loaded.pt, the same 2 more steps, weights to OUT/switched.pt.
"""

import argparse
import copy

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import CancelFitException, Callback, DataLoaders, Learner, Order
from cadence.callbacks.checkpoint import Checkpoint
from cadence.distributed.env import rank

import model_parallel
import pipeline

N_TRAIN, BS, LR = 32, 4, 1e-2


def snapshot(strategy, model, opt, step):
    """The full weights and optimizer state (every rank: gathers), on rank 0; copied (a tensor that is not sharded
    comes as the live one)."""
    weights, optimizer = strategy.model_state_dict(model), strategy.optimizer_state_dict(model, opt)
    return copy.deepcopy({"model": weights, "optimizer": optimizer, "step": step})


class Report(Callback):
    """snapshot() to `out`.start when a resumed fit starts, to `out`.N after each step N of `at` and `stop_at`, and the
    fit stopped after step `stop_at`."""
    order = Order.CHECKPOINT + 10

    def __init__(self, out, at=(), stop_at=None):
        self.out, self.at, self.stop_at = out, set(at), stop_at

    def save(self, suffix):
        state = snapshot(self.learn.strategy, self.learn.model, self.learn.opt, self.learn.step)
        if rank() == 0:
            torch.save(state, f"{self.out}.{suffix}")

    def before_fit(self):
        if self.learn.step:   # resumed (a snapshot of a fresh optimizer would make torch initialise its state)
            self.save("start")

    def after_batch(self):
        if self.training and self.learn.step in self.at | {self.stop_at}:
            self.save(self.learn.step)
        if self.training and self.learn.step == self.stop_at:
            raise CancelFitException()


def learner_for(args):
    """The Learner of `args` (`--model`, `--ckpt`, `--out`, `--snapshot-at`, `--stop-at`), outside any distrib_ctx."""
    if args.model == "lm":
        (x, y), net, loss = model_parallel.data(N_TRAIN, 1), model_parallel.make_model(), model_parallel.lm_loss
    else:
        (x, y), net, loss = pipeline.data(N_TRAIN, 1), pipeline.make_model(), nn.functional.cross_entropy
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=BS, shuffle=True),
                      DataLoader(TensorDataset(x[:8], y[:8]), batch_size=BS), device="cpu")
    learn = Learner(dls, net, loss_func=loss, opt_func=torch.optim.AdamW,
                    cbs=[Checkpoint(args.ckpt, every_n_steps=2), Report(args.out, args.snapshot_at, args.stop_at)])
    learn.remove_cb(learn.progress)
    return learn


def learner_run(args):
    learn = learner_for(args)
    mesh = {}
    if args.engine == "model_parallel" and args.pp > 1:
        mesh = dict(tp_size=1, pp_size=args.pp, pp_schedule="1F1B", pp_split_points=["4"])
    elif args.engine == "model_parallel":
        mesh = dict(tp_size=args.tp, parallelize=model_parallel.parallelize)
    with learn.distrib_ctx(strategy=args.engine, **mesh):
        learn.fit(1, LR, resume="auto")
    if rank() == 0:
        torch.save({k: v.detach().clone() for k, v in learn.model.state_dict().items()}, args.out)


def accelerator_run(out, mode):
    from cadence import Accelerator
    from cadence.utils import ParallelismConfig

    from model_parallel_2d import TinyLM, parallelize

    sizes = dict(tp_size=2, parallelize=parallelize) if mode == "save" else dict(tp_size=1, dp_shard_size=2)
    accelerator = Accelerator(parallelism_config=ParallelismConfig(**sizes))
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt, sched = accelerator.prepare(model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7))
    x, y = model_parallel.data(8, 1)

    def steps(n):
        for _ in range(n):
            accelerator.backward(model_parallel.lm_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()

    if mode == "save":
        steps(2)
        accelerator.save_state(f"{out}/ckpt")
    else:
        accelerator.load_state(f"{out}/ckpt")
    state = {**snapshot(accelerator.strategy, model, opt.optimizer, sched.state_dict()["last_epoch"]),
             "lr": sched.get_last_lr()}
    steps(2)
    weights = accelerator.get_state_dict(model)   # every process: a gather
    if accelerator.is_main_process:
        torch.save(state, f"{out}/{'saved' if mode == 'save' else 'loaded'}.pt")
        torch.save(weights, f"{out}/{'unswitched' if mode == 'save' else 'switched'}.pt")
    accelerator.end_training()


def parse(argv=None):
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="api", required=True)
    learner = sub.add_parser("learner")
    learner.add_argument("--ckpt", required=True)
    learner.add_argument("--out", required=True)
    learner.add_argument("--engine", choices=("fsdp", "model_parallel"), required=True)
    learner.add_argument("--model", choices=("lm", "seq"), default="lm")
    learner.add_argument("--tp", type=int, default=1)
    learner.add_argument("--pp", type=int, default=1)
    learner.add_argument("--snapshot-at", type=int, action="append", default=[])
    learner.add_argument("--stop-at", type=int)
    accelerator = sub.add_parser("accelerator")
    accelerator.add_argument("out")
    accelerator.add_argument("mode", choices=("save", "load"))
    return p.parse_args(argv)


def main():
    args = parse()
    if args.api == "learner":
        learner_run(args)
    else:
        accelerator_run(args.out, args.mode)


if __name__ == "__main__":
    main()
