"""Overhead of cadence's `Learner.fit` over a hand-written PyTorch loop, and over its peers.

Run (bench/README.md says how to make the peers' venv):

    .venv/bin/python bench/overhead.py            # cadence against the raw loop: ~3 min (--quick: ~1.5 min)
    /tmp/peers/bin/python bench/overhead.py       # + fastai, accelerate, lightning, ignite: ~10 min (--quick: ~5)

What is measured, for each framework, on one CPU thread (`torch.set_num_threads(1)`):
- µs/step: one epoch of training over the same pre-built list of in-memory `(x, y)` batches,
  with the same model and `torch.optim.SGD(lr=1e-2)`, timed from the moment the list yields
  its first batch to the moment `fit` returns (construction and fit setup are excluded,
  epoch-end work is included). Each repeat runs every framework once, in a rotating order; the
  table shows the median µs/step over repeats, and as ratio the median over repeats of the
  framework's time over the raw loop's time in the same repeat (pairing cancels slow drifts
  of a shared machine).
  Sizes: tiny = Linear(32, 32), ReLU, Linear(32, 2), batch 32;
  MLP = 3 x (Linear(256, 256), ReLU), Linear(256, 10), batch 64.
- start: process start to the end of the first optimizer step (fresh process per run, tiny
  model), minus the raw loop's; median over runs. What every framework shares (Python,
  `import torch`, and the ~1.8 s torch spends importing its compiler on the first optimizer
  it builds) is done before a mark and left out of both sides: on this VM that shared ~4 s
  scatters by ±0.4 s between processes, far more than the difference being measured.
- import: `import <framework>` in a fresh process that has already imported torch; median.

Times are CPU time (`time.process_time`, all threads of the process): other jobs sharing the
cores barely move it. `--clock wall` uses elapsed time instead, for a quiet machine.
Each framework runs with its default callbacks (progress output captured, no checkpoints or
loggers written); "cadence, live bar" is cadence with its rich bar drawn as on a terminal;
"cadence accel" is the Accelerate loop below with `from cadence import Accelerator` (target: <= 1.03x).
Accelerate prepares model and optimizer (the batch list is not a DataLoader, so it passes through).

Targets: cadence at most 1.05x the raw loop (tiny) and 1.03x (MLP); start at most
+0.2 s over the raw loop; import at most +0.3 s over `import torch`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import logging
import os
import statistics
import subprocess
import sys
import time
import warnings
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

LR = 1e-2
SIZES = {"tiny": dict(n_in=32, hidden=[32], n_out=2, bs=32), "mlp": dict(n_in=256, hidden=[256] * 3, n_out=10, bs=64)}
IMPORTS = {"raw loop": "", "cadence": "cadence", "fastai": "fastai.learner, fastai.callback.progress",
           "accelerate": "accelerate", "lightning": "lightning", "ignite": "ignite.engine"}


def make_model(size: str) -> nn.Module:
    s, layers, n = SIZES[size], [], SIZES[size]["n_in"]
    for h in s["hidden"]:
        layers += [nn.Linear(n, h), nn.ReLU()]
        n = h
    return nn.Sequential(*layers, nn.Linear(n, s["n_out"]))


def make_batches(size: str, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    s, g = SIZES[size], torch.Generator().manual_seed(0)
    return [(torch.randn(s["bs"], s["n_in"], generator=g), torch.randint(0, s["n_out"], (s["bs"],), generator=g))
            for _ in range(n_batches)]


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # imports as users see them: cached


class Timed:
    """The batches, plus the clock when the first one was handed out (every framework iterates this)."""

    def __init__(self, batches, clock):
        self.batches, self.clock, self.t0 = batches, clock, None

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        self.t0 = self.clock()
        return iter(self.batches)


# ---------------------------------------------------------------- one runner per framework
# Each takes (model, data) and returns run(): one training epoch over data.

def raw_loop(model, data):
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def run():
        model.train()
        for xb, yb in data:
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return run


def cadence_fit(model, data, live_bar=False, drop: tuple[str, ...] = ()):
    """`Learner.fit` over `data`; `drop` removes default callbacks by class name (where the time goes:
    `instructions.py --runner cadence-no-progress cadence-loop-only`)."""
    from cadence import DataLoaders, Learner, ProgressCallback

    learn = Learner(DataLoaders(data, None, device="cpu"), model, loss_func=F.cross_entropy,
                    opt_func=torch.optim.SGD, lr=LR)
    learn.remove_cbs([cb for cb in learn.cbs if type(cb).__name__ in drop])
    if live_bar:  # the rich bar a terminal shows, drawn into a string
        from rich.console import Console
        learn.remove_cb(ProgressCallback).add_cb(ProgressCallback(Console(file=io.StringIO(), force_terminal=True)))
    return lambda: learn.fit(1)


def fastai_fit(model, data):
    import fastai.callback.progress  # noqa: F401  (adds ProgressCallback to the default callbacks)
    from fastai.data.core import DataLoaders
    from fastai.learner import Learner
    from fastai.optimizer import OptimWrapper

    learn = Learner(DataLoaders(data, []), model, loss_func=F.cross_entropy,
                    opt_func=partial(OptimWrapper, opt=torch.optim.SGD), lr=LR)
    return lambda: learn.fit(1)


def accelerator_loop(model, data, module="accelerate"):
    """A hand-written loop on an Accelerator: Accelerate's, or cadence's (`module="cadence"`, the one import changed)."""
    Accelerator = __import__(module).Accelerator

    acc = Accelerator(cpu=True)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))

    def run():
        model.train()
        for xb, yb in data:
            loss = F.cross_entropy(model(xb), yb)
            acc.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return run


cadence_accelerator_loop = partial(accelerator_loop, module="cadence")


def lightning_fit(model, data):
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def training_step(self, batch, i):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    module = Module(model)
    kw = dict(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
              enable_model_summary=False)
    return lambda: L.Trainer(**kw).fit(module, train_dataloaders=data)


def ignite_run(model, data):
    from ignite.engine import create_supervised_trainer

    trainer = create_supervised_trainer(model, torch.optim.SGD(model.parameters(), lr=LR), F.cross_entropy, device="cpu")
    return lambda: trainer.run(data, max_epochs=1)


RUNNERS = {"raw loop": raw_loop, "cadence": cadence_fit, "cadence, live bar": partial(cadence_fit, live_bar=True),
           "cadence accel": cadence_accelerator_loop, "fastai": fastai_fit, "accelerate": accelerator_loop,
           "lightning": lightning_fit, "ignite": ignite_run}


@contextlib.contextmanager
def quiet():
    """Capture progress output, warnings and log lines, so only the table is printed."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def available() -> dict[str, str]:
    """name -> "" when it can run here, else the reason it can't (e.g. "not installed")."""
    status = {}
    for name, mods in IMPORTS.items():
        try:
            with quiet():
                for mod in filter(None, (m.strip() for m in mods.split(","))):
                    __import__(mod)
            status[name] = ""
        except ImportError as e:
            status[name] = "not installed" if isinstance(e, ModuleNotFoundError) else f"import fails: {e}"[:60]
    status["cadence, live bar"] = status["cadence accel"] = status["cadence"]
    return status


