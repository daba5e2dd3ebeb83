"""Accelerate's configuration dataclasses, mapped onto cadence's engines and loaders.

- `DistributedType`: Accelerate's enum; `accelerator.distributed_type` is read off the strategy.
- `DataLoaderConfiguration`: how `prepare` shards loaders (cadence's `DistributedDL` semantics).
- `GradientAccumulationPlugin`: the accumulation window of `accelerator.accumulate`.
- `FullyShardedDataParallelPlugin` / `DeepSpeedPlugin`: options for cadence's FSDP2 and DeepSpeed strategies.

Each value is either honoured or refused with what to change; none is dropped silently.

>>> accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True),
...                           fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["GPT2Block"]))
>>> accelerator.distributed_type == DistributedType.FSDP      # on 2 processes
True
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import json
import os
from dataclasses import dataclass, field, fields
from typing import Any, Iterator

import torch

__all__ = ["DistributedType", "DataLoaderConfiguration", "GradientAccumulationPlugin",
           "FullyShardedDataParallelPlugin", "DeepSpeedPlugin", "distributed_type_of"]


class DistributedType(str, enum.Enum):
    """Accelerate's kind of distributed run (a `str`, so `== "MULTI_GPU"` and JSON work).

    cadence's strategies map to it: DDP (and DataParallel) on N > 1 processes -> `MULTI_<DEVICE>`
    (`MULTI_CPU`, `MULTI_GPU`, `MULTI_XPU`, ...), FSDP and model_parallel (TP in FSDP2) -> `FSDP`,
    DeepSpeed -> `DEEPSPEED`, XLA -> `XLA`, DDP on one process -> `NO`.

    >>> DistributedType.MULTI_GPU == "MULTI_GPU"
    True
    """

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


# strategies that are their own kind whatever the process count (Accelerate reports FSDP/DEEPSPEED on one GPU too);
# model_parallel is TP inside FSDP2, which Accelerate (ParallelismConfig with FSDP2) reports as FSDP
_ENGINE_TYPES = {"fsdp": DistributedType.FSDP, "model_parallel": DistributedType.FSDP,
                 "deepspeed": DistributedType.DEEPSPEED, "xla": DistributedType.XLA}
_DEVICE_TYPES = {"cpu": DistributedType.MULTI_CPU, "cuda": DistributedType.MULTI_GPU, "xpu": DistributedType.MULTI_XPU,
                 "npu": DistributedType.MULTI_NPU, "mlu": DistributedType.MULTI_MLU, "hpu": DistributedType.MULTI_HPU,
                 "musa": DistributedType.MULTI_MUSA, "sdaa": DistributedType.MULTI_SDAA,
                 "neuron": DistributedType.MULTI_NEURON}


def distributed_type_of(strategy_name: str, device: torch.device, num_processes: int) -> DistributedType:
    """Accelerate's `DistributedType` for a cadence strategy on `device` with `num_processes`.

    >>> distributed_type_of("ddp", torch.device("cpu"), 2)
    <DistributedType.MULTI_CPU: 'MULTI_CPU'>
    """
    if strategy_name in _ENGINE_TYPES:
        return _ENGINE_TYPES[strategy_name]
    if num_processes <= 1:
        return DistributedType.NO
    return _DEVICE_TYPES.get(device.type, DistributedType.MULTI_GPU)


@dataclass
class DataLoaderConfiguration:
    """How `prepare` turns loaders into per-process shards (Accelerate's fields).

    - `split_batches`: the loader's batch size is the global one, split between the processes.
    - `even_batches=True` (the only layout cadence has): the loader's batches are dealt to the
      processes in turn, the last step completed from the start of the epoch, and
      `gather_for_metrics` drops those duplicates; False is refused.
    - `dispatch_batches`: every process loads its own shard (None/False); True (rank 0 loads and
      sends) is refused.
    - `use_seedable_sampler=False`: the batches and their order are Accelerate's for a script seeded
      the same way (`accelerate.loaders`); True: each epoch's permutation is seeded with `data_seed`
      (else the seed `set_seed` gave) plus the epoch, as Accelerate's seedable sampler does. `data_seed`
      alone seeds cadence's permutation. `use_stateful_dataloader`: cadence's loaders always resume mid-epoch.
    - `non_blocking`: host-to-device copies of batches are non-blocking.

    >>> Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True, data_seed=42))
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def __post_init__(self):
        if self.dispatch_batches:
            raise ValueError("DataLoaderConfiguration(dispatch_batches=True): cadence loads on every process, each its "
                             "own shard (an IterableDataset included); drop dispatch_batches")
        if not self.even_batches:
            raise ValueError("DataLoaderConfiguration(even_batches=False): cadence's shards always have the same "
                             "number of batches (the last completed from the start, removed again by "
                             "gather_for_metrics); drop even_batches=False")
        if self.data_seed is not None and not isinstance(self.data_seed, int):
            raise TypeError(f"DataLoaderConfiguration(data_seed={self.data_seed!r}): give an int or None")


