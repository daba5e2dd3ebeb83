"""Launched on 4 processes by tests/distributed/test_model_parallel_2d.py: `model_parallel_2d.py OUT`.

The Learner under 2-D parallelism (`distrib_ctx(strategy="model_parallel", tp_size=2)`: 2 tp x 2 FSDP2 dp groups),
three fits one after the other in the same processes, each against a hand-written one-process loop over the same
global batches. Rank 0 prints `CHECK <name> ok` per passed check:
- files: GradClip, Checkpoint, TensorBoard and CSV trackers, progress lines, `save_model`. Batches are identical
  within a tp group and differ across dp groups; metrics over the validation set (13 samples, the last dp group's
  shard padded) equal the reference's, a sample count included (the SumMetric path and the gathered AccumMetric
  path); no file is written by two processes (every process records the files it opens for writing or renames
  into place); TensorBoard's events read back and the CSV hold each epoch once, with the Recorder's values; the
  export equals the reference's weights.
- accum: GradAccum(2) with GradClip equals the reference's accumulated, clipped steps; EarlyStopping stops every
  rank after the same epoch.
- bf16: `learn.to_bf16()` with GradClip trains like the fp32 reference within bf16's rounding.
Each process prints `WROTE <rank> <path>` for each file it wrote.
"""

import builtins
import io
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import AccumMetric, Callback, DataLoaders, EarlyStopping, GradAccum, GradClip, Learner, accuracy
from cadence.callbacks import Checkpoint
from cadence.callbacks.tracking import Tracker
from cadence.distributed.env import rank, world_size
from cadence.trainer.metrics import SumMetric

from model_parallel import data, lm_loss   # the same tokens and loss (VOCAB, SEQ as there)

VOCAB, DIM, SEQ, N_TRAIN, N_VALID, BS, LR, CLIP, TP = 16, 8, 6, 32, 13, 4, 0.5, 0.3, 2
WRITES: set[str] = set()


def record_writes(out: Path) -> None:
    """Note every file under `out` this process opens for writing or moves into place."""
    root = str(out.resolve())

    def note(path) -> None:
        path = os.path.abspath(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else None
        if path and path.startswith(root):
            WRITES.add(os.path.relpath(path, root))

    def opener(plain):
        def open_(file, mode="r", *args, **kwargs):
            if any(c in mode for c in "wax+"):
                note(file)
            return plain(file, mode, *args, **kwargs)
        return open_

    def mover(plain):
        def move(src, dst, *args, **kwargs):
            note(dst)
            return plain(src, dst, *args, **kwargs)
        return move

    builtins.open = io.open = opener(builtins.open)
    os.replace, os.rename = mover(os.replace), mover(os.rename)


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        return self.head(x + self.fc2(torch.relu(self.fc1(self.norm(x)))))


def parallelize(model, tp_mesh):
    """The MLP column- then row-wise, the output layer column-wise (logits made whole); the norm stays plain."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel(),
                                        "head": ColwiseParallel(output_layouts=Replicate())})


def make_model():
    torch.manual_seed(0)
    return TinyLM()


def reference(x, y, xv, yv, dp, epochs, accum=1):
    """Plain torch in one process: step k on the k-th batch of every dp group's share; `accum` batches per step."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    share, metrics = len(x) // dp, []
    for _ in range(epochs):
        for k in range(share // BS):
            idx = torch.cat([torch.arange(g * share + k * BS, g * share + (k + 1) * BS) for g in range(dp)])
            (lm_loss(model(x[idx]), y[idx]) / accum).backward()
            if (k + 1) % accum == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                opt.zero_grad()
        with torch.no_grad():
            logits = model(xv)
        metrics.append({"valid_loss": float(lm_loss(logits, yv)),
                        "accuracy": float((logits.argmax(-1) == yv).float().mean()), "seen": float(len(yv))})
    return model, metrics


class Record(Callback):
    def before_fit(self):
        self.firsts = []

    def after_batch(self):
        if self.training:
            self.firsts.append(self.learn.xb[0][0].tolist())


def ok(name):
    if rank() == 0:
        print(f"CHECK {name} ok", flush=True)


def learner(cbs, metrics=()):
    x, y = data(N_TRAIN, 1)
    xv, yv = data(N_VALID, 2)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=BS), DataLoader(TensorDataset(xv, yv), batch_size=BS),
                      device="cpu")
    return Learner(dls, make_model(), loss_func=lm_loss, opt_func=torch.optim.SGD, lr=LR, metrics=list(metrics),
                   cbs=cbs), (x, y, xv, yv)


