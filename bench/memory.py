"""Model-state memory per rank: parameters + gradients + optimizer state, by engine and process count.

Model: 6 x Linear(512, 512) and Linear(512, 10) (~1.58 M parameters), AdamW, fp32. At the second
step, after backward and before the optimizer runs (gradients held, optimizer state built), each
rank sums the bytes of the tensors it holds (local shards for FSDP, each
storage counted once, so DDP's gradient-bucket views are not counted twice); the table shows the
largest rank. FULL_SHARD's target: at most 1/N of DDP's + 5%.

    .venv/bin/python bench/memory.py               # 2 and 4 processes (~1 min)
    .venv/bin/python bench/memory.py --nproc 2     # one size
"""

from __future__ import annotations

import argparse

from launched import is_worker, relaunch

WIDTH, DEPTH = 512, 6
ENGINES = {"DDP": ("ddp", {}),
           "FSDP FULL_SHARD": ("fsdp", {"sharding_strategy": "FULL_SHARD", "transformer_layer_cls_to_wrap": "Linear"}),
           "FSDP SHARD_GRAD_OP": ("fsdp", {"sharding_strategy": "SHARD_GRAD_OP", "transformer_layer_cls_to_wrap": "Linear"})}


def make_model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)], nn.Linear(WIDTH, 10))


def local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def state_bytes(model, opt) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds, each storage once."""
    seen: set[int] = set()

    def size(tensors) -> int:
        total = 0
        for t in map(local, tensors):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
        return total
    params = list(model.parameters())
    return {"params": size(params), "grads": size(p.grad for p in params if p.grad is not None),
            "optimizer": size(v for s in opt.state.values() for v in s.values() if hasattr(v, "untyped_storage")
                              and v.dim() > 0)}


def measure(strategy: str, kwargs: dict) -> dict[str, int]:
    """Model state at the second step, just before the optimizer runs: gradients held, optimizer state built."""
    import torch
    import torch.nn.functional as F

    from cadence import Callback, DataLoaders, Learner

    class Measure(Callback):
        def before_step(self):
            if self.learn.iter == 1:
                self.bytes = state_bytes(self.learn.model, self.learn.opt)

    x, y = torch.randn(8, WIDTH), torch.randint(0, 10, (8,))
    probe = Measure()
    learn = Learner(DataLoaders([(x, y)] * 2, None, device="cpu"), make_model(), loss_func=F.cross_entropy, cbs=probe)
    learn.remove_cb(learn.progress)
    with learn.distrib_ctx(strategy=strategy, **kwargs):
        learn.fit(1)
    return probe.bytes


def worker() -> None:
    from cadence.distributed.env import rank, setup_distrib, world_size
    from cadence.distributed.ops import gather_object

    setup_distrib()
    rows = {}
    for name, (strategy, kwargs) in ENGINES.items():
        per_rank = gather_object(measure(strategy, kwargs))
        rows[name] = max(per_rank, key=lambda r: sum(r.values()))
    if rank() == 0:
        ddp = sum(rows["DDP"].values())
        for name, r in rows.items():
            total = sum(r.values())
            print(f"| {world_size()} | {name} | {r['params'] / 2**20:.2f} | {r['grads'] / 2**20:.2f} | "
                  f"{r['optimizer'] / 2**20:.2f} | {total / 2**20:.2f} | {total / ddp:.3f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if is_worker():
        return worker()
    print("| processes | engine | params MiB | grads MiB | optimizer MiB | total MiB | of DDP |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n in args.nproc:
        print(relaunch(n, __file__, []), end="")


if __name__ == "__main__":
    main()
