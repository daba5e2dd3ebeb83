"""A pipeline's state under the whole model's parameter names: what `learn.save`, `learn.load` and checkpoints of a
`Pipeline` (pipeline.py) read and write, so that they load in one process and on any other mesh.

A rank holds some stages, whose modules may name the model's layers their own way (a `split` function's); `names`
maps each of its names that differs to the model's. The optimizer state of the whole model is the one FSDP gives
(`{"state": {name: ...}, "param_groups": [{"params": [names], ...}]}`), its parameters in the model's order, so a
plain `opt.load_state_dict` in one process takes it by position.

>>> whole = merged_optimizer_state([renamed_optimizer_state(s, names) for s in per_rank], skeleton)
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["merged_optimizer_state", "renamed_checkpoint", "renamed_optimizer_state"]


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