# ---------------------------------------------------------------- measurements
def time_steps(names: list[str], size: str, n_batches: int, repeats: int, clock) -> dict[str, list[float]]:
    """µs per training step of each framework, per round; every round runs each framework once, in a rotating order."""
    base = make_model(size)
    data = {n: Timed(make_batches(size, n_batches), clock) for n in names}
    with quiet():
        runs = {n: RUNNERS[n](copy.deepcopy(base), data[n]) for n in names}
        for n in names:  # warm-up: first-call costs (lazy imports, allocator) are not per step
            runs[n]()
    times = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names):] + names[:r % len(names)]:
            with quiet():
                runs[n]()
                t1 = clock()
            assert torch.get_num_threads() == 1, f"{n} changed torch's thread count"
            times[n].append((t1 - data[n].t0) / n_batches * 1e6)
    return times


def paired_ratio(times: list[float], raw: list[float]) -> float:
    """Median over rounds of (framework time / raw loop time in the same round): slow drifts of the machine cancel."""
    return statistics.median(t / r for t, r in zip(times, raw))


def first_step_child(name: str) -> None:
    """In a fresh process: build and train until the first optimizer step ends, print the clocks, exit."""
    def done(opt, args, kwargs):  # fd 1, as sys.stdout is captured here; CPU time counts from process start
        os.write(1, f"FIRST_STEP {time.time()!r} {time.process_time()!r}\n".encode())
        os._exit(0)
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])  # torch's own first-optimizer imports, shared by all
    os.write(1, f"SHARED_DONE {time.time()!r} {time.process_time()!r}\n".encode())
    register_optimizer_step_post_hook(done)
    logging.disable(logging.CRITICAL)
    with quiet():
        RUNNERS[name](make_model("tiny"), Timed(make_batches("tiny", 20), time.perf_counter))()
    sys.exit(f"{name}: no optimizer step was taken")


