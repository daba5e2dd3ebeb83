"""Train with shuffling, dropout, GradAccum, AdamW and one-cycle; checkpoint; optionally die; resume="auto".

The same command line starts the run and continues it. Launched on 1 or 2 processes by
tests/callbacks/test_checkpoint_resume.py, tests/distributed/test_restarts.py and bench/faults.py:
  resume.py --ckpt DIR --out FILE [--kill-at STEP | --kill-in-save STEP | --kill-once-at STEP --rank R]
            [--signal-at STEP] [--step-delay S] [--keep-last N] [--kill-at-op KIND:N]
--kill-at: SIGKILL every rank right after optimizer step STEP (after any checkpoint of that step).
--kill-in-save: SIGKILL while the checkpoint of step STEP is being written.
--kill-once-at: SIGKILL rank R after step STEP, only the first time (a marker file in DIR remembers).
--signal-at: rank 0 sends itself SIGUSR1 after step STEP, only the first time (preemption of one rank).
--step-delay: sleep S seconds after every batch (time for a test to signal the launcher mid-run).
--kill-at-op: SIGKILL just before the N-th filesystem operation of KIND (rename, replace, unlink, rmdir,
  save: torch.save, any) made while a checkpoint is saved or pruned.
The final weights go to FILE (safetensors) from rank 0; `STEPS <step>` is printed at the end.
A CSV and a TensorBoard tracker log under CKPT/runs/resume/run.
"""

import argparse
import os
import signal
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import Callback, DataLoaders, Learner, Order, accuracy
from cadence.callbacks.accumulate import GradAccum
from cadence.callbacks.checkpoint import Checkpoint
from cadence.callbacks.tracking import Tracker
from cadence.distributed.env import is_main_process, rank
from fs_kill import kill_at_filesystem_op


class KillAt(Callback):
    order = Order.CHECKPOINT + 10  # after the checkpoint of this step was written

    def __init__(self, step):
        self.at = step

    def after_batch(self):
        if self.training and self.learn.step == self.at and self.learn.iter % 2 == 1:
            os.kill(os.getpid(), signal.SIGKILL)


class SignalOnce(Callback):
    """After optimizer step `at`, on rank `who`: send `sig` to this process, once per directory `marker`."""
    order = Order.CHECKPOINT + 10

    def __init__(self, step, who, sig, marker):
        self.at, self.who, self.sig, self.marker = step, who, sig, Path(marker)

    def after_batch(self):
        if self.training and self.learn.step == self.at and rank() == self.who and not self.marker.exists():
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            self.marker.write_text("sent")
            os.kill(os.getpid(), self.sig)


class Sleep(Callback):
    def __init__(self, seconds):
        self.seconds = seconds

    def after_batch(self):
        time.sleep(self.seconds)


class KillInSave(Callback):
    """Its state is saved with every checkpoint; at step `at` it dies while the checkpoint is half written."""

    def __init__(self, step):
        self.at = step

    def state_dict(self):
        if self.learn.step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        return {}

    def load_state_dict(self, state):
        pass


def data_and_model(hidden: int = 32, dropout: float = 0.3, classes: int = 3, device: str | None = "cpu"):
    """What every resume script trains: 96 samples (6 features, `classes` classes, shuffled, batches of 8), an MLP,
    seeded; batches go to `device` (None: cadence's default, a GPU where there is one)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 6, generator=g)
    y = (x @ torch.randn(6, classes, generator=g)).argmax(1)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True),
                      DataLoader(TensorDataset(x[:40], y[:40]), batch_size=8), device=device)
    return dls, nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, classes))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--kill-in-save", type=int)
    p.add_argument("--kill-once-at", type=int)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--signal-at", type=int)
    p.add_argument("--step-delay", type=float)
    p.add_argument("--keep-last", type=int)
    p.add_argument("--kill-at-op")
    args = p.parse_args()
    fs_ops = kill_at_filesystem_op(args.kill_at_op, Checkpoint, "_save") if args.kill_at_op else None

    dls, model = data_and_model()
    cbs = [GradAccum(steps=2), Checkpoint(args.ckpt, every_n_steps=4, keep_last=args.keep_last),
           Tracker(["csv", "tensorboard"], project="resume", run_name="run", dir=os.path.join(args.ckpt, "runs"))]
    if args.kill_at:
        cbs.append(KillAt(args.kill_at))
    if args.kill_in_save:
        cbs.append(KillInSave(args.kill_in_save))
    if args.kill_once_at:
        cbs.append(SignalOnce(args.kill_once_at, args.rank, signal.SIGKILL, os.path.join(args.ckpt, "killed-once")))
    if args.step_delay:
        cbs.append(Sleep(args.step_delay))
    if args.signal_at:
        cbs.append(SignalOnce(args.signal_at, 0, signal.SIGUSR1, os.path.join(args.ckpt, "signalled-once")))
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=accuracy, cbs=cbs)
    with learn.distrib_ctx():
        learn.fit_one_cycle(3, lr_max=1e-2, resume="auto")
    if is_main_process():
        save_file({k: v.contiguous() for k, v in learn.model.state_dict().items()}, args.out)
        print(f"STEPS {learn.step}", flush=True)
        print(f"TRAIN_LOSS {[row['train_loss'] for row in learn.recorder.values]}", flush=True)
        if fs_ops is not None:
            print(f"FSOPS {fs_ops.get('any', 0)}", flush=True)


if __name__ == "__main__":
    main()
