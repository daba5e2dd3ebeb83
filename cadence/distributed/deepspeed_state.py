"""Full tensors in and out of DeepSpeed's partitions: the fp32 masters and the optimizer state, whole on every rank.

DeepSpeed's `safe_get_full_*` / `safe_set_full_*` do most of it; these helpers cover what they do not
(a ZeRO-3 partition that is padded, an optimizer state not built yet, ZeRO-3 without an optimizer).

>>> weights = {name: full_fp32(p) for name, p in engine.module.named_parameters()}
"""

from __future__ import annotations

import warnings

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
    if precision == "fp32" or not frozen:
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
