"""Model-state memory per rank: parameters + gradients + optimizer state, by engine and process count.

Model: 6 x Linear(512, 512) and Linear(512, 10) (~1.58 M parameters), AdamW, fp32 (and bf16 for
DeepSpeed, whose mixed precision keeps bf16 weights). At the second step, after backward and before
the optimizer runs (gradients held, optimizer state built), each rank sums the bytes of the tensors it
holds (local shards for FSDP, ZeRO-3's partitions, each storage counted once, so DDP's gradient-bucket
views are not counted twice); the table shows the largest rank. For DeepSpeed "optimizer" is every
tensor its ZeRO optimizer holds (fp32 master partitions, Adam's moments, its gradient partitions)
except its communication buckets, which are "buffers": the ZeRO paper counts parameters, gradients
and optimizer state as model state and such fused buffers as residual state (constant size per rank,
not divided by N). "estimate" is `cadence estimate-memory`'s model-state accounting for the same
engine. Targets: FSDP FULL_SHARD and ZeRO-3 model state at most 1/N of DDP's + 5%; tensor parallelism
(tp=2; on 4 processes inside FSDP2 over dp=2: 2-D) at most 1/(tp x dp) of DDP's + 5%; TP over every process
(tp=N, no FSDP) at most 1/N + 5%.

    .venv/bin/python bench/memory.py               # 2 and 4 processes (~1 min)
    .venv/bin/python bench/memory.py --nproc 2     # one size
    .venv/bin/python bench/memory.py --nproc 4 --strategies ddp model_parallel   # some engines
"""

from __future__ import annotations

import argparse

from launched import is_worker, relaunch

WIDTH, DEPTH = 512, 6
# name: (strategy, options, precision, the engine's name in cadence.distributed.estimate)
ENGINES = {"DDP": ("ddp", {}, "no", "DDP"),
           "FSDP FULL_SHARD": ("fsdp", {"sharding_strategy": "FULL_SHARD", "transformer_layer_cls_to_wrap": "Linear"},
                               "no", "FSDP"),
           "FSDP SHARD_GRAD_OP": ("fsdp", {"sharding_strategy": "SHARD_GRAD_OP", "transformer_layer_cls_to_wrap": "Linear"},
                                  "no", None),
           "TP x FSDP (tp=2, dp=rest)": ("model_parallel", {"tp_size": 2, "parallelize": "megatron_pairs"}, "no", None),
           "TP (tp=all, dp=1)": ("model_parallel", {"tp_size": "all", "parallelize": "megatron_pairs"}, "no", None)}
STRATEGIES = ("ddp", "fsdp", "model_parallel", "deepspeed")
DEEPSPEED_ENGINES = {f"ZeRO-{k}{' bf16' if p == 'bf16' else ''}": ("deepspeed", {"zero_stage": k}, p, f"ZeRO-{k}")
                     for p in ("no", "bf16") for k in (1, 2, 3)}


def make_model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)], nn.Linear(WIDTH, 10))


def megatron_pairs(model, tp_mesh):
    """Tensor parallelism for the bench model: each pair of hidden layers column- then row-wise (the 10-way head whole)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, tp_mesh, {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
                                        for i in range(DEPTH)})


def local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def held_tensors(obj, depth: int = 6, visited: set | None = None):
    """Every tensor reachable from a DeepSpeed optimizer's attributes (lists, dicts, its torch optimizer)."""
    import torch
    from torch import nn

    visited = set() if visited is None else visited
    if id(obj) in visited or depth < 0 or isinstance(obj, nn.Module):
        return
    visited.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from held_tensors(v, depth - 1, visited)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from held_tensors(v, depth - 1, visited)
    elif type(obj).__module__.startswith(("deepspeed", "torch.optim", "collections")) and hasattr(obj, "__dict__"):
        yield from held_tensors(vars(obj), depth - 1, visited)


# a ZeRO optimizer's gradient buckets (ZeRO-3: one per dtype, kept for `contiguous_gradients`; ZeRO-1/2: only in backward)
BUCKET_ATTRIBUTES = ("ipg_buckets", "ipg_buffer")


