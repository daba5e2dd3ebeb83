"""Train with DeepSpeed (shuffling, dropout, GradAccum(2), AdamW, one-cycle), checkpointing; optionally die or resume.

Launched on 2 processes by tests/distributed/test_deepspeed.py:
  deepspeed_resume.py CKPT_ROOT OUT_DIR STAGES [--kill-at STEP] [--resume]
STAGES: comma-separated ZeRO stages, trained one after the other (each with its own checkpoints under
CKPT_ROOT/zero<stage>). --kill-at: SIGKILL every rank right after optimizer step STEP (after its
checkpoint), mid-epoch. Rank 0 writes OUT_DIR/zero<stage>.safetensors (the final fp32 weights). With --resume,
every rank prints `ZERO<stage> LOAD COLLECTIVES <n>`: the collectives its resume made, and `ZERO<stage> IN PLACE
[<files>, <tensors>]`: the optimizer-states files and optimizer state tensors read straight into the engine's own
(counted over the stages run so far).
"""

import argparse
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from cadence import Checkpoint, GradAccum, Learner
from cadence.distributed.env import is_main_process, setup_distrib
from async_checkpoint import count_collectives, count_in_place  # tests/scripts/async_checkpoint.py
from resume import KillAt, data_and_model  # tests/scripts/resume.py: its run, and SIGKILL after a step's checkpoint

COLLECTIVES = count_collectives()  # the torch.distributed calls of the Checkpoint callback's load_state
IN_PLACE = count_in_place()  # ZeRO-3: [files, optimizer state tensors] its resume read into the engine's tensors


def train(stage, args):
    dls, model = data_and_model()
    cbs = [GradAccum(steps=2), Checkpoint(Path(args.ckpt) / f"zero{stage}", every_n_steps=2)]
    if args.kill_at:
        cbs.append(KillAt(args.kill_at))
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=torch.optim.AdamW, cbs=cbs)
    fit = lambda learn: learn.fit_one_cycle(2, lr_max=1e-2, resume="latest" if args.resume else None)
    reads, load = Counter(), torch.load

    def counted(f, *a, **kw):  # every file of the engine's checkpoint read once (DeepSpeed's loader read its
        if "deepspeed" in str(f):  # model-states file twice)
            reads[str(f)] += 1
        return load(f, *a, **kw)
    torch.load = counted
    collectives = COLLECTIVES
    collectives["load"] = 0
    try:
        fit_and_export(learn, stage, fit, Path(args.out) / f"zero{stage}.safetensors")
    finally:
        torch.load = load
    if args.resume:
        print(f"ZERO{stage} ENGINE FILES READ {sorted(set(reads.values()))}", flush=True)
        print(f"ZERO{stage} LOAD COLLECTIVES {collectives['load']}", flush=True)
        print(f"ZERO{stage} IN PLACE {IN_PLACE}", flush=True)


def fit_and_export(learn, stage, fit, path):
    """`fit(learn)` under DeepSpeed ZeRO-`stage`; rank 0 writes the final fp32 weights to `path` and prints the steps."""
    learn.remove_cb(learn.progress)
    with learn.distrib_ctx(strategy="deepspeed", zero_stage=stage):
        fit(learn)
        weights = learn.strategy.model_state_dict(learn.model)
    if is_main_process():
        save_file({k: v.contiguous() for k, v in weights.items()}, path)
        print(f"ZERO{stage} STEPS {learn.step}", flush=True)


def run_stages(train, **options):
    """`SCRIPT CKPT_ROOT OUT_DIR STAGES [--resume] [--<option> INT]`: `train(stage, args)` per stage, one process group."""
    p = argparse.ArgumentParser()
    for name in ("ckpt", "out", "stages"):
        p.add_argument(name)
    p.add_argument("--resume", action="store_true")
    for name, kind in options.items():
        p.add_argument(name, type=kind)
    args = p.parse_args()
    setup_distrib()
    for stage in map(int, args.stages.split(",")):
        train(stage, args)


if __name__ == "__main__":
    run_stages(train, **{"--kill-at": int})
