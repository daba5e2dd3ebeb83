"""How `Accelerator.prepare` hands the user's objects to the strategy, and the options it builds the strategy with.

- optimizers built over the plain model are pointed at the wrapped model's parameters (by name);
- with mixed precision a model's forward runs in the strategy's autocast, outputs back in fp32;
- `split_batches` loaders are rebuilt with the per-process batch size;
- kwargs handlers are sorted by kind; DDP's go to an engine that takes them;
- a scheduler built before `prepare` is fitted to the groups the engine kept (DeepSpeed drops empty ones).

>>> strategy = make_strategy("ddp", cpu=False, ddp=DistributedDataParallelKwargs(bucket_cap_mb=50))
"""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from ..distributed import env, ops
from ..distributed.deepspeed_config import check_precision, configured_precision, engine_config
from ..loader_settings import loader_settings
from ..distributed.registry import get_strategy, strategy_class
from ..distributed.transformers_zero3 import tell_transformers
from .handlers import (AutocastKwargs, DistributedDataParallelKwargs, DummyOptim, GradScalerKwargs,
                       InitProcessGroupKwargs, ProfileKwargs)
from .plugins import DeepSpeedPlugin, FullyShardedDataParallelPlugin

__all__ = ["sort_handlers", "choose_engine", "make_strategy", "optimizes", "retarget", "owns_parameters", "owning_model",
           "covers_trainable", "autocast_forward", "restore_forward", "all_tensors", "split_loader",
           "fit_scheduler_to_groups", "refuse_unsupported", "one_deepspeed_plugin", "check_rng_types",
           "deepspeed_precision", "tell_transformers_zero3"]

_HANDLERS = (AutocastKwargs, DistributedDataParallelKwargs, GradScalerKwargs, InitProcessGroupKwargs, ProfileKwargs)


def sort_handlers(kwargs_handlers: list | None) -> dict[type, Any]:
    found: dict[type, Any] = {}
    for h in kwargs_handlers or []:
        if not isinstance(h, _HANDLERS):
            raise TypeError(f"kwargs_handlers takes {[c.__name__ for c in _HANDLERS]} instances, got {h!r}")
        if type(h) in found:
            raise ValueError(f"two {type(h).__name__} in kwargs_handlers; merge them into one")
        found[type(h)] = h
    return found


def choose_engine(strategy: Any, fsdp_plugin: FullyShardedDataParallelPlugin | None,
                  deepspeed_plugin: DeepSpeedPlugin | None) -> tuple[Any, dict[str, Any]]:
    """The strategy (name or instance) and its options, from `strategy=` or a plugin, as Accelerate decides.

    A `deepspeed_plugin` means DeepSpeed. An `fsdp_plugin` means FSDP on several processes (on one,
    Accelerate runs without it, and so does cadence), unless the launcher chose DeepSpeed, which Accelerate
    lets win: a warning says the plugin is not used.
    """
    for given, kind in ((fsdp_plugin, FullyShardedDataParallelPlugin), (deepspeed_plugin, DeepSpeedPlugin)):
        if given is not None and not isinstance(given, kind):
            raise TypeError(f"{kind.__name__} expected, got {type(given).__name__}")
    if strategy is not None and (fsdp_plugin or deepspeed_plugin):
        raise ValueError("give either strategy= or fsdp_plugin= / deepspeed_plugin=, not both")
    if fsdp_plugin is not None and deepspeed_plugin is not None:
        raise ValueError("fsdp_plugin and deepspeed_plugin both given: choose one engine")
    if deepspeed_plugin is not None:
        return "deepspeed", deepspeed_plugin.strategy_options()
    launched = (os.environ.get("CADENCE_STRATEGY") or "").lower()
    if fsdp_plugin is not None and launched == "deepspeed":
        warnings.warn("fsdp_plugin is not used: the launcher chose DeepSpeed (as Accelerate does); launch with "
                      "--use_fsdp to train with FSDP", stacklevel=3)
    elif fsdp_plugin is not None and env.world_size() > 1:
        return "fsdp", fsdp_plugin.strategy_options()
    return strategy, {}


