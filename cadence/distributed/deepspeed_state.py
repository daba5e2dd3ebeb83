"""Full tensors in and out of DeepSpeed's partitions: the fp32 masters and the optimizer state, whole on every rank.

DeepSpeed's `safe_get_full_*` / `safe_set_full_*` do most of it; these helpers cover what they do not
(a ZeRO-3 partition that is padded, an optimizer state not built yet, ZeRO-3 without an optimizer).

>>> weights = {name: full_fp32(p) for name, p in engine.module.named_parameters()}
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn


def materialize_state(opt) -> None:
    """Create a lazily built optimizer state (Adam's moments) with one step of zero gradients at lr 0: no weight moves.

    `opt` is DeepSpeed's wrapper; its torch optimizer steps over flat fp32 partitions (ZeRO-3 puts each
    partition into its parameter group only while it steps).
    """
    base = opt.optimizer
    zero3 = getattr(opt, "fp32_partitioned_groups_flat", None)
    groups = ([(base.param_groups[opt.sub_group_to_group_id[i]], [flat]) for i, flat in enumerate(zero3)]
              if zero3 is not None else [(g, g["params"]) for g in base.param_groups])
    for group, flats in groups:
        saved = group["params"], group["lr"]
        group["params"], group["lr"] = list(flats), 0.0
        for flat in flats:
            flat.grad = torch.zeros_like(flat)
        base.step()
        for flat in flats:
            flat.grad = None
        group["params"], group["lr"] = saved if zero3 is not None else (group["params"], saved[1])


def frozen_fp32(model: nn.Module, precision: str, stage: int) -> dict[int, torch.Tensor]:
    """The fp32 values of `model`'s frozen parameters on the host, by parameter id, before a bf16/fp16 engine rounds
    them: DeepSpeed keeps fp32 masters of the trained parameters only, so without these an export (and the model
    after `distrib_ctx`) would hold a frozen base model rounded to bf16. ZeRO-0 to 2 only: each rank holds whole
    parameters anyway (on the CPU these are the parameters' own storages, no copy); ZeRO-3 partitions them so that
    no rank does, and warns instead."""
    frozen = [p for p in model.parameters() if not p.requires_grad and p.dtype == torch.float32]
    if precision in ("no", "fp32") or not frozen:
        return {}
    if stage == 3:
        warnings.warn(f"DeepSpeed ZeRO-3 in {precision} keeps no fp32 copy of the {len(frozen)} frozen parameters "
                      f"({sum(p.numel() for p in frozen) * 4 / 2**20:,.1f} MiB in fp32): they are rounded to "
                      f"{precision}, in training and in what save_model / the model after distrib_ctx hold; ZeRO-2 "
                      f"or FSDP keep them exact", stacklevel=3)
        return {}
    return {id(p): p.detach().cpu() for p in frozen}


def full_fp32(param: nn.Parameter, kept: torch.Tensor | None = None) -> torch.Tensor:
    """The whole fp32 master of `param` on the CPU: gathered from the ZeRO partitions, or the parameter itself;
    `kept` (from `frozen_fp32`) for a frozen parameter whose working copy is still its rounding."""
    from deepspeed.utils import safe_get_full_fp32_param

    if kept is not None and not param.requires_grad and torch.equal(kept.to(param.device, param.dtype), param):
        return kept

    full = safe_get_full_fp32_param(param)
    if full is not None:
        return full.detach().cpu().reshape(getattr(param, "ds_shape", param.shape)).clone()
    if hasattr(param, "ds_id"):  # ZeRO-3 without an optimizer: gather the parameter itself
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            return param.detach().float().cpu().clone()
    return param.detach().float().cpu().clone()


def set_zero3_partition(opt, param: nn.Parameter, value: torch.Tensor, key: str | None) -> None:
    """This rank's part of a full fp32 weight (key None) or optimizer-state tensor into its ZeRO-3 partition.

    DeepSpeed's own `safe_set_full_*` reads past the end of a parameter whose last partition is padded.
    """
    group, offset, n = opt.grad_position[opt.get_param_id(param)]
    flat = opt.fp32_partitioned_groups_flat[group]
    target = (flat if key is None else opt.optimizer.state[flat][key]).detach().narrow(0, offset, n)
    start = n * opt._get_param_partition_rank(param)
    part = value.flatten()[start:start + n]
    target.zero_()
    target[:part.numel()].copy_(part)


def torch_groups(opt: Any, model: nn.Module) -> list[dict]:
    """`opt`'s parameter groups (params and settings), frozen parameters and empty groups included, in the order a
    one-process torch optimizer numbers them in its `state_dict`; one group of all of `model`'s parameters for an
    optimizer without groups (an Accelerate `DummyOptim`). Recorded before `deepspeed.initialize` rewires the groups
    to flat partitions and drops the empty ones.

    >>> groups = torch_groups(make_opt(model), model)      # [{"params": [p0, p1], "lr": ...}, ...]
    """
    groups = getattr(opt, "param_groups", None)
    if groups is None:
        return [{"params": list(model.parameters())}]
    return [{**g, "params": list(g["params"])} for g in groups]


def partitioned(groups: list[dict]) -> bool:
    """Whether DeepSpeed holds the trained parameters' optimizer state in ZeRO partitions (or the bf16 optimizer's
    flat groups), where `safe_get_full_optimizer_state` finds it.

    >>> partitioned(torch_groups(opt, model))                  # True once a ZeRO engine is built over them
    """
    return any(p.requires_grad and (hasattr(p, "_hp_mapping") or hasattr(p, "ds_id"))
               for g in groups for p in g["params"])


def _engine_groups(base: torch.optim.Optimizer, groups: list[dict]) -> list[dict | None]:
    """For each of `groups`, the group of the engine's torch optimizer `base` that trains it (DeepSpeed keeps the
    non-empty ones, in order; a config's optimizer has one group for all), None for an empty group."""
    kept = [g for g in groups if g["params"]]
    live = iter(base.param_groups if len(base.param_groups) == len(kept) else base.param_groups[:1] * len(kept))
    return [next(live) if g["params"] else None for g in groups]


