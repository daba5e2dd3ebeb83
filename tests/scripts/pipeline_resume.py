"""Launched by tests/distributed/test_pipeline.py: the nn.Sequential of pipeline.py trained with shuffling, AdamW and
a Checkpoint every 2 steps under `model_parallel` with pp_size=2 (Interleaved1F1B: two stages per rank, cut by
pipeline.py's `split` function, whose stages name the layers their own way), resume="auto".

  pipeline_resume.py --ckpt DIR --out FILE [--pp PP] [--kill-at STEP] [--epochs N]
--pp 1: the same model without a pipeline (FSDP2 over all processes, model_parallel with tp_size=1).
`WEIGHTS <step> <checksum>` lines: the full weights when the fit starts and after each epoch.
--kill-at: SIGKILL every rank right after optimizer step STEP (after that step's checkpoint).
The final weights (the plain module after the context) go to FILE (torch.save) from rank 0; `STEPS <n>` is printed.
On one process (no launcher) the same script trains the plain model and resumes any checkpoint of it.
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import DataLoaders, Learner
from cadence.callbacks.checkpoint import Checkpoint
from cadence.distributed.env import rank
from model_parallel_resume import KillAt, PrintWeights
from pipeline import BS, N_TRAIN, data, make_model, split


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--pp", type=int, default=2)
    args = p.parse_args()
    x, y = data(N_TRAIN, 1)
    xv, yv = data(8, 2)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=BS, shuffle=True),
                      DataLoader(TensorDataset(xv, yv), batch_size=BS), device="cpu")
    cbs = [Checkpoint(args.ckpt, every_n_steps=2, keep_last=2), PrintWeights()] + ([KillAt(args.kill_at)] if args.kill_at else [])
    learn = Learner(dls, make_model(), loss_func=nn.functional.cross_entropy, opt_func=torch.optim.AdamW, lr=1e-2,
                    cbs=cbs)
    pipeline = dict(pp_schedule="Interleaved1F1B", pp_microbatches=4, split=split) if args.pp > 1 else {}
    with learn.distrib_ctx(strategy="model_parallel", pp_size=args.pp, tp_size=1, **pipeline):
        learn.fit(args.epochs, resume="auto")
    model = learn.model
    assert model[2].weight is model[0].weight, "the tie must hold after the context"
    if rank() == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out)
        print(f"STEPS {learn.step}", flush=True)


if __name__ == "__main__":
    main()