def state_bytes(model, opt) -> dict[str, int]:
    """Bytes of parameters, gradients, optimizer state and communication buffers this rank holds, each storage once."""
    seen: set[int] = set()

    def size(tensors) -> int:
        total = 0
        for t in map(local, tensors):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen and t.untyped_storage().nbytes():
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
        return total
    params = list(model.parameters())
    held = {"params": size([*params, *(p.ds_tensor for p in params if hasattr(p, "ds_tensor"))]),
            "grads": size(p.grad for p in params if p.grad is not None)}
    if hasattr(opt, "optimizer"):  # a DeepSpeed ZeRO optimizer: buckets, then masters, moments, gradient partitions
        buckets = [getattr(opt, name) for name in BUCKET_ATTRIBUTES if hasattr(opt, name)]
        held["buffers"] = size(t for t in held_tensors(buckets) if t.dim() > 0)
        return {**held, "optimizer": size(t for t in held_tensors(opt) if t.dim() > 0)}
    return {**held, "buffers": 0, "optimizer": size(v for s in opt.state.values() for v in s.values()
                                                    if hasattr(v, "untyped_storage") and v.dim() > 0)}


def measure(strategy: str, kwargs: dict, precision: str) -> dict[str, int]:
    """Model state at the second step, just before the optimizer runs: gradients held, optimizer state built."""
    import torch
    import torch.nn.functional as F

    from cadence import Callback, DataLoaders, Learner, MixedPrecision

    class Measure(Callback):
        def before_step(self):
            if self.learn.iter == 1:
                self.bytes = state_bytes(self.learn.model, self.learn.opt)

    x, y = torch.randn(8, WIDTH), torch.randint(0, 10, (8,))
    probe = Measure()
    cbs = [probe] + ([MixedPrecision(precision)] if precision != "no" else [])
    learn = Learner(DataLoaders([(x, y)] * 2, None, device="cpu"), make_model(), loss_func=F.cross_entropy, cbs=cbs)
    learn.remove_cb(learn.progress)
    if kwargs.get("parallelize") == "megatron_pairs":
        kwargs = {**kwargs, "parallelize": megatron_pairs}
    if kwargs.get("tp_size") == "all":
        from cadence.distributed.env import world_size

        kwargs = {**kwargs, "tp_size": world_size()}
    with learn.distrib_ctx(strategy=strategy, **kwargs):
        learn.fit(1)
    return probe.bytes


def worker(strategies: list[str]) -> None:
    import importlib.util

    from cadence.distributed.env import rank, setup_distrib, world_size
    from cadence.distributed.estimate import model_state_bytes
    from cadence.distributed.ops import gather_object

    setup_distrib()
    engines = {**ENGINES, **(DEEPSPEED_ENGINES if importlib.util.find_spec("deepspeed") else {})}
    engines = {name: engine for name, engine in engines.items() if engine[0] in strategies}
    rows = {}
    for name, (strategy, kwargs, precision, _) in engines.items():
        per_rank = gather_object(measure(strategy, kwargs, precision))
        rows[name] = max(per_rank, key=lambda r: sum(r.values()))
    if rank() == 0:
        ddp = model_state(rows["DDP"])
        n_params = sum(p.numel() for p in make_model().parameters())
        for name, r in rows.items():
            total, (_, _, precision, kind) = model_state(r), engines[name]
            estimate = (f"{model_state_bytes(n_params, kind, world_size(), mixed=precision != 'no').device / 2**20:.2f}"
                        if kind else "")
            print(f"| {world_size()} | {name} | {r['params'] / 2**20:.2f} | {r['grads'] / 2**20:.2f} | "
                  f"{r['optimizer'] / 2**20:.2f} | {total / 2**20:.2f} | {estimate} | {total / ddp:.3f} | "
                  f"{r['buffers'] / 2**20:.2f} | {(total + r['buffers']) / ddp:.3f} |")


def model_state(row: dict[str, int]) -> int:
    """Parameters + gradients + optimizer state (the ZeRO paper's model state), buffers left out."""
    return row["params"] + row["grads"] + row["optimizer"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES,
                   help="the engines to measure, by strategy (DDP's row is every ratio's base: always measured)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if is_worker():
        return worker(["ddp", *args.strategies])
    print("| processes | engine | params MiB | grads MiB | optimizer MiB | model state MiB | estimate MiB | of DDP "
          "| buffers MiB | with buffers, of DDP |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in args.nproc:
        print(relaunch(n, __file__, ["--strategies", *args.strategies]), end="")


if __name__ == "__main__":
    main()
