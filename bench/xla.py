"""The Learner with strategy="xla" against a hand-written torch_xla loop, on the same XLA device.

Run in the XLA environment (`make bench-xla`, or `PJRT_DEVICE=CPU PYTHONPATH=. <xla venv>/bin/python bench/xla.py`).
Both train the same MLP with AdamW on the same batches, a `torch_xla.sync()` per step. After one
warm-up epoch each (the Learner's first, timed: its first step compiles the graph), epochs of the two
alternate (interleaved, so load changes on the machine hit both; which goes first rotates) and the
median step time of each is printed with their ratio (Learner / hand-written; the target is <= 1.05), over
the whole epoch (the fit's start and end included) and from the second step on, with the graphs each
compiled, and what an epoch of each ran on the device (graph executions, transfers, buffers returned:
figures that load on the machine does not change). The strategy traces the backward on the calling thread
(autograd otherwise hands it to a worker thread of its own); the same loop written by hand that way is timed
too, as a second reference.
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


def hand_epoch(model: nn.Module, opt: torch.optim.Optimizer, dl: DataLoader, threaded: bool = True
               ) -> tuple[float, float]:
    """One epoch of the plain torch_xla loop: seconds per step over the whole epoch, and from the second step on.
    `threaded=False`: backward on the calling thread, as the XLA strategy runs it."""
    with torch.autograd.set_multithreading_enabled(threaded):
        return _hand_epoch(model, opt, dl)


def _hand_epoch(model: nn.Module, opt: torch.optim.Optimizer, dl: DataLoader) -> tuple[float, float]:
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
        model1 = make_model(a.width).to(device)
        opt1 = torch.optim.AdamW(model1.parameters(), lr=1e-3)
        hand_epoch(model1, opt1, dl, threaded=False)

        # rotate which goes first: XLA keeps small constants it uploaded (AdamW's bias corrections, new values
        # every step) in a cache, so a loop that runs a step count after another finds them there
        runs = {"learner": lambda: learner_epoch(learn, clock), "hand-written": lambda: hand_epoch(model, opt, dl),
                "hand-written, backward on its thread": lambda: hand_epoch(model1, opt1, dl, threaded=False)}
        times, work = {name: [] for name in runs}, {name: [] for name in runs}
        for r in range(a.rounds):
            names = list(runs)
            for name in names[r % 3:] + names[:r % 3]:
                before = XLA.counts()  # outside the timed epoch (which ends waiting for the device)
                times[name].append(runs[name]())
                after = XLA.counts()
                work[name].append({k: after[k] - before[k] for k in after})
    ours, theirs = times["learner"], times["hand-written"]
    (o, t), (o2, t2) = ((statistics.median(x[k] for x in ours), statistics.median(x[k] for x in theirs)) for k in (0, 1))
    print(f"XLA CPU device, MLP width {a.width}, AdamW, batch {a.bs}, {len(dl)} steps/epoch, {a.rounds} rounds interleaved")
    print(f"  learner warm-up epoch {first_epoch:.2f} s: {learner_compiles} graphs compiled in {learner_compile_s:.2f} s; "
          f"hand-written loop: {hand_compiles} graphs")
    print(f"  step time over the epoch: learner {o * 1e3:.3f} ms, hand-written {t * 1e3:.3f} ms, ratio {o / t:.3f}")
    print(f"  from the second step on:  learner {o2 * 1e3:.3f} ms, hand-written {t2 * 1e3:.3f} ms, ratio {o2 / t2:.3f}")
    one = times["hand-written, backward on its thread"]
    h, h2 = statistics.median(x[0] for x in one), statistics.median(x[1] for x in one)
    print(f"  against the hand-written loop with its backward on the calling thread (what the strategy does): "
          f"{h * 1e3:.3f} ms, ratio {o / h:.3f} (from the second step on {h2 * 1e3:.3f} ms, {o2 / h2:.3f})")
    print(f"  graphs compiled during the timed rounds: {sum(w['compiles'] for ws in work.values() for w in ws)}")
    for name, ws in list(work.items())[:2]:
        mean = {k: statistics.mean(w[k] for w in ws) for k in ws[0]}
        print(f"  an epoch of the {name} loop: graph executions {mean['executions']:g}, transfers to the host "
              f"{mean['to_host']:g}, to the device {mean['to_device']:g}; buffers returned per step "
              f"{mean['outputs'] / len(dl):.2f}")

if __name__ == "__main__":
    main()
