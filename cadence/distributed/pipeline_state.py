"""A pipeline's state under the whole model's parameter names: what `learn.save`, `learn.load` and checkpoints of a
`Pipeline` (pipeline.py) read and write, so that they load in one process and on any other mesh.

A rank holds some stages, whose modules may name the model's layers their own way (a `split` function's); `names`
maps each of its names that differs to the model's. The optimizer state of the whole model is the one FSDP gives
(`{"state": {name: ...}, "param_groups": [{"params": [names], ...}]}`), its parameters in the model's order, so a
plain `opt.load_state_dict` in one process takes it by position.

>>> whole = merged_optimizer_state([renamed_optimizer_state(s, names) for s in per_rank], skeleton)
>>> weights = merged_weights(local_weights, pp_group, everywhere=True)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["merged_optimizer_state", "merged_weights", "renamed_checkpoint", "renamed_optimizer_state"]

_ALIGN = 16  # bytes: each tensor starts at an offset its dtype can be viewed at


def merged_weights(local: dict[str, torch.Tensor], group: Any, everywhere: bool) -> dict[str, torch.Tensor]:
    """Every rank of `group`'s `local` CPU weights merged: on each rank (`everywhere`), else on the group's rank 0
    when that is global rank 0 (others get {}). Names, dtypes and shapes travel as one small object gather; the
    bytes as one flat buffer per rank (a broadcast, or a send to rank 0), never pickled."""
    if not everywhere and dist.get_global_rank(group, 0) != 0:
        return {}
    me, size = dist.get_rank(group), dist.get_world_size(group)
    layouts: list[Any] = [None] * size
    dist.all_gather_object(layouts, [(k, v.dtype, tuple(v.shape), v.numel() * v.element_size())
                                     for k, v in local.items()], group=group)
    merged: dict[str, torch.Tensor] = {}
    for r, layout in enumerate(layouts):
        ends = [0]
        for *_, nbytes in layout:
            ends.append(ends[-1] + -(-nbytes // _ALIGN) * _ALIGN)
        if not (everywhere or me in (0, r)):
            continue
        flat = torch.empty(ends[-1], dtype=torch.uint8)
        if r == me:
            for (k, *_), start in zip(layout, ends):
                t = local[k].detach().contiguous().reshape(-1)
                flat[start:start + t.numel() * t.element_size()] = t.view(torch.uint8)
        src = dist.get_global_rank(group, r)
        if everywhere:
            dist.broadcast(flat, src=src, group=group)
        elif r != me:  # rank 0
            dist.recv(flat, src=src, group=group)
        elif me != 0:
            dist.send(flat, dst=dist.get_global_rank(group, 0), group=group)
        if everywhere or me == 0:
            merged.update({k: flat[start:start + nbytes].view(dtype).reshape(shape).clone()
                           for (k, dtype, shape, nbytes), start in zip(layout, ends)})
    return merged if everywhere or me == 0 else {}


def renamed_optimizer_state(state: dict, names: dict[str, str]) -> dict:
    """An optimizer state keyed by parameter names with each name renamed by `names` (tensors moved to the CPU)."""
    def cpu(s: dict) -> dict:
        return {n: v.detach().cpu() if isinstance(v, torch.Tensor) else v for n, v in s.items()}

    return {"state": {names.get(k, k): cpu(s) for k, s in state["state"].items()},
            "param_groups": [{**g, "params": [names.get(p, p) for p in g["params"]]} for g in state["param_groups"]]}


def merged_optimizer_state(parts: list[dict], skeleton: nn.Module) -> dict:
    """The whole model's optimizer state from each pipeline rank's (group i of every rank is group i of the model),
    parameters in the model's order; a tie is kept under its first name, as `skeleton.named_parameters()` gives."""
    counts = [len(part["param_groups"]) for part in parts]
    if len(set(counts)) > 1:
        raise ValueError(f"the pipeline's ranks have {counts} optimizer parameter groups: their state cannot be merged "
                         f"into the whole model's; save with the Checkpoint callback, or learn.save(name, with_opt=False)")
    order = {n: i for i, (n, _) in enumerate(skeleton.named_parameters())}
    groups = [{**g, "params": sorted({p for part in parts for p in part["param_groups"][i]["params"] if p in order},
                                     key=order.__getitem__)} for i, g in enumerate(parts[0]["param_groups"])]
    return {"state": {k: v for part in parts for k, v in part["state"].items() if k in order}, "param_groups": groups}


def renamed_checkpoint(state: dict, names: dict[str, str]) -> dict:
    """A checkpoint's `{"model": ..., "optimizer": ...}` with each parameter name renamed by `names` (the optimizer's
    flat keys are `state.<name>.<key>` and `param_groups.<name>.<key>`)."""
    def rename(key: str) -> str:
        kind, _, rest = key.partition(".")
        fqn, _, attr = rest.rpartition(".")
        return f"{kind}.{names.get(fqn, fqn)}.{attr}"

    return {"model": {names.get(k, k): v for k, v in state["model"].items()},
            "optimizer": {rename(k): v for k, v in state["optimizer"].items()}}
