"""The Learner with strategy="xla" against a hand-written torch_xla loop, on the same XLA device.

Run in the XLA environment (`make bench-xla`, or `PJRT_DEVICE=CPU PYTHONPATH=. <xla venv>/bin/python bench/xla.py`).
Both train the same MLP with AdamW on the same batches, a `torch_xla.sync()` per step. After one
warm-up epoch each (the Learner's first, timed: its first step compiles the graph), epochs of the two
alternate (interleaved, so load changes on the machine hit both) and the median step time of each is
printed with their ratio (Learner / hand-written; the target is <= 1.05), over the whole epoch (the fit's
start and end included) and from the second step on, with the graphs each compiled; then what one more epoch
of each ran on the device (graph executions, transfers, buffers returned), which load on the machine does not change.
"""

import argparse
import statistics
import time

import torch_xla

torch_xla.device()  # before the first backward of the process

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from cadence.distributed.xla import XLA  # noqa: E402
from cadence.trainer.callback import Callback  # noqa: E402
from cadence.trainer.data import DataLoaders  # noqa: E402
from cadence.trainer.learner import Learner  # noqa: E402


def make_model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def hand_epoch(model: nn.Module, opt: torch.optim.Optimizer, dl: DataLoader) -> tuple[float, float]:
    """One epoch of the plain torch_xla loop: seconds per step over the whole epoch, and from the second step on."""
    device = torch_xla.device()
    start = time.perf_counter()
    for i, (xb, yb) in enumerate(dl):
        if i == 1:
            xm.wait_device_ops()
            second = time.perf_counter()
        loss = F.cross_entropy(model(xb.to(device)), yb.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch_xla.sync()
    xm.wait_device_ops()
    end = time.perf_counter()
    return (end - start) / len(dl), (end - second) / (len(dl) - 1)


class Clock(Callback):
    """The same two clocks in the Learner: the fit, and from its second training batch to the end of training."""

    def before_batch(self):
        if self.learn.training and self.learn.iter == 1:
            xm.wait_device_ops()
            self.second = time.perf_counter()

    def after_train(self):
        xm.wait_device_ops()
        self.end = time.perf_counter()


def learner_epoch(learn: Learner, clock: Clock) -> tuple[float, float]:
    start = time.perf_counter()
    learn.fit(1)
    xm.wait_device_ops()
    n = len(learn.dls.train)
    return (time.perf_counter() - start) / n, (clock.end - clock.second) / (n - 1)


def used(run) -> dict[str, int]:
    """What `run()` did on the device (XLA.counts() after it, less before it)."""
    before = XLA.counts()
    run()
    after = XLA.counts()
    return {k: after[k] - before[k] for k in after}


def compile_seconds() -> float:
    """Time spent compiling graphs so far in this process (torch_xla's CompileTime metric, in ns)."""
    data = met.metric_data("CompileTime")
    return data[1] / 1e9 if data else 0.0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--bs", type=int, default=64)
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(a.samples, 128, generator=g), torch.randint(0, 10, (a.samples,), generator=g)
    dl = DataLoader(TensorDataset(x, y), batch_size=a.bs)

    clock = Clock()
    learn = Learner(DataLoaders(dl), make_model(a.width), loss_func=F.cross_entropy, opt_func=torch.optim.AdamW,
                    lr=1e-3, cbs=[clock])
    with learn.distrib_ctx(strategy="xla"):
        before, start = XLA.counts(), time.perf_counter()
        learn.fit(1)  # warm-up: the first steps compile
        first_epoch, learner_compile_s = time.perf_counter() - start, compile_seconds()
        learner_compiles = XLA.counts()["compiles"] - before["compiles"]

        device = torch_xla.device()
        model = make_model(a.width).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        before = XLA.counts()
        hand_epoch(model, opt, dl)  # warm-up
        hand_compiles = XLA.counts()["compiles"] - before["compiles"]

        warm, ours, theirs = XLA.counts(), [], []
        for _ in range(a.rounds):
            theirs.append(hand_epoch(model, opt, dl))
            ours.append(learner_epoch(learn, clock))
        steady = XLA.counts()
        device_work = {"learner": used(lambda: learner_epoch(learn, clock)), "hand-written": used(lambda: hand_epoch(model, opt, dl))}
    (o, t), (o2, t2) = ((statistics.median(x[k] for x in ours), statistics.median(x[k] for x in theirs)) for k in (0, 1))
    print(f"XLA CPU device, MLP width {a.width}, AdamW, batch {a.bs}, {len(dl)} steps/epoch, {a.rounds} rounds interleaved")
    print(f"  learner warm-up epoch {first_epoch:.2f} s: {learner_compiles} graphs compiled in {learner_compile_s:.2f} s; "
          f"hand-written loop: {hand_compiles} graphs")
    print(f"  step time over the epoch: learner {o * 1e3:.3f} ms, hand-written {t * 1e3:.3f} ms, ratio {o / t:.3f}")
    print(f"  from the second step on:  learner {o2 * 1e3:.3f} ms, hand-written {t2 * 1e3:.3f} ms, ratio {o2 / t2:.3f}")
    print(f"  graphs compiled during the timed rounds: {steady['compiles'] - warm['compiles']}")
    for name, n in device_work.items():
        print(f"  one more epoch, {name}: graph executions {n['executions']}, transfers to the host {n['to_host']}, "
              f"to the device {n['to_device']}; buffers returned per step {n['outputs'] / len(dl):.2f}")


if __name__ == "__main__":
    main()