@dataclass
class GradientAccumulationPlugin:
    """The accumulation window of `accelerator.accumulate` (Accelerate's fields).

    `num_steps` micro-batches per optimizer step; `sync_each_batch=True` all-reduces every micro-batch
    (less memory under DDP/FSDP, same result); `adjust_scheduler` is what prepared schedulers do
    anyway (they step once per optimizer step). `sync_with_dataloader=False` is refused: a loader's
    last batch always ends the window.

    >>> Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=4, sync_each_batch=True))
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self):
        if self.num_steps is not None and (not isinstance(self.num_steps, int) or self.num_steps < 1):
            raise ValueError(f"GradientAccumulationPlugin(num_steps={self.num_steps!r}): give a positive int")
        if not self.sync_with_dataloader:
            raise ValueError("GradientAccumulationPlugin(sync_with_dataloader=False): cadence always ends the "
                             "accumulation window on a loader's last batch; drop sync_with_dataloader=False")


def _name_of(value: Any) -> Any:
    """An enum (torch's ShardingStrategy, StateDictType) or an Accelerate string, as cadence's option value."""
    return value.name if isinstance(value, enum.Enum) else value


@dataclass
class FullyShardedDataParallelPlugin:
    """Options for cadence's FSDP2 strategy, under Accelerate's names.

    Mapped: `sharding_strategy` (or `reshard_after_forward`: True = FULL_SHARD, False = SHARD_GRAD_OP),
    `auto_wrap_policy` ("transformer_based_wrap", "size_based_wrap", "no_wrap"),
    `transformer_cls_names_to_wrap`, `min_num_params`, `cpu_offload`, `activation_checkpointing`,
    `cpu_ram_efficient_loading`, `state_dict_type`. `state_dict_config` / `optim_state_dict_config`
    say how FSDP1 gathers a full state dict; cadence gathers it on the CPU of the main process, the
    same weights, so they are accepted. `fsdp_version` 1 or 2 both run FSDP2. `backward_prefetch`,
    `forward_prefetch`, `use_orig_params`, `sync_module_states`, `limit_all_gathers` are FSDP1
    knobs that FSDP2 makes moot. Precision comes from `Accelerator(mixed_precision=...)`:
    a `mixed_precision_policy`, `ignored_modules`, `param_init_fn`, a callable `auto_wrap_policy`
    and `activation_checkpointing_offload` are refused.

    >>> plugin = FullyShardedDataParallelPlugin(sharding_strategy="SHARD_GRAD_OP", transformer_cls_names_to_wrap=["Block"])
    >>> Accelerator(fsdp_plugin=plugin)     # FSDP when launched on several processes
    """

    fsdp_version: int = 2
    sharding_strategy: Any = None
    reshard_after_forward: Any = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Any = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: bool | None = None
    param_init_fn: Any = None
    sync_module_states: bool | None = None
    forward_prefetch: bool = False
    activation_checkpointing: bool = False
    activation_checkpointing_offload: bool = False
    cpu_ram_efficient_loading: bool | None = None
    transformer_cls_names_to_wrap: Any = None
    min_num_params: int | None = None

    def __post_init__(self):
        if self.fsdp_version not in (1, 2):
            raise ValueError(f"FullyShardedDataParallelPlugin(fsdp_version={self.fsdp_version!r}): use 1 or 2 "
                             f"(cadence runs FSDP2 for both)")
        refused = {"mixed_precision_policy": "set Accelerator(mixed_precision='bf16'|'fp16')",
                   "ignored_modules": "freeze those parameters (requires_grad=False) instead",
                   "param_init_fn": "build the model under accelerator's init context, or use cpu_ram_efficient_loading",
                   "activation_checkpointing_offload": "use activation_checkpointing=True without offload"}
        for name, fix in refused.items():
            if getattr(self, name):
                raise ValueError(f"FullyShardedDataParallelPlugin({name}=...): cadence's FSDP2 cannot honour it; {fix}")
        if callable(self.auto_wrap_policy):
            raise ValueError("FullyShardedDataParallelPlugin(auto_wrap_policy=<callable>): give 'transformer_based_wrap' "
                             "with transformer_cls_names_to_wrap, 'size_based_wrap' with min_num_params, or 'no_wrap'")
        if self.sharding_strategy is not None and self.reshard_after_forward is not None:
            raise ValueError("FullyShardedDataParallelPlugin: give sharding_strategy or reshard_after_forward, not both")
        self.strategy_options()   # bad names fail here, not at prepare

    @classmethod
    def from_launcher(cls) -> FullyShardedDataParallelPlugin:
        """The plugin `cadence launch --use_fsdp ...` (`$CADENCE_FSDP_CONFIG`, Accelerate's `fsdp_config` keys) stands
        for: what `accelerator.state.fsdp_plugin` holds when the launcher chose FSDP, as Accelerate builds it from
        its environment.

        >>> FullyShardedDataParallelPlugin.from_launcher().state_dict_type   # under `--fsdp_state_dict_type ...`
        """
        raw = {k.removeprefix("fsdp_"): v for k, v in json.loads(os.environ.get("CADENCE_FSDP_CONFIG") or "{}").items()}
        renamed = {"version": "fsdp_version", "transformer_layer_cls_to_wrap": "transformer_cls_names_to_wrap",
                   "offload_params": "cpu_offload"}   # Accelerate's config keys that name a field otherwise
        known = {f.name for f in fields(cls) if f.init}
        options = {renamed.get(k, k): v for k, v in raw.items() if renamed.get(k, k) in known and v is not None}
        from ..distributed.deepspeed_config import as_flag

        for name in ("cpu_offload", "activation_checkpointing", "cpu_ram_efficient_loading", "use_orig_params",
                     "sync_module_states", "forward_prefetch", "limit_all_gathers", "reshard_after_forward"):
            if isinstance(options.get(name), str):
                options[name] = as_flag(options[name])   # a config file's "false" is False
        if "sharding_strategy" in options:   # the launcher takes both, the strategy the first (the plugin refuses both)
            options.pop("reshard_after_forward", None)
        return cls(**options)

    def strategy_options(self) -> dict[str, Any]:
        """The keyword arguments of cadence's `FSDP` strategy that this plugin stands for (checked by it).

        >>> FullyShardedDataParallelPlugin(cpu_offload=True).strategy_options()
        {'offload_params': True}
        """
        sharding = _name_of(self.sharding_strategy)
        if isinstance(self.reshard_after_forward, bool):
            sharding = "FULL_SHARD" if self.reshard_after_forward else "SHARD_GRAD_OP"
        elif self.reshard_after_forward is not None:
            sharding = _name_of(self.reshard_after_forward)
        offload = self.cpu_offload
        offload = getattr(offload, "offload_params", offload)   # torch's CPUOffload / CPUOffloadPolicy
        options = {"sharding_strategy": sharding, "offload_params": None if offload is None else bool(offload),
                   "auto_wrap_policy": None if self.auto_wrap_policy is None else str(self.auto_wrap_policy).upper(),
                   "transformer_layer_cls_to_wrap": self.transformer_cls_names_to_wrap,
                   "min_num_params": self.min_num_params,
                   "activation_checkpointing": self.activation_checkpointing or None,
                   "cpu_ram_efficient_loading": self.cpu_ram_efficient_loading,
                   "state_dict_type": _name_of(self.state_dict_type)}
        options = {k: v for k, v in options.items() if v is not None}
        from ..distributed.fsdp import FSDP

        FSDP(device="cpu", **options)   # the strategy's own checks (names, policies) on this plugin's values
        return options


@dataclass
class DeepSpeedPlugin:
    """Options for cadence's DeepSpeed strategy, under Accelerate's names.

    `hf_ds_config` is DeepSpeed's config (a dict or a JSON file); the other fields are the
    launcher's `deepspeed_config` keys and fill what it leaves out. `deepspeed_config` is the
    config as cadence builds it ("auto" values are filled when the engine is built). A config that turns bf16
    or fp16 on sets the Accelerator's `mixed_precision` when none is given, as in Accelerate. `zero3_init_flag`
    (ZeRO-3; on by default there when transformers is installed, as in Accelerate, which raises without it) tells
    transformers ZeRO-3 is on from the Accelerator's creation:
    the models it builds after (`from_pretrained`, `from_config`) are partitioned as they are built
    (`zero3_init_context_manager(enable=False)` builds them whole; `zero3_init_flag=False` always).

    >>> plugin = DeepSpeedPlugin(zero_stage=2, gradient_clipping=1.0)
    >>> Accelerator(deepspeed_plugin=plugin)
    >>> "optimizer" in accelerator.state.deepspeed_plugin.deepspeed_config
    False
    """

    hf_ds_config: Any = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float | None = None
    zero_stage: int | None = None
    is_train_batch_min: bool = True
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None
    transformer_moe_cls_names: str | None = None
    deepspeed_config: dict = field(default_factory=dict, init=False, repr=False)
    dschf: Any = field(default=None, init=False, repr=False)   # what tells transformers ZeRO-3 is on (zero3_init_flag)

    def __post_init__(self):
        if self.transformer_moe_cls_names is not None:
            raise ValueError("DeepSpeedPlugin(transformer_moe_cls_names=...): cadence's DeepSpeed strategy has no MoE "
                             "leaf modules; drop it")
        from ..distributed.deepspeed import build_config
        from ..distributed.deepspeed_config import as_flag

        options = self.strategy_options()
        options.pop("zero3_init_flag", None)
        self.deepspeed_config = build_config(options.pop("config", None), **options)
        has_transformers = importlib.util.find_spec("transformers") is not None
        if self.zero3_init_flag is None:   # Accelerate's default: on under ZeRO-3 (where transformers can be told)
            self.zero3_init_flag = (self.deepspeed_config.get("zero_optimization", {}).get("stage") == 3
                                    and has_transformers)
        else:
            self.zero3_init_flag = as_flag(self.zero3_init_flag)   # the launcher's "true" / "false" too
        if self.zero3_init_flag and not has_transformers:   # asked for in so many words: before anything is built
            raise ImportError("zero3_init_flag builds transformers models partitioned, and transformers is not "
                              "installed: pip install transformers, or drop zero3_init_flag (build the model under "
                              "deepspeed.zero.Init yourself)")

    def strategy_options(self) -> dict[str, Any]:
        """The keyword arguments of cadence's `DeepSpeed` strategy that this plugin stands for."""
        names = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
                 "offload_param_device", "offload_optimizer_nvme_path", "offload_param_nvme_path", "zero3_init_flag",
                 "zero3_save_16bit_model")
        options = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
        if self.hf_ds_config is not None:
            options["config"] = self.hf_ds_config
        return options

    def is_zero3_init_enabled(self) -> bool:
        """Whether models transformers builds after the Accelerator are partitioned as they are built."""
        return self.dschf is not None

    @contextlib.contextmanager
    def zero3_init_context_manager(self, enable: bool = False) -> Iterator[None]:
        """`enable=False`: transformers builds models whole in this block although `zero3_init_flag` is on, e.g. a
        reload on the main process alone (a partitioned build runs collectives every process must join).

        >>> with accelerator.state.deepspeed_plugin.zero3_init_context_manager(enable=False):
        ...     reloaded = AutoModelForCausalLM.from_pretrained("export")     # under `if accelerator.is_main_process:`
        """
        if enable and self.dschf is None:
            raise ValueError("zero3_init_context_manager(enable=True): models are built whole under this plugin; "
                             "give DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True) (or --zero3_init_flag true)")
        if enable or self.dschf is None:
            yield
            return
        from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        try:
            yield
        finally:
            set_hf_deepspeed_config(self.dschf)

    @classmethod
    def from_launcher(cls) -> DeepSpeedPlugin:
        """The plugin `cadence launch --use_deepspeed ...` (`$CADENCE_DEEPSPEED_CONFIG`) stands for."""
        raw = {k.removeprefix("deepspeed_"): v for k, v in json.loads(os.environ.get("CADENCE_DEEPSPEED_CONFIG") or "{}").items()}
        known = {f.name for f in fields(cls) if f.init}
        config = raw.pop("config_file", None)
        return cls(hf_ds_config=config, **{k: v for k, v in raw.items() if k in known})