def full_optimizer_state(opt: Any, groups: list[dict]) -> dict:
    """The whole state of DeepSpeed's optimizer wrapper `opt` in a one-process torch optimizer's `state_dict` format:
    parameters numbered through `groups` (from `torch_groups`), a state entry for each trained one (its moments
    gathered from the partitions, on the CPU), none for a frozen one, each group's current settings. It loads into
    a plain torch optimizer over the same model and groups; every rank calls it (ZeRO-3 gathers).

    >>> groups = torch_groups(opt, model)                      # before deepspeed.initialize(model, opt)
    >>> torch.optim.AdamW(model.parameters()).load_state_dict(full_optimizer_state(engine.optimizer, groups))
    """
    from deepspeed.utils import safe_get_full_optimizer_state

    base = opt.optimizer
    keys = sorted({k for s in base.state.values() for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0})
    step = next((s["step"] for s in base.state.values() if "step" in s), None)
    state = {}
    for i, p in enumerate(p for group in groups for p in group["params"]):
        if not (p.requires_grad and keys):
            continue
        entry = {}
        for key in keys:
            full = safe_get_full_optimizer_state(p, key)
            if full is None:
                raise RuntimeError(f"DeepSpeed holds no {key!r} optimizer state for trained parameter {i} "
                                   f"{tuple(getattr(p, 'ds_shape', p.shape))}: build the optimizer given to the "
                                   f"engine over every parameter that requires a gradient")
            entry[key] = full.detach().cpu().reshape(getattr(p, "ds_shape", p.shape)).clone()
        if step is not None:
            entry["step"] = step.detach().cpu().clone() if torch.is_tensor(step) else step
        state[i] = entry
    numbered, start = [], 0
    for group, live in zip(groups, _engine_groups(base, groups)):
        settings = live if live is not None else group
        numbered.append({**{k: v for k, v in settings.items() if k != "params"},
                         "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    return {"state": state, "param_groups": numbered}


def load_full_optimizer_state(opt: Any, groups: list[dict], state: dict, device: torch.device) -> None:
    """Load a one-process torch optimizer's `state_dict` (what `full_optimizer_state` gives, or a DDP / FSDP / plain
    run's) into the partitions of DeepSpeed's optimizer wrapper `opt`, parameters numbered through `groups`; its
    state must exist (`materialize_state`).

    >>> load_full_optimizer_state(engine.optimizer, groups, torch.load("optimizer.pt"), torch.device("cpu"))
    """
    from deepspeed.utils import safe_set_full_optimizer_state

    sizes, saved_sizes = [len(g["params"]) for g in groups], [len(g["params"]) for g in state["param_groups"]]
    if sizes != saved_sizes:
        raise ValueError(f"the optimizer state has parameter groups of sizes {saved_sizes} but this optimizer's are "
                         f"{sizes}: load it into a Learner whose splitter (and frozen layers) match the saving run's")
    base = opt.optimizer
    for i, p in enumerate(p for group in groups for p in group["params"]):
        for key, value in state["state"].get(i, {}).items():
            if not (p.requires_grad and torch.is_tensor(value) and value.dim() > 0):
                continue
            if hasattr(p, "ds_id"):
                set_zero3_partition(opt, p, value, key)
            else:
                safe_set_full_optimizer_state(p, value.to(device), key)
    steps = [s["step"] for s in state["state"].values() if "step" in s]
    for s in base.state.values():
        if steps and "step" in s:
            s["step"] = steps[0].clone() if torch.is_tensor(steps[0]) else steps[0]
    for live, saved in zip(_engine_groups(base, groups), state["param_groups"]):
        if live is not None:
            live.update({k: v for k, v in saved.items() if k != "params"})