def close(a, b, rtol=1e-4, atol=1e-5, what=""):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                               rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def check_files(out: Path):
    seen = SumMetric("seen", lambda p, t: torch.tensor([float(len(t))]), lambda s: s[0])
    gathered = AccumMetric(lambda p, t: float(len(t)), name="gathered")
    record = Record()
    tracker = Tracker(["tensorboard", "csv"], project="p", run_name="r", dir=out / "runs")
    learn, (x, y, xv, yv) = learner([record, GradClip(CLIP), tracker, Checkpoint(dir=out / "ckpt")],
                                    [accuracy, seen, gathered])
    with learn.distrib_ctx(strategy="model_parallel", tp_size=TP, parallelize=parallelize):
        dp = world_size() // TP
        learn.fit(2)
        learn.save_model(out / "export")
        firsts, everyone = [None] * world_size(), [None] * world_size()
        dist.all_gather_object(firsts, record.firsts)
        dist.all_gather_object(everyone, sorted(WRITES))
    ref_model, ref_metrics = reference(x, y, xv, yv, dp, 2)

    for r in range(world_size()):
        assert firsts[r] == firsts[(r // TP) * TP], f"rank {r} saw other batches than its tp group"
    assert firsts[0] != firsts[TP], "dp groups saw the same batches"
    ok("files:batches_per_group")

    values = learn.recorder.values
    assert len(values) == 2, values
    for row, ref in zip(values, ref_metrics):
        assert row["seen"] == N_VALID and row["gathered"] == N_VALID, row   # every sample once: not 2x, no padding
        for k in ("valid_loss", "accuracy"):
            close(row[k], ref[k], what=k)
    ok("files:metrics_exact")

    writers: dict[str, list[int]] = {}
    for r, paths in enumerate(everyone):
        for p in paths:
            writers.setdefault(p, []).append(r)
    twice = {p: rs for p, rs in writers.items() if len(rs) > 1}
    assert not twice, f"written by several processes: {twice}"
    for path, rs in writers.items():   # a rank's own shard and RNG state by that rank, everything else by rank 0
        own = re.search(r"rng-rank(\d+)\.pt(?:\.tmp\d+@[^/]*)?$|__(\d+)_0\.distcp$", path)  # (via a temporary name)
        assert rs == [int(own.group(1) or own.group(2)) if own else 0], (path, rs)
    assert {r for r in range(world_size()) for p in writers if p.endswith(f"__{r}_0.distcp")} == set(range(world_size()))
    assert any(p.startswith("export") for p in writers) and any(p.endswith("metrics.csv") for p in writers)
    ok("files:one_writer_each")

    if rank() == 0:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        run_dir = out / "runs" / "p" / "r"
        events = list(run_dir.rglob("events.out.tfevents.*"))
        assert len(events) == 1, events
        acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
        acc.Reload()
        assert len(acc.Scalars("train/loss")) == learn.step == 8, (len(acc.Scalars("train/loss")), learn.step)
        logged = [e.value for e in acc.Scalars("valid/loss")]
        assert len(logged) == 2, logged
        close(logged, [v["valid_loss"] for v in values], rtol=1e-6, what="tensorboard valid_loss")
        import csv
        with open(run_dir / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
        assert [int(r["step"]) for r in rows if r["train/loss"]] == list(range(1, learn.step + 1)), rows   # once each
        assert len(rows) == learn.step + 2, rows                                                      # + 2 epoch rows
        close([float(r["valid/loss"]) for r in rows if r["valid/loss"]], [v["valid_loss"] for v in values], rtol=1e-6, what="csv")
    ok("files:trackers_read_back")

    if rank() == 0:
        from safetensors.torch import load_file

        saved = load_file(out / "export" / "model.safetensors")
        for k, v in ref_model.state_dict().items():
            close(saved[k], v, what=k)
    ok("files:export_equals_reference")


def check_accum_and_early_stop():
    stop = EarlyStopping(min_delta=1e9, patience=1)   # no improvement is ever enough: stops after the second epoch
    learn, (x, y, xv, yv) = learner([GradAccum(steps=2), GradClip(CLIP), stop])
    with learn.distrib_ctx(strategy="model_parallel", tp_size=TP, parallelize=parallelize):
        learn.fit(5)
        epochs = [None] * world_size()
        dist.all_gather_object(epochs, len(learn.recorder.values))
    assert epochs == [2] * world_size(), epochs
    ok("accum:early_stopping_agreed")
    ref_model, ref_metrics = reference(x, y, xv, yv, world_size() // TP, 2, accum=2)
    for (name, a), b in zip(ref_model.named_parameters(), learn.model.parameters()):
        close(b.detach(), a.detach(), what=name)
    close(learn.recorder.values[-1]["valid_loss"], ref_metrics[-1]["valid_loss"], what="valid_loss")
    ok("accum:weights_equal_reference")


def check_bf16():
    learn, (x, y, xv, yv) = learner([GradClip(CLIP)])
    learn.to_bf16()
    with learn.distrib_ctx(strategy="model_parallel", tp_size=TP, parallelize=parallelize):
        learn.fit(2)
    ref_model, ref_metrics = reference(x, y, xv, yv, world_size() // TP, 2)
    for (name, a), b in zip(ref_model.named_parameters(), learn.model.parameters()):
        assert b.dtype == torch.float32, f"{name} came back as {b.dtype}"
        close(b.detach(), a.detach(), rtol=0.15, atol=0.05, what=name)
    close(learn.recorder.values[-1]["valid_loss"], ref_metrics[-1]["valid_loss"], rtol=0.05, atol=0.05)
    ok("bf16:trains_like_fp32")


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    record_writes(out)
    check_files(out)
    for path in sorted(WRITES):
        print(f"WROTE {rank()} {path}", flush=True)
    check_accum_and_early_stop()
    check_bf16()


if __name__ == "__main__":
    main()
