"""Step time of cadence's DDP, FSDP2, DeepSpeed, TP and TP x FSDP2 against hand-written loops on the same engines.

Model: 3 x (Linear(1024, 1024), ReLU) and Linear(1024, 10); batch 64 per rank; SGD; one torch
thread per process; the batches are built in memory beforehand (no loader cost on either side).

- **raw DDP**: `DistributedDataParallel(model)` with torch's defaults, forward, loss, backward, step, zero_grad.
- **cadence DDP**: `Learner.fit` inside `learn.distrib_ctx()` (cadence's DDP defaults: buckets as gradient views,
  averaged through shared memory when every rank is on this machine's CPU).
- **raw FSDP2**: `fully_shard` on each Linear, then on the root; the same step.
- **cadence FSDP2**: `learn.distrib_ctx(strategy="fsdp", transformer_layer_cls_to_wrap="Linear")`.
- **raw TP**: `parallelize_module` (Linear 0 and 4 column-wise, 2 and 6 row-wise) over both processes, the same
  step (every rank sees the same batch).
- **cadence TP**: `learn.distrib_ctx(strategy="model_parallel", tp_size=2, parallelize=...)` with that plan.
- With `--nproc 4` only the model-parallel loops run: **raw TP** / **cadence TP** over all 4 processes (tp_size=4),
  and **raw 2-D**: a (dp=2, tp=2) `init_device_mesh`, `parallelize_module` with the plan above on "tp", then
  `fully_shard` on each Linear and the root over "dp", the same step; **cadence 2-D**:
  `distrib_ctx(strategy="model_parallel", tp_size=2, parallelize=..., transformer_layer_cls_to_wrap="Linear")`.
- **raw PP**: `torch.distributed.pipelining`: stage 0 = children 0-3 on rank 0, stage 1 = the rest on rank 1,
  `Schedule1F1B` over 4 micro-batches with the loss in the schedule; `schedule.step`, step, zero_grad.
- **cadence PP**: `learn.distrib_ctx(strategy="model_parallel", pp_size=2, pp_schedule="1F1B", pp_microbatches=4,
  pp_split_points=["4"])`.
- **raw DeepSpeed**: `deepspeed.initialize(model, optimizer=SGD, config=ZeRO-2)`, then `engine(x)`, loss,
  `engine.backward(loss)`, `engine.step()` (DeepSpeed's documented loop); gradient clipping off.
- **cadence DeepSpeed**: `learn.distrib_ctx(strategy="deepspeed", zero_stage=2)` (only when deepspeed is installed).

Each round runs every loop once for `--steps` steps after `--warmup` steps, in a rotating order;
time is wall time on rank 0 (communication included), two ways: the whole run between barriers (building the
model and the engine, the first step's one-time work such as the pipeline's shape inference, and taking it down,
all included), and steady state, from the end of the first optimizer step to the end of the last (each loop
marks its steps' ends). The ratio is the median over rounds of (loop time / its raw loop's time in the same
round).

    .venv/bin/python bench/ddp.py                 # ~4 min on 2 cores (~8 with DeepSpeed)
    .venv/bin/python bench/ddp.py --smoke         # one short round: the script runs
    .venv/bin/python bench/ddp.py --nproc 4       # TP over 4 processes and 2-D (2 tp x 2 FSDP2 dp groups)
    .venv/bin/python bench/ddp.py --only PP       # raw PP and cadence PP only
"""

from __future__ import annotations

import argparse
import statistics
import time

from launched import is_worker, relaunch

WIDTH, DEPTH, BATCH, CLASSES = 1024, 3, 64, 10


def make_model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = [m for _ in range(DEPTH) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())]
    return nn.Sequential(*layers, nn.Linear(WIDTH, CLASSES))


def make_batches(n: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)) for _ in range(n)]


def raw_loop(wrap):
    def run(batches):
        import torch
        import torch.nn.functional as F

        model = wrap(make_model())
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        for x, y in batches:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            step_done()
    return run


STEP_ENDS: list[float] = []  # when each step of the timed run ended: steady state is from the first to the last


def step_done() -> None:
    STEP_ENDS.append(time.perf_counter())


def ddp_wrap(model):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def fsdp_wrap(model):
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    return fully_shard(model)


def tensor_parallel(model, tp_mesh=None):
    """Megatron-style pairs: Linear 0 and 4 column-wise, 2 and 6 (the head) row-wise, over all processes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import torch

    tp_mesh = tp_mesh or init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel(),
                                        "4": ColwiseParallel(), "6": RowwiseParallel()})
    return model


def two_d(model):
    """2-D: the tensor-parallel plan on the "tp" dimension of a (dp, tp=2) mesh, then FSDP2 over "dp"."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    tensor_parallel(model, mesh["tp"])
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


DEEPSPEED_CONFIG = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
                    "zero_optimization": {"stage": 2}, "steps_per_print": 2**31 - 1, "zero_allow_untested_optimizer": True}


def raw_pipeline(batches):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    model, rank = make_model(), dist.get_rank()
    stage = nn.Sequential(*list(model)[:4]) if rank == 0 else nn.Sequential(*list(model)[4:])
    opt = torch.optim.SGD(stage.parameters(), lr=1e-2)
    schedule = Schedule1F1B(PipelineStage(stage, rank, 2, torch.device("cpu")), 4, loss_fn=F.cross_entropy)
    for x, y in batches:
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        opt.step()
        opt.zero_grad()
        step_done()


