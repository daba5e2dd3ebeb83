"""The one place that maps strategy names to classes: "ddp", "fsdp", "dp", "deepspeed", "model_parallel", "xla".

>>> strategy = get_strategy("ddp", sync_bn=False)
>>> get_strategy(None)      # $CADENCE_STRATEGY, set by `cadence launch`; "ddp" when unset
"""

from __future__ import annotations

import importlib
import inspect
import os

from .strategy import Strategy

# name -> "module:Class", imported on first use so optional engines cost nothing until asked for
STRATEGIES = {
    "ddp": "cadence.distributed.ddp:DDP",
    "fsdp": "cadence.distributed.fsdp:FSDP",
    "dp": "cadence.distributed.dp:DataParallel",
    "deepspeed": "cadence.distributed.deepspeed:DeepSpeed",
    "model_parallel": "cadence.distributed.model_parallel:ModelParallel",
    "xla": "cadence.distributed.xla:XLA",  # opt-in only: never chosen because torch_xla is importable
}


def _name(name: str | None) -> str:
    name = (name or os.environ.get("CADENCE_STRATEGY") or "ddp").lower()
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {sorted(STRATEGIES)}")
    return name


def strategy_class(name: str | Strategy | None = None, options: dict | None = None) -> type[Strategy] | None:
    """The class `get_strategy(name, **options)` would build; None for a Strategy instance. "model_parallel" with
    `pp_size` > 1 (in `options`, else the launcher's parallelism_config) is its pipeline engine, `Pipeline`.

    >>> strategy_class("ddp").__name__
    'DDP'
    """
    if isinstance(name, Strategy):
        return None
    if _name(name) == "model_parallel" and _pipelined(options or {}):
        return _load(PIPELINE)
    return _load(STRATEGIES[_name(name)])


def _load(path: str) -> type[Strategy]:
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


# "model_parallel" with pp_size > 1 (given, or the launcher's parallelism_config) is its pipeline engine, a subclass
PIPELINE = "cadence.distributed.pipeline:Pipeline"


def _pipelined(options: dict) -> bool:
    from .model_parallel import _launcher_sizes

    pp_size = options.get("pp_size")
    return int(_launcher_sizes().get("pp_size", 1) if pp_size is None else pp_size) > 1


def get_strategy(name: str | Strategy | None = None, **kwargs) -> Strategy:
    """A Strategy instance from its name (or `$CADENCE_STRATEGY`, default "ddp"), built with `kwargs`.

    A Strategy instance passes through unchanged (kwargs are then refused). Engine options from the
    launcher's config (`$CADENCE_FSDP_CONFIG`) are read by the engine itself.
    """
    if isinstance(name, Strategy):
        if kwargs:
            raise ValueError(f"got a Strategy instance and options {sorted(kwargs)}: give the options to its constructor")
        return name
    cls = strategy_class(name, kwargs)
    refuse_unknown_options(_name(name), cls, kwargs)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise TypeError(f"strategy {_name(name)!r} ({cls.__name__}) does not take these options: {e}") from None


def refuse_unknown_options(name: str, cls: type[Strategy], options: dict) -> None:
    """TypeError naming the strategy, the options it takes and, for each it does not, the strategies that do, when
    `cls` (strategy `name`) names its options (no `**kwargs`: an engine that takes more checks them itself).

    >>> refuse_unknown_options("dp", _load(STRATEGIES["dp"]), {"zero_stage": 2})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    TypeError: strategy 'dp' (DataParallel) does not take zero_stage: it takes device, device_ids; zero_stage is an option of strategy 'deepspeed'; DeepSpeed options do not apply to strategy 'dp'
    """
    taken = _options(cls)
    if taken is None or not (unknown := [k for k in options if k not in taken]):
        return
    named = {other: _options(_loaded(other), named_only=True) or [] for other in STRATEGIES if other != name}
    owners = {k: [other for other, taken_there in named.items() if k in taken_there] for k in unknown}
    hints = [f"{k} is an option of strategy {' / '.join(repr(o) for o in found)}; "
             f"{' / '.join(_loaded(o).__name__ for o in found)} options do not apply to strategy {name!r}"
             for k, found in owners.items() if found]
    raise TypeError(f"strategy {name!r} ({cls.__name__}) does not take {', '.join(unknown)}: it takes "
                    f"{', '.join(taken) or 'no options'}" + "".join(f"; {h}" for h in hints))


def _options(cls: type | None, named_only: bool = False) -> list[str] | None:
    """The keyword options `cls(...)` names; None when it takes any (`**kwargs`, unless `named_only`) or cannot be
    told."""
    if cls is None:
        return None
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return None
    if not named_only and any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _loaded(name: str) -> type | None:
    """Strategy `name`'s class, or None where its module cannot be imported here (a missing optional engine)."""
    try:
        return _load(STRATEGIES[name])
    except Exception:
        return None