def time_start(names: list[str], runs: int, clock: str) -> tuple[dict[str, float], float]:
    """Per framework, the median seconds from the shared mark to the first optimizer step done,
    and the raw loop's median from process start to its first step."""
    times, raw_total = {n: [] for n in names}, []
    for r in range(runs + 1):  # run 0 warms the disk cache and writes bytecode caches
        for n in names:
            t0 = time.time()
            out = subprocess.run([sys.executable, __file__, "--first-step", n], capture_output=True, text=True, env=ENV)
            marks = {ln.split()[0]: list(map(float, ln.split()[1:])) for ln in out.stdout.splitlines()
                     if ln.startswith(("SHARED_DONE ", "FIRST_STEP "))}
            if "FIRST_STEP" not in marks:
                raise RuntimeError(f"{n}: first-step child failed:\n{out.stderr[-2000:]}")
            (shared_wall, shared_cpu), (wall, cpu) = marks["SHARED_DONE"], marks["FIRST_STEP"]
            if r:
                times[n].append(wall - shared_wall if clock == "wall" else cpu - shared_cpu)
                if n == "raw loop":
                    raw_total.append(wall - t0 if clock == "wall" else cpu)
    return {n: statistics.median(t) for n, t in times.items()}, statistics.median(raw_total)


def time_imports(names: list[str], runs: int, clock: str) -> dict[str, float]:
    """Median seconds of `import <framework>` in a fresh process that has imported torch."""
    code = (f"import time, warnings; warnings.simplefilter('ignore'); c = time.{CLOCKS[clock].__name__}; t0 = c(); "
            "import torch; t = c(); {}; print(t - t0, c() - t)")
    times = {n: [] for n in names}
    for r in range(runs + 1):  # run 0 warms the caches
        for n in names:
            stmt = "; ".join(f"import {m.strip()}" for m in IMPORTS[n].split(",") if m.strip()) or "pass"
            out = subprocess.run([sys.executable, "-c", code.replace("{}", stmt)], capture_output=True, text=True,
                                 check=True, env=ENV)
            t_torch, t_mod = map(float, out.stdout.split()[-2:])
            if r:
                times[n].append(t_mod)
                times.setdefault("torch", []).append(t_torch)
    return {n: statistics.median(t) for n, t in times.items()}


# ---------------------------------------------------------------- report
def report(status, steps, start, imports) -> str:
    head = f"{'':18}{'tiny µs/step':>13}{'ratio':>7}{'MLP µs/step':>13}{'ratio':>7}{'start':>10}{'import':>9}"
    lines = [head, "-" * len(head)]
    for n, why in status.items():
        if why:
            lines.append(f"{n:18}{why}")
            continue
        cells = []
        for size in ("tiny", "mlp"):
            times = steps[size][n]
            cells.append(f"{statistics.median(times):13.1f}{paired_ratio(times, steps[size]['raw loop']):7.2f}")
        s = f"{start[n] - start['raw loop']:+9.2f}s" if n in start else f"{'':10}"
        i = f"{imports[n]:+8.2f}s" if n in imports and n != "raw loop" else ""
        lines.append(f"{n:18}{''.join(cells)}{s}{i}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats, batches and processes")
    p.add_argument("--smoke", action="store_true", help="one short repeat: checks the script runs (numbers mean nothing)")
    p.add_argument("--clock", choices=CLOCKS, default="cpu",
                   help="cpu: this process's CPU time, steady when other jobs share the cores (default); "
                        "wall: elapsed time, for a quiet machine")
    p.add_argument("--first-step", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.first_step:
        return first_step_child(args.first_step)
    repeats, n_tiny, n_mlp, n_proc = (1, 5, 5, 1) if args.smoke else (5, 100, 50, 3) if args.quick else (25, 300, 120, 9)
    status = available()
    names = [n for n, why in status.items() if not why]
    procs = [n for n in names if n in IMPORTS]
    clock = CLOCKS[args.clock]
    steps = {size: time_steps(names, size, n, repeats, clock) for size, n in (("tiny", n_tiny), ("mlp", n_mlp))}
    (start, raw_start), imports = time_start(procs, n_proc, args.clock), time_imports(procs, n_proc, args.clock)
    print(f"torch {torch.__version__}, 1 thread, SGD(lr={LR}), {args.clock} clock; {repeats} interleaved repeats of "
          f"{n_tiny} (tiny) / {n_mlp} (MLP) steps, {n_proc} fresh processes for start and import; medians "
          "(ratio: median over repeats of the time over the raw loop's in the same repeat)")
    print(report(status, steps, start, imports))
    print(f"start: process start to first step done, minus the raw loop's ({raw_start:.2f} s; "
          f"{start['raw loop']:.2f} s after the shared imports); "
          f"import: over `import torch` ({imports['torch']:.2f} s)")


if __name__ == "__main__":
    main()