def raw_deepspeed(batches):
    import torch
    import torch.nn.functional as F

    from cadence.distributed.deepspeed import import_deepspeed  # the CPU accelerator, as any script here needs

    deepspeed, model = import_deepspeed(), make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    config = {**DEEPSPEED_CONFIG, "train_batch_size": BATCH * torch.distributed.get_world_size()}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    for x, y in batches:
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
        step_done()
    engine.destroy()


def cadence_loop(strategy, **kwargs):
    def run(batches):
        import torch
        import torch.nn.functional as F

        from cadence import Callback, DataLoaders, Learner

        class FirstStep(Callback):
            def after_batch(self):
                step_done()

        learn = Learner(DataLoaders(batches, None, device="cpu"), make_model(), loss_func=F.cross_entropy,
                        opt_func=torch.optim.SGD, lr=1e-2, cbs=[FirstStep()])
        learn.remove_cb(learn.progress)
        with learn.distrib_ctx(strategy=strategy, **kwargs):
            learn.fit(1)
    return run


LOOPS = {"raw DDP": raw_loop(ddp_wrap), "cadence DDP": cadence_loop("ddp"),
         "raw FSDP2": raw_loop(fsdp_wrap), "cadence FSDP2": cadence_loop("fsdp", transformer_layer_cls_to_wrap="Linear"),
         "raw TP": raw_loop(tensor_parallel),
         "cadence TP": cadence_loop("model_parallel", tp_size=2, parallelize=tensor_parallel),
         "raw PP": raw_pipeline,
         "cadence PP": cadence_loop("model_parallel", pp_size=2, pp_schedule="1F1B", pp_microbatches=4,
                                    pp_split_points=["4"])}
FOUR = {"raw TP": raw_loop(tensor_parallel), "cadence TP": cadence_loop("model_parallel", tp_size=4, parallelize=tensor_parallel),
        "raw 2-D": raw_loop(two_d), "cadence 2-D": cadence_loop("model_parallel", tp_size=2, parallelize=tensor_parallel,
                                                               transformer_layer_cls_to_wrap="Linear")}
BASELINE = {"cadence DDP": "raw DDP", "cadence FSDP2": "raw FSDP2", "cadence DeepSpeed": "raw DeepSpeed",
            "cadence TP": "raw TP", "cadence 2-D": "raw 2-D", "cadence PP": "raw PP"}


def _add_deepspeed() -> None:
    import importlib.util

    if importlib.util.find_spec("deepspeed") is not None:
        LOOPS.update({"raw DeepSpeed": raw_deepspeed, "cadence DeepSpeed": cadence_loop("deepspeed", zero_stage=2)})


def timed(run, warmup, batches) -> tuple[float, float]:
    """Seconds for a run over `batches` after a warmup run (imports and first-use costs stay in that one): the whole
    run (building the model and the engine, and taking it down, included), and from its first step's end to its
    last step's end (steady state)."""
    from cadence.distributed.ops import wait_for_everyone

    run(warmup)
    wait_for_everyone()
    STEP_ENDS.clear()
    start = time.perf_counter()
    run(batches)
    wait_for_everyone()
    return time.perf_counter() - start, STEP_ENDS[-1] - STEP_ENDS[0]


def worker(args) -> None:
    import torch

    from cadence.distributed.env import rank, setup_distrib, world_size

    torch.set_num_threads(1)
    setup_distrib()
    loops = LOOPS if world_size() == 2 else FOUR
    if world_size() == 2:
        _add_deepspeed()
    batches, warmup = make_batches(args.steps, rank()), make_batches(args.warmup, rank())
    names = [n for n in loops if not args.only or n.split()[-1] in args.only.split(",")]
    times = {n: [] for n in names}
    for r in range(args.rounds):   # every round runs each loop once, in a rotating order: cadence and raw interleaved
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(timed(loops[name], warmup, batches))
    if rank() == 0:
        print(report(times, args))


def report(times: dict[str, list[tuple[float, float]]], args) -> str:
    lines = [f"{args.nproc} processes, {args.rounds} rounds of {args.steps} steps; ms/step median (ratio: median of "
             f"per-round ratios); whole run (setup and exit included) / from the 2nd step",
             "| loop | ms/step | ratio to its raw loop | ms/step from the 2nd step | ratio from the 2nd step |",
             "| --- | --- | --- | --- | --- |"]
    for name, ts in times.items():
        cells = []
        for i, steps in ((0, args.steps), (1, args.steps - 1)):
            base = BASELINE.get(name)
            ratio = statistics.median(t[i] / b[i] for t, b in zip(ts, times[base])) if base else 1.0
            cells += [f"{statistics.median(t[i] for t in ts) / steps * 1e3:.2f}", f"{ratio:.3f}"]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2, choices=(2, 4), help="4: the TP (tp=4) and 2-D (2x2) loops only")
    p.add_argument("--smoke", action="store_true", help="one short round: checks the script runs")
    p.add_argument("--only", default="", help="engines to run, e.g. PP,TP (both loops of each)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.steps, args.warmup = 1, 3, 1
    if is_worker():
        return worker(args)
    flags = ["--rounds", str(args.rounds), "--steps", str(args.steps), "--warmup", str(args.warmup),
             "--nproc", str(args.nproc), "--only", args.only]
    print(relaunch(args.nproc, __file__, flags))


if __name__ == "__main__":
    main()