def make_strategy(name: Any, cpu: bool, ddp: DistributedDataParallelKwargs | None,
                  engine_options: dict[str, Any] | None = None) -> Any:
    """The registry's strategy with `engine_options`; DDP's options go to an engine whose constructor takes them,
    with a warning otherwise (Accelerate, too, uses them only under DDP)."""
    options = dict(ddp.to_kwargs()) if ddp is not None else {}
    if cpu:
        options["device"] = "cpu"
    cls = strategy_class(name)
    if cls is not None:
        params = inspect.signature(cls).parameters
        takes_ddp = "comm_hook" in params   # DDP's interface: comm_hook plus DistributedDataParallel's keywords
        dropped = [k for k in options if k != "device" and not takes_ddp]
        if dropped:
            warnings.warn(f"strategy {cls.__name__} takes no {dropped}; DistributedDataParallelKwargs options "
                          f"are DDP's and are ignored here", stacklevel=3)
        options = {k: v for k, v in options.items() if k not in dropped}
    elif options:
        raise ValueError("give a Strategy instance its options yourself, not through kwargs_handlers/cpu")
    return get_strategy(name, **options, **(engine_options or {}))


def optimizes(opt: Any, model: nn.Module) -> bool:
    """Does `opt` (a torch optimizer or a DummyOptim) hold parameters of `model`?"""
    groups = opt.param_groups if not isinstance(opt, DummyOptim) else (
        opt.params if opt.params and isinstance(opt.params[0], dict) else [{"params": opt.params}])
    mine = {id(p) for p in model.parameters()}
    return any(id(p) in mine for g in groups for p in g["params"])


def retarget(opt: Any, names: dict[int, str], params: dict[str, nn.Parameter]) -> None:
    """Point `opt`'s parameter groups at the wrapped model's parameters (FSDP replaces them by sharded ones)."""
    if isinstance(opt, DummyOptim):
        return
    for group in opt.param_groups:
        group["params"] = [params.get(names.get(id(p)), p) for p in group["params"]]


def owns_parameters(model: nn.Module, params: list, strategy: Any) -> bool:
    mine = {id(p) for p in strategy.unwrap(model).parameters()}
    return bool(params) and id(params[0]) in mine


def owning_model(acc: Any, opt: Any) -> Any:
    """The prepared model holding `opt`'s parameters, or None."""
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    return next((m for m in acc._models if held & {id(p) for p in acc.strategy.unwrap(m).parameters()}), None)


def covers_trainable(model: nn.Module, params: list, strategy: Any) -> bool:
    """Do `params` hold every trainable parameter of the prepared `model` (not just a part of it)?"""
    given = {id(p) for p in params}
    return all(id(p) in given for p in strategy.unwrap(model).parameters() if p.requires_grad)


def autocast_forward(module: nn.Module, context: Callable[[], Any]) -> None:
    """Run `module`'s forward in the precision context, outputs back in fp32 (Accelerate does the same)."""
    if "_cadence_plain_forward" in module.__dict__:
        return
    plain = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with context():
            out = plain(*args, **kwargs)
        return ops.map_tensors(lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t, out)
    module._cadence_plain_forward = plain
    module.forward = forward


def restore_forward(module: nn.Module) -> None:
    plain = module.__dict__.pop("_cadence_plain_forward", None)
    if plain is not None:
        module.forward = plain


