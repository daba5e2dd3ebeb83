"""Launched on 2 processes by tests/callbacks/test_features_ddp.py (argv[1]: "accum" or "launcher").

accum: GradAccum(steps=4) with batch 4 per rank (a partial final window included) and GradClip
equal one process stepping on the concatenated batch of both ranks; fp16 trains under DDP.
launcher (argv[2]: a shared temp dir): rank0_first works before any process group exists, and
`cadence launch --mixed_precision bf16 --gradient_accumulation_steps 2` reach distrib_ctx.
"""

import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import DataLoaders, Learner, rank0_first
from cadence.callbacks.accumulate import GradAccum
from cadence.callbacks.clip import GradClip
from cadence.callbacks.precision import MixedPrecision
from cadence.distributed.env import rank
from toy import classification

N, BS, STEPS, MAX_NORM = 72, 4, 4, 0.05   # 36 items per rank: windows of 16, 16 and 4 items


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def learner(cbs=()):
    x, y = classification(N, features=6)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=BS), device="cpu")
    learn = Learner(dls, make_model(), loss_func=nn.CrossEntropyLoss(), opt_func=torch.optim.SGD, lr=0.5, cbs=list(cbs))
    learn.remove_cb(learn.progress)
    return learn


def reference(epochs):
    """One process: each step on rank 0's window items followed by rank 1's."""
    x, y = classification(N, features=6)
    model, half = make_model(), N // 2
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    norms = []
    for _ in range(epochs):
        for start in range(0, half, BS * STEPS):
            local = torch.arange(start, min(start + BS * STEPS, half))
            idx = torch.cat([local, local + half])
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
            opt.step()
            opt.zero_grad()
    return model, norms


def check_accum():  # two distrib_ctx in a row: the second creates a new process group
    learn = learner([GradAccum(steps=STEPS), GradClip(MAX_NORM)])
    with learn.distrib_ctx():
        learn.fit(2)
    ref, ref_norms = reference(2)
    for a, b in zip(ref.parameters(), learn.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert learn.step == 2 * 3, learn.step
    assert abs(learn.grad_norm - ref_norms[-1]) < 1e-5, (learn.grad_norm, ref_norms[-1])
    assert ref_norms[-1] > MAX_NORM  # clipping was active
    print(f"CHECK rank{rank()} accum_clip_equals_big_batch ok", flush=True)

    fp16 = learner([MixedPrecision("fp16")])
    with fp16.distrib_ctx():
        fp16.fit(2)
    assert fp16.step == 2 * 9 - fp16.mixed_precision.skipped_steps
    assert fp16.recorder.values[-1]["train_loss"] < fp16.recorder.values[0]["train_loss"]
    print(f"CHECK rank{rank()} fp16_ddp ok", flush=True)


def check_rank0_first_before_any_group(tmp):
    """fastai's recipe: rank0_first (e.g. a download) before distrib_ctx, while no process group exists yet."""
    marker = os.path.join(tmp, "downloaded")

    def download():
        if rank() == 0:
            time.sleep(1.0)
            with open(marker, "w") as f:
                f.write("data")
        assert os.path.exists(marker), "rank 1 started before rank 0 finished"
        return marker

    assert rank0_first(download) == marker
    print(f"CHECK rank{rank()} rank0_first_without_group ok", flush=True)


def check_launcher(tmp):
    check_rank0_first_before_any_group(tmp)
    learn = learner()
    with learn.distrib_ctx():
        assert learn.mixed_precision.precision == "bf16"
        assert learn.grad_accum.steps == 2
        learn.fit(1)
        assert learn.step == 5, learn.step   # 9 batches per rank in windows of 2
    assert not hasattr(learn, "mixed_precision") and not hasattr(learn, "grad_accum")
    print(f"CHECK rank{rank()} launcher_settings ok", flush=True)


if __name__ == "__main__":
    {"accum": check_accum, "launcher": check_launcher}[sys.argv[1]](*sys.argv[2:])
