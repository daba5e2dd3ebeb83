"""A DeepSpeed ZeRO checkpoint written by 2 processes, resumed mid-epoch on another number of processes.

Launched by tests/distributed/test_deepspeed.py:
  deepspeed_universal.py CKPT_ROOT OUT_DIR STAGES [--resume]
STAGES: comma-separated ZeRO stages, each with its checkpoints under CKPT_ROOT/zero<stage>. One epoch (6 steps
on 2 processes) of resume.py's run without dropout, with a hidden width of 33 (an odd-sized largest layer).
Without --resume: Checkpoint(every_n_steps=3); rank 0 writes the full weights and optimizer state at step 3 to
OUT_DIR/zero<stage>-step3.pt. With --resume: `fit(1, resume=<step 3's checkpoint>)`, and rank 0 prints
`ZERO<stage> LOADED <weights equal> <optimizer equal> <group settings equal>` (to step 3's, bitwise) before
training. Two parameter groups with their own weight decay.
Both write OUT_DIR/zero<stage>-<world size>.safetensors (the final weights) and print `ZERO<stage> STEPS <step>`.
"""

from pathlib import Path

import torch
from torch import nn

from cadence import Callback, Checkpoint, Learner, Order
from cadence.distributed.env import is_main_process, world_size
from deepspeed_resume import fit_and_export, run_stages
from resume import data_and_model


def full_state(learn):
    """Weights and optimizer state, gathered (every rank calls it)."""
    return {"weights": learn.strategy.model_state_dict(learn.model),
            "optimizer": learn.strategy.optimizer_state_dict(learn.model, learn.opt)["state"],
            "groups": [[group["lr"], group["weight_decay"]] for group in learn.opt.param_groups]}


def adamw_with_decay_per_group(groups, lr):
    """Two parameter groups (the splitter's) that differ in weight decay: each must resume with its own."""
    return torch.optim.AdamW([{**group, "weight_decay": wd} for group, wd in zip(groups, (0.5, 0.0))], lr=lr)


class SaveAtStep3(Callback):
    order = Order.CHECKPOINT + 10  # after step 3's checkpoint

    def __init__(self, path):
        self.path = path

    def after_batch(self):
        if self.training and self.learn.step == 3:
            state = full_state(self.learn)
            if is_main_process():
                torch.save(state, self.path)


class CompareLoaded(Callback):
    def __init__(self, path, stage):
        self.path, self.stage = path, stage

    def before_fit(self):  # the resumed checkpoint is loaded by now
        state, saved = full_state(self.learn), torch.load(self.path)
        if is_main_process():
            weights = all(torch.equal(state["weights"][k], saved["weights"][k]) for k in saved["weights"])
            moments = (state["optimizer"].keys() == saved["optimizer"].keys() and all(
                entry.keys() == saved["optimizer"][i].keys() and all(torch.equal(torch.as_tensor(v), torch.as_tensor(
                    saved["optimizer"][i][k])) for k, v in entry.items()) for i, entry in state["optimizer"].items()))
            print(f"ZERO{self.stage} LOADED {weights} {moments} {state['groups'] == saved['groups']}", flush=True)


def train(stage, args):
    dls, model = data_and_model(hidden=33, dropout=0.0)
    ckpt, reference = Path(args.ckpt) / f"zero{stage}", Path(args.out) / f"zero{stage}-step3.pt"
    cbs = [Checkpoint(ckpt, every_n_steps=3, every_epoch=False), CompareLoaded(reference, stage) if args.resume else SaveAtStep3(reference)]
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=adamw_with_decay_per_group, lr=1e-2, cbs=cbs,
                    splitter=lambda m: [m[0].parameters(), m[3].parameters()])
    fit = lambda learn: learn.fit(1, resume=str(ckpt / "step-00000003") if args.resume else None)
    fit_and_export(learn, stage, fit, Path(args.out) / f"zero{stage}-{world_size()}.safetensors")


if __name__ == "__main__":
    run_stages(train)
