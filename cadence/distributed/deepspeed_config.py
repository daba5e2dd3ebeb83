"""DeepSpeed's config: a user's JSON (a dict or a file), Accelerate-named options on top, its "auto" values filled.

`build_config` makes the config a `DeepSpeed` strategy holds; `engine_config` fills what the Learner decides
(batch sizes, accumulation, clipping, precision) when the engine is built; the bucket sizes and the optimizer
entries are filled from the model and the Learner's optimizer.

>>> build_config(zero_stage=3, offload_param_device="cpu")["zero_optimization"]
{'stage': 3, 'offload_param': {'device': 'cpu'}}
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import env

__all__ = ["build_config", "engine_config", "configured_precision", "check_precision"]

AUTO = "auto"
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
# Accelerate's deepspeed_config keys (without the `deepspeed_` prefix where it has one)
OPTIONS = ("config_file", "zero_stage", "gradient_accumulation_steps", "gradient_clipping", "offload_optimizer_device",
           "offload_param_device", "offload_optimizer_nvme_path", "offload_param_nvme_path", "zero3_init_flag",
           "zero3_save_16bit_model")
MOOT_OPTIONS = ("multinode_launcher", "hostfile", "exclusion_filter", "inclusion_filter", "moe_layer_cls_names")


def launcher_options() -> dict[str, Any]:
    """`$CADENCE_DEEPSPEED_CONFIG` (the launcher's `deepspeed_config` block), keys without the `deepspeed_` prefix."""
    raw = json.loads(os.environ.get("CADENCE_DEEPSPEED_CONFIG") or "{}")
    return {k.removeprefix("deepspeed_"): v for k, v in raw.items()}


def _deep_merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def _read_config(config: str | os.PathLike | dict | None) -> dict:
    if config is None:
        return {}
    if isinstance(config, dict):
        return copy.deepcopy(config)
    path = Path(config).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config file {path} does not exist")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"DeepSpeed config file {path} is not valid JSON: {e}") from None


def build_config(config: str | os.PathLike | dict | None = None, **options: Any) -> dict:
    """DeepSpeed's config from a user config (dict or JSON file) and Accelerate-named options on top.

    Values left to the Learner stay "auto" until the engine is built (`setup`) or the fit starts
    (`configure_fit`). Clipping defaults to off (DeepSpeed's own default is 1.0): GradClip switches it on.

    >>> build_config(zero_stage=2, offload_optimizer_device="cpu")["zero_optimization"]
    {'stage': 2, 'offload_optimizer': {'device': 'cpu'}}
    """
    unknown = sorted(set(options) - set(OPTIONS) - set(MOOT_OPTIONS))
    if unknown:
        raise ValueError(f"unknown DeepSpeed option(s) {unknown}; DeepSpeed takes config (a dict or JSON file) and "
                         f"{', '.join(OPTIONS)}")
    defaults = {"train_micro_batch_size_per_gpu": AUTO, "train_batch_size": AUTO, "gradient_accumulation_steps": AUTO,
                "gradient_clipping": AUTO, "steps_per_print": 2**31 - 1, "zero_optimization": {"stage": 0},
                "zero_allow_untested_optimizer": True}  # the Learner's optimizer, whichever it is
    cfg = _deep_merge(defaults, _read_config(options.get("config_file") if config is None else config))
    zero = cfg.setdefault("zero_optimization", {})
    if options.get("zero_stage") is not None:
        zero["stage"] = int(options["zero_stage"])
    if zero.get("stage", 0) not in (0, 1, 2, 3):
        raise ValueError(f"DeepSpeed zero_stage {zero.get('stage')!r} does not exist; choose 0, 1, 2 or 3")
    for what, stages in (("optimizer", (1, 2, 3)), ("param", (3,))):
        device = options.get(f"offload_{what}_device")
        if device is None:
            continue
        if device not in OFFLOAD_DEVICES:
            raise ValueError(f"DeepSpeed offload_{what}_device {device!r} does not exist; choose one of {OFFLOAD_DEVICES}")
        if device != "none" and zero["stage"] not in stages:
            raise ValueError(f"DeepSpeed offload_{what}_device={device!r} needs zero_stage {' or '.join(map(str, stages))}, "
                             f"not {zero['stage']}")
        zero[f"offload_{what}"] = {"device": device}
        if options.get(f"offload_{what}_nvme_path"):
            zero[f"offload_{what}"]["nvme_path"] = options[f"offload_{what}_nvme_path"]
    for key in ("gradient_accumulation_steps", "gradient_clipping"):
        if options.get(key) is not None:
            cfg[key] = options[key]
    if options.get("zero3_save_16bit_model") is not None:
        zero["stage3_gather_16bit_weights_on_model_save"] = as_flag(options["zero3_save_16bit_model"])
    return cfg


def as_flag(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


def is_auto(value: Any) -> bool:
    return value == AUTO


# how each API sets a precision, for the refusals: (whose precision, set p, train in fp32)
PRECISION_APIS = {"learner": ("the Learner's precision", "learn.to_{p}()", "learn.to_fp32(), no MixedPrecision"),
                  "accelerator": ("the Accelerator's mixed_precision", "Accelerator(mixed_precision='{p}')",
                                  "Accelerator(mixed_precision='no')")}


def configured_precision(config: dict) -> str | None:
    """The precision a DeepSpeed config turns on in so many words (`"enabled": true`): "bf16", "fp16" or None.

    >>> configured_precision({"bf16": {"enabled": True}}), configured_precision({"fp16": {"enabled": "auto"}})
    ('bf16', None)
    """
    return next((n for n in ("bf16", "fp16") if as_flag((config.get(n) or {}).get("enabled", False))), None)


def check_precision(config: dict, precision: str, api: str = "learner") -> None:
    """Refuse a config whose bf16/fp16 sections contradict `precision` ("no", "bf16" or "fp16"), naming how `api`
    ("learner" or "accelerator") sets the precision.

    >>> check_precision({"bf16": {"enabled": True}}, "bf16", "accelerator")     # agrees: nothing raised
    >>> check_precision({"fp16": {"enabled": True}}, "bf16", "accelerator")
    Traceback (most recent call last):
    ValueError: the DeepSpeed config enables fp16 but the Accelerator's mixed_precision is 'bf16': ...
    """
    whose, set_it, fp32 = PRECISION_APIS[api]
    enabled = configured_precision(config)
    if enabled is not None and enabled != precision:
        raise ValueError(f"the DeepSpeed config enables {enabled} but {whose} is {precision!r}: set \"enabled\": "
                         f"\"auto\" in the config, or use {set_it.format(p=enabled)} / "
                         f"`cadence launch --mixed_precision {enabled}`")
    said = (config.get(precision) or {}).get("enabled", AUTO) if precision in ("bf16", "fp16") else AUTO
    if not is_auto(said) and not as_flag(said):   # "enabled": false, said in so many words
        raise ValueError(f'the DeepSpeed config sets "{precision}": {{"enabled": false}} but {whose} is '
                         f'{precision!r}: DeepSpeed would train in fp32 under {precision} autocast. Set "enabled": '
                         f'"auto" (or true) in the config, or train in fp32 ({fp32})')


def engine_config(config: dict, precision: str, micro_batch: int) -> dict:
    """The config DeepSpeed is built with: "auto" batch sizes, accumulation, clipping and precision filled.

    >>> engine_config(build_config(), "bf16", micro_batch=8)["bf16"]
    {'enabled': True}
    """
    cfg = copy.deepcopy(config)
    ga = 1 if is_auto(cfg["gradient_accumulation_steps"]) else int(cfg["gradient_accumulation_steps"])
    cfg["gradient_accumulation_steps"] = ga
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    cfg["train_batch_size"] = micro_batch * ga * env.world_size()
    if is_auto(cfg["gradient_clipping"]):
        cfg["gradient_clipping"] = 0.0
    check_precision(cfg, precision)
    for name in ("bf16", "fp16"):
        section = cfg.get(name)
        if section is not None and is_auto(section.get("enabled", AUTO)):
            section["enabled"] = precision == name
        elif section is None and precision == name:
            cfg[name] = {"enabled": True}
    if precision == "fp16":
        check_fp16_supported()
    return cfg


def check_fp16_supported() -> None:
    """fp16 where DeepSpeed's accelerator has it. Its CPU accelerator has it only with oneDNN's fp16 (AVX512-FP16 or
    AMX-FP16); elsewhere the engine fails with "Type fp16 is not supported on your device": say what to use instead."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if not accelerator.is_fp16_supported():
        raise ValueError(f"DeepSpeed cannot train in fp16 on this machine (its {accelerator.device_name()} accelerator "
                         f"has no fp16 support): use bf16 on CPU (MixedPrecision('bf16'), learn.to_bf16() or "
                         f"`cadence launch --mixed_precision bf16`), or fp32")


BUCKETS = {"reduce_bucket_size": int(5e8), "allgather_bucket_size": int(5e8), "stage3_prefetch_bucket_size": int(5e7)}
BUCKET_ALIGNMENT = 2  # ZeRO-1/2 assert allgather_bucket_size is a multiple of its 4-byte alignment in fp16 elements


def largest_layer(model: nn.Module) -> int:
    """Parameters of the largest module's own parameters (a transformer layer's matrix: Accelerate's hidden_size²)."""
    return max((sum(getattr(p, "ds_numel", p.numel()) for p in m.parameters(recurse=False)) for m in model.modules()),
               default=1)


def fit_buckets(zero: dict, layer_params: int) -> None:
    """Communication buckets of one layer's size (Accelerate fills "auto" with hidden_size²): DeepSpeed's defaults
    allocate 5e8 elements (ZeRO-3: 1.9 GiB in fp32) however small the model. A number the config gives is kept."""
    for key, default in BUCKETS.items():
        if is_auto(zero.get(key, AUTO)):
            zero[key] = min(default, max(1, -(-layer_params // BUCKET_ALIGNMENT)) * BUCKET_ALIGNMENT)


def has_auto(value: Any) -> bool:
    if isinstance(value, dict):
        return any(has_auto(v) for v in value.values())
    return is_auto(value)


def optimizer_entry(opt: torch.optim.Optimizer) -> dict:
    """A config `optimizer` block with `opt`'s hyper-parameters (offload needs DeepSpeed's own CPU Adam)."""
    kind = type(opt).__name__
    if kind not in ("Adam", "AdamW"):
        raise ValueError(f"DeepSpeed optimizer offload steps with its CPU Adam; the Learner's optimizer is {kind}: "
                         f"use opt_func=torch.optim.AdamW (or Adam), or name an optimizer in the DeepSpeed config")
    d = opt.defaults
    return {"type": kind, "params": {"lr": d["lr"], "betas": list(d["betas"]), "eps": d["eps"],
                                     "weight_decay": d["weight_decay"]}}


def fill_optimizer(section: dict, opt: torch.optim.Optimizer) -> None:
    """Fill a config optimizer's "auto" hyper-parameters from the optimizer given (the Learner's, or an
    Accelerate script's optimizer or `DummyOptim`)."""
    d = opt.defaults
    known = {"lr": d.get("lr"), "betas": list(d["betas"]) if "betas" in d else None, "eps": d.get("eps"),
             "weight_decay": d.get("weight_decay"), "momentum": d.get("momentum")}
    for key, value in section.setdefault("params", {}).items():
        if is_auto(value):
            if known.get(key) is None:
                raise ValueError(f"DeepSpeed optimizer {section.get('type')}: the optimizer given, "
                                 f"{type(opt).__name__}, has no {key} to fill \"auto\" with; give a number")
            section["params"][key] = known[key]


def fill_scheduler(section: dict, total_steps: int, warmup_steps: int | None, lr: float) -> tuple[str, dict]:
    """(type, params) of a config scheduler, its "auto" values filled from the fit's steps (warm-up: a tenth of
    them unless given) and the optimizer's `lr`."""
    params = copy.deepcopy(section.get("params", {}))
    warmup = max(1, total_steps // 10) if warmup_steps is None else warmup_steps
    fill = {"total_num_steps": total_steps, "warmup_num_steps": warmup, "warmup_max_lr": lr,
            "warmup_min_lr": 0.0, "cycle_max_lr": lr, "cycle_min_lr": lr / 25}
    for key, value in params.items():
        if is_auto(value):
            if key not in fill:
                raise ValueError(f"DeepSpeed scheduler {section.get('type')}: cadence cannot fill {key}=\"auto\"; "
                                 f"give a number")
            params[key] = fill[key]
    return section["type"], params