def all_tensors(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, dict):
        return all(all_tensors(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return all(all_tensors(v) for v in data)
    return False


def split_loader(dl: DataLoader, n: int) -> DataLoader:
    """`split_batches=True`: the loader's batch size is the global batch; each process takes 1/n of it.

    The loader is rebuilt with batches of batch_size / n drawn by its own sampler (a WeightedRandomSampler, a
    RandomSampler with its `generator`, ...) and its workers' settings (`worker_init_fn`, ...); the shards then
    deal those batches to the processes in turn, so process i gets the i-th part of each global batch.
    """
    if dl.batch_size is None:
        raise ValueError("split_batches=True splits a loader's batch_size, and this loader has a batch_sampler: give "
                         "the DataLoader a batch_size (and a sampler), or use split_batches=False")
    if dl.batch_size % n:
        raise ValueError(f"split_batches=True needs a batch size divisible by the {n} processes, "
                         f"got {dl.batch_size}; use a multiple of {n}")
    order = {} if isinstance(dl.dataset, IterableDataset) else {"sampler": dl.sampler}  # a stream orders itself
    return DataLoader(dl.dataset, batch_size=dl.batch_size // n, drop_last=dl.drop_last, generator=dl.generator,
                      **order, **loader_settings(dl))


# the per-parameter-group lists of torch's schedulers (one entry per group, in the optimizer's order)
_PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas", "min_lrs", "max_lrs", "base_momentums", "max_momentums")


def fit_scheduler_to_groups(scheduler: Any, sizes: list[int], groups: list[dict]) -> None:
    """Drop a scheduler's entries for the parameter groups the engine dropped.

    DeepSpeed removes the optimizer's empty groups in place (`deepspeed.initialize`), e.g. the no-decay
    group of a model without biases; a scheduler built before `prepare` still holds one lr per group given,
    and torch refuses to step it. `sizes` are the groups' lengths when given; the empty ones are gone.
    """
    if len(sizes) == len(groups):
        return
    kept = [i for i, n in enumerate(sizes) if n]
    if len(kept) != len(groups):
        raise ValueError(f"the engine changed the optimizer's parameter groups from {len(sizes)} to {len(groups)} "
                         f"(not by dropping the empty ones); build the scheduler after accelerator.prepare")
    for sched in [scheduler, *getattr(scheduler, "_schedulers", [])]:   # SequentialLR / ChainedScheduler hold several
        for name in _PER_GROUP:
            values = getattr(sched, name, None)
            if isinstance(values, list) and len(values) == len(sizes):
                setattr(sched, name, [values[i] for i in kept])


# What to use instead of Accelerate's tensor-parallel / Megatron-LM plugins (also cadence.utils.unavailable's wording)
MODEL_PARALLEL_HINT = ("tensor and sequence parallelism are cadence's model_parallel strategy: "
                       "Accelerator(parallelism_config=ParallelismConfig(tp_size=N)), or `cadence launch "
                       "--use_parallelism_config --parallelism_config_tp_size N`")


def refuse_unsupported(torch_tp_plugin: Any, megatron_lm_plugin: Any) -> None:
    """Accelerate's constructor arguments cadence has no engine for: a clear error, never ignored."""
    if megatron_lm_plugin is not None:
        raise ValueError(f"megatron_lm_plugin: Megatron-LM is not part of cadence; {MODEL_PARALLEL_HINT}")
    if torch_tp_plugin is not None:
        raise ValueError(f"torch_tp_plugin: {MODEL_PARALLEL_HINT}")


def one_deepspeed_plugin(deepspeed_plugin: Any, deepspeed_plugins: Any) -> Any:
    """`deepspeed_plugins` (Accelerate: one plugin per model, by name) holding one plugin is that plugin; several
    are refused (cadence's DeepSpeed strategy runs one engine)."""
    if deepspeed_plugins is None:
        return deepspeed_plugin
    if deepspeed_plugin is not None:
        raise ValueError("give deepspeed_plugin or deepspeed_plugins, not both")
    plugins = list(deepspeed_plugins.values()) if isinstance(deepspeed_plugins, dict) else [deepspeed_plugins]
    if len(plugins) != 1:
        raise ValueError(f"deepspeed_plugins with {len(plugins)} plugins: cadence's DeepSpeed strategy runs one engine "
                         f"for every prepared model; give one DeepSpeedPlugin")
    return plugins[0]


def check_rng_types(rng_types: list | None) -> list[str]:
    """The random states prepared loaders give every process from the main one at each iteration ("torch", "cuda");
    "generator" (the sampler's) is given at `prepare`, after which every process draws alike."""
    names = [getattr(t, "value", t) for t in (rng_types or ["generator"])]
    unknown = [n for n in names if n not in ("torch", "cuda", "generator")]
    if unknown:
        raise ValueError(f"rng_types {unknown}: cadence synchronises 'torch', 'cuda' and 'generator'; drop the others")
    return [n for n in names if n != "generator"]


def deepspeed_precision(strategy: Any, requested: str) -> str:
    """The Accelerator's mixed precision under the DeepSpeed `strategy`, as Accelerate decides it: "no" (none given,
    or the launcher's default) takes the precision its config turns on; "bf16"/"fp16" must agree with the config
    (refused otherwise, the process group the strategy set up taken down again).

    >>> deepspeed_precision(DeepSpeed(config={"bf16": {"enabled": True}}), "no")
    'bf16'
    """
    config = strategy.config
    precision = (configured_precision(config) or "no") if requested == "no" else requested
    try:
        check_precision(config, precision, api="accelerator")
    except ValueError:
        strategy.teardown()
        raise
    return precision


def tell_transformers_zero3(plugin: DeepSpeedPlugin, strategy: Any, precision: str) -> Any:
    """With the plugin's `zero3_init_flag` (on by default under ZeRO-3), transformers is told ZeRO-3 is on, as
    Accelerate's `HfDeepSpeedConfig` tells it: the models it builds from now on (`from_pretrained`, `from_config`)
    are partitioned as they are built, in the engine's dtype, and `prepare` takes them as they are. Transformers
    holds the returned object weakly: keep it."""
    if not (plugin.zero3_init_flag and strategy.stage == 3):
        return None
    return tell_transformers(engine_config(strategy.config, precision, micro_batch=1))
