"""FSDP: fully sharded data parallel with torch's FSDP2 (`torch.distributed.fsdp.fully_shard`).

Parameters, gradients and optimizer state are sharded over the processes; each layer group is
all-gathered for its forward and backward. The options carry Accelerate's names (without the
`fsdp_` prefix), and `cadence launch --use_fsdp ...` or an Accelerate config's `fsdp_config`
block reaches the strategy through `$CADENCE_FSDP_CONFIG`.

>>> with learn.distrib_ctx(strategy="fsdp", auto_wrap_policy="TRANSFORMER_BASED_WRAP",
...                        transformer_layer_cls_to_wrap="Block"):
...     learn.fit_one_cycle(3, 1e-3)
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
from collections.abc import Sequence
from typing import Any, ContextManager

import torch
from torch import nn
from torch.utils.data import DataLoader

from . import env
from .data import DistributedDL
from .deepspeed_config import as_flag
from .grad_norm import clip_by_total_norm
from .precision import FullPrecision, fsdp_mixed_precision, sharded_scaler
from .sharded_checkpoint import ShardedCheckpoints
from .strategy import (MakeOpt, OwnsPrecision, Strategy, meta_copy, named_by_position,
                       non_persistent_buffers, rebuild, set_buffers, tied_names)

__all__ = ["FSDP", "SHARDING_STRATEGIES", "AUTO_WRAP_POLICIES"]

# name -> reshard_after_forward; the numbers are Accelerate's (`fsdp_sharding_strategy: 1`)
SHARDING_STRATEGIES = {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "NO_SHARD": False, "HYBRID_SHARD": True,
                       "HYBRID_SHARD_ZERO2": False}
_SHARDING_NUMBERS = {1: "FULL_SHARD", 2: "SHARD_GRAD_OP", 3: "NO_SHARD", 4: "HYBRID_SHARD", 5: "HYBRID_SHARD_ZERO2"}
AUTO_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")


def _launcher_options() -> dict[str, Any]:
    """`$CADENCE_FSDP_CONFIG` (the launcher's `fsdp_config`), keys without Accelerate's `fsdp_` prefix."""
    raw = json.loads(os.environ.get("CADENCE_FSDP_CONFIG") or "{}")
    return {k.removeprefix("fsdp_"): v for k, v in raw.items()}


def _sharding_name(value: str | int) -> str:
    name = _SHARDING_NUMBERS.get(value, value) if isinstance(value, int) else str(value).upper()
    if name not in SHARDING_STRATEGIES:
        raise ValueError(f"FSDP sharding_strategy {value!r} does not exist; choose one of "
                         f"{list(SHARDING_STRATEGIES)} (or Accelerate's numbers 1-5)")
    return name


def _class_names(value: str | Sequence[str] | None) -> set[str]:
    if value is None:
        return set()
    return {n.strip() for n in (value.split(",") if isinstance(value, str) else value) if n.strip()}


class FSDP(ShardedCheckpoints, OwnsPrecision, Strategy):
    """Shard the model with FSDP2 over all processes (or a 2-D replicate x shard mesh for HYBRID_SHARD).

    Args (Accelerate's `fsdp_config` names without the prefix; `$CADENCE_FSDP_CONFIG` fills the rest):
        sharding_strategy: FULL_SHARD (reshard after forward), SHARD_GRAD_OP (keep after forward),
            NO_SHARD (replicate, like DDP), HYBRID_SHARD / HYBRID_SHARD_ZERO2 (shard within groups of
            `hybrid_shard_size` processes, replicate across them); or Accelerate's numbers 1-5.
        auto_wrap_policy: TRANSFORMER_BASED_WRAP (classes named in `transformer_layer_cls_to_wrap`),
            SIZE_BASED_WRAP (subtrees with at least `min_num_params` parameters), NO_WRAP (the root only).
            Inferred from the other options when not given.
        wrap_modules: an explicit list of submodules (or module classes) to shard as their own groups.
        offload_params: keep parameters and optimizer state on the CPU between uses.
        activation_checkpointing: recompute the wrapped layers' activations in backward.
        cpu_ram_efficient_loading: build the model under `init_context()`: only rank 0 holds real
            weights, the others build on the meta device and receive a broadcast when sharded.
        state_dict_type: SHARDED_STATE_DICT (checkpoints written by every rank, torch.distributed.checkpoint)
            or FULL_STATE_DICT (one `model.safetensors` gathered on rank 0).
    """

    name = "fsdp"

    def __init__(self, device: torch.device | str | None = None, sharding_strategy: str | int | None = None,
                 auto_wrap_policy: str | None = None, transformer_layer_cls_to_wrap: str | Sequence[str] | None = None,
                 min_num_params: int | None = None, wrap_modules: Sequence[nn.Module | type] | None = None,
                 offload_params: bool | None = None, activation_checkpointing: bool | None = None,
                 cpu_ram_efficient_loading: bool | None = None, state_dict_type: str | None = None,
                 hybrid_shard_size: int | None = None, **unused_launcher_keys: Any):
        super().__init__(device)
        given = {k: v for k, v in dict(
            sharding_strategy=sharding_strategy, auto_wrap_policy=auto_wrap_policy,
            transformer_layer_cls_to_wrap=transformer_layer_cls_to_wrap, min_num_params=min_num_params,
            offload_params=offload_params, activation_checkpointing=activation_checkpointing,
            cpu_ram_efficient_loading=cpu_ram_efficient_loading, state_dict_type=state_dict_type,
            hybrid_shard_size=hybrid_shard_size).items() if v is not None}
        options = {**_launcher_options(), **given}
        _refuse_unknown(unused_launcher_keys)
        self.sharding = _sharding_name(options.get("sharding_strategy", "FULL_SHARD"))
        self.layer_classes = _class_names(options.get("transformer_layer_cls_to_wrap"))
        self.min_num_params = int(options.get("min_num_params") or 0)
        self.auto_wrap = str(options.get("auto_wrap_policy") or _inferred_policy(self.layer_classes,
                                                                               self.min_num_params)).upper()
        if self.auto_wrap not in AUTO_WRAP_POLICIES:
            raise ValueError(f"FSDP auto_wrap_policy {self.auto_wrap!r} does not exist; choose one of {AUTO_WRAP_POLICIES}")
        self.wrap_modules = list(wrap_modules or [])
        self.offload = as_flag(options.get("offload_params", False))
        self.activation_checkpointing = as_flag(options.get("activation_checkpointing", False))
        self.cpu_ram_efficient_loading = as_flag(options.get("cpu_ram_efficient_loading", False))
        self.state_dict_type = str(options.get("state_dict_type", "SHARDED_STATE_DICT")).upper()
        if self.state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(f"FSDP state_dict_type {self.state_dict_type!r} does not exist; choose one of {STATE_DICT_TYPES}")
        self.hybrid_shard_size = options.get("hybrid_shard_size")
        self.created_group = False
        self._skeleton: nn.Module | None = None

    @classmethod
    def check_launcher_config(cls, config: Any) -> None:
        """The launcher's `fsdp_config` block must build an FSDP strategy (names, numbers, no typos)."""
        options = {k.removeprefix("fsdp_"): v for k, v in config.fsdp_config.items()}
        try:
            cls(device="cpu", **options)._mesh_shape_for(config.num_processes)
        except (ValueError, TypeError) as e:
            raise ValueError(f"fsdp_config: {e}") from None

    # ------------------------------------------------------------------ lifecycle
    def setup_environment(self) -> None:
        """Create the process group if the launcher asked for several processes; check the mesh shape."""
        self._mesh_shape()  # refuse a bad hybrid shape before any process connects
        self.created_group = env.setup_distrib() or self.created_group

    def teardown(self) -> None:
        if self.created_group:
            env.teardown_distrib()
            self.created_group = False

    def _mesh_shape(self) -> tuple[int, ...]:
        return self._mesh_shape_for(env.world_size())

    def _mesh_shape_for(self, world: int) -> tuple[int, ...]:
        if self.sharding == "NO_SHARD":
            return (world, 1)
        if self.sharding.startswith("HYBRID"):
            shard = int(self.hybrid_shard_size or os.environ.get("LOCAL_WORLD_SIZE") or world)
            if shard < 1 or world % shard:
                raise ValueError(f"FSDP {self.sharding}: hybrid_shard_size {shard} does not divide the {world} "
                                 f"processes; pick a divisor of {world} (processes per shard group)")
            return (world // shard, shard)
        return (world,)

    def _mesh(self):
        shape = self._mesh_shape()
        return env.device_mesh(self.device.type, shape, ("replicate", "shard") if len(shape) == 2 else ("shard",))

    # ------------------------------------------------------------------ model and optimizer
    def init_context(self) -> ContextManager:
        """With `cpu_ram_efficient_loading`, every rank but 0 builds the model on the meta device (no memory).

        >>> with strategy.init_context(): model = BigModel()
        """
        if self.cpu_ram_efficient_loading and not env.is_main_process():
            return torch.device("meta")
        return contextlib.nullcontext()

    def setup(self, model: nn.Module, make_opt: MakeOpt, precision: FullPrecision | None = None
              ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Shard `model` group by group (bottom-up), then the root; build the optimizer over the shards."""
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        groups = self._groups(model)  # bad layer names fail here, on one process too
        if not env.is_initialized():  # one process: nothing to shard, the same script still runs
            return super().setup(model, make_opt, precision)
        if precision is not None:
            self.precision = sharded_scaler(precision)
        self._precision_fixed = True
        buffers = self._rank0_buffers(model) if self.cpu_ram_efficient_loading else []
        set_buffers(model, buffers)  # before the skeleton is taken: it keeps them for `release`
        self._skeleton = meta_copy(model)
        full_state = _full_cpu_state(model) if self.cpu_ram_efficient_loading and env.is_main_process() else None
        if self.activation_checkpointing:
            from torch.distributed._composable import checkpoint

            for group in groups:
                checkpoint(group)
        kwargs = dict(mesh=self._mesh(), reshard_after_forward=SHARDING_STRATEGIES[self.sharding],
                      mp_policy=fsdp_mixed_precision(self.precision),
                      offload_policy=CPUOffloadPolicy() if self.offload else OffloadPolicy())
        if not self.offload and not self.cpu_ram_efficient_loading:
            model = model.to(self.device)
        for group in groups:
            fully_shard(group, **kwargs)
        # the root reshards after forward too (torch's default keeps it unsharded until backward, and an
        # evaluation forward has no backward: the model would then hold unsharded parameters)
        fully_shard(model, **kwargs)
        _gather_for_generate(model)
        if self.cpu_ram_efficient_loading:
            self._load_broadcast(model, full_state)
            set_buffers(model, buffers)  # to_empty emptied them
        return model, make_opt(model)

    def _groups(self, model: nn.Module) -> list[nn.Module]:
        """The submodules that become their own FSDP groups, innermost first."""
        if self.wrap_modules:
            classes = tuple(m for m in self.wrap_modules if isinstance(m, type))
            chosen = [m for m in model.modules() if m is not model and (isinstance(m, classes) or
                                                                         any(m is w for w in self.wrap_modules))]
        elif self.auto_wrap == "TRANSFORMER_BASED_WRAP":
            # no class named: a Hugging Face model's own layer classes (`_no_split_modules`), as Accelerate does
            layer_classes = self.layer_classes or set(getattr(model, "_no_split_modules", None) or ())
            chosen = [m for m in model.modules() if m is not model and type(m).__name__ in layer_classes]
            found = {type(m).__name__ for m in chosen}
            if not layer_classes or found != layer_classes:
                present = sorted({type(m).__name__ for m in model.modules()})
                raise ValueError(f"FSDP transformer_layer_cls_to_wrap {sorted(layer_classes - found) or '(none)'} "
                                 f"matches no layer of the model; its layer classes are {present}")
        elif self.auto_wrap == "SIZE_BASED_WRAP":
            chosen = _size_groups(model, self.min_num_params)
        else:
            chosen = []
        return sorted(chosen, key=lambda m: -_depth(model, m))

    def _rank0_buffers(self, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """Rank 0's non-persistent buffers (a rotary embedding's `inv_freq`) on every rank: no state dict carries them,
        and a rank that built the model on the meta device has none (it trained on uninitialised memory)."""
        import torch.distributed as dist

        placed = []
        for name, t in non_persistent_buffers(model):
            value = (t.detach().to(self.device).clone() if env.is_main_process() else
                     torch.empty(t.shape, dtype=t.dtype, device=self.device))
            dist.broadcast(value, src=0)
            placed.append((name, value.cpu() if self.offload else value))
        return placed

    def _load_broadcast(self, model: nn.Module, full_state: dict | None) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        model.to_empty(device="cpu" if self.offload else self.device)
        set_model_state_dict(model, full_state or {}, options=StateDictOptions(full_state_dict=True,
                                                                               broadcast_from_rank0=True))

    def release(self, model: nn.Module, opt: torch.optim.Optimizer, make_opt: MakeOpt
                ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """A plain module with the trained weights (gathered on every rank) and an optimizer with their state."""
        if self._skeleton is None:  # never sharded (one process)
            return model, opt
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict, set_optimizer_state_dict)

        full = StateDictOptions(full_state_dict=True)
        weights, opt_state = get_model_state_dict(model, options=full), get_optimizer_state_dict(model, opt, options=full)
        plain = rebuild(self._skeleton, self.device)
        plain.load_state_dict(weights)
        new_opt = make_opt(plain)
        if opt_state["state"]:
            set_optimizer_state_dict(plain, new_opt, opt_state, options=full)
        else:  # nothing learned yet (plain SGD): torch refuses an empty state, the hyper-parameters still carry over
            for new, old in zip(new_opt.param_groups, opt.param_groups):
                new.update({k: v for k, v in old.items() if k != "params"})
        return plain, new_opt

    def shard(self, dl: DataLoader) -> DistributedDL:
        """This rank's part of `dl` (every rank sees different data, as with DDP)."""
        return DistributedDL(dl, device=self.device)

    # ------------------------------------------------------------------ one step
    def set_gradient_sync(self, model: nn.Module, enabled: bool) -> None:
        """Accumulation micro-steps keep unsharded local gradients: no reduce-scatter until the window ends."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(enabled)

    def clip_grad_norm(self, model: nn.Module, opt: torch.optim.Optimizer, max_norm: float,
                       norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the true global norm over every shard; returns that norm (before clipping)."""
        self.precision.unscale(opt)
        return clip_by_total_norm(model.parameters(), max_norm, norm_type)

    # ------------------------------------------------------------------ state
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full weights gathered on the CPU of rank 0 (other ranks get an empty dict); every rank must call it.

        A tied weight's names share one tensor, as in the plain module's state dict.
        """
        if self._skeleton is None:
            return super().model_state_dict(model)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        for alias, source in tied_names(model).items():  # gathered name by name: one tensor again, stored once
            if alias in state and source in state:
                state[alias] = state[source]
        return state

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load full weights (read by every rank) into the shards."""
        if self._skeleton is None:
            return super().load_model_state_dict(model, state, strict)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=strict))

    def optimizer_state_dict(self, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
        """Full optimizer state keyed by parameter names, on the CPU of rank 0."""
        if self._skeleton is None:
            return super().optimizer_state_dict(model, opt)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_optimizer_state_dict(self, model: nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
        if self._skeleton is None:
            return super().load_optimizer_state_dict(model, opt, state)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if any(isinstance(i, int) for g in state.get("param_groups", []) for i in g["params"]):
            # a plain optimizer's own state_dict (parameters by position: a one-process save, or the Learner's
            # optimizer before this context): keyed by the parameters' names, as torch's loader reads it
            state = named_by_position(state, opt, model)
        set_optimizer_state_dict(model, opt, state, options=StateDictOptions(full_state_dict=True))


# ---------------------------------------------------------------------- helpers
def _refuse_unknown(keys: dict[str, Any]) -> None:
    """Accelerate's fsdp_config keys that FSDP2 makes moot are accepted; anything else is a typo."""
    moot = {"version", "backward_prefetch", "forward_prefetch", "use_orig_params", "sync_module_states",
            "reshard_after_forward"}
    unknown = sorted(set(keys) - moot)
    if unknown:
        raise ValueError(f"unknown FSDP option(s) {unknown}; FSDP takes sharding_strategy, auto_wrap_policy, "
                         f"transformer_layer_cls_to_wrap, min_num_params, wrap_modules, offload_params, "
                         f"activation_checkpointing, cpu_ram_efficient_loading, state_dict_type, hybrid_shard_size")


def _inferred_policy(layer_classes: set[str], min_num_params: int) -> str:
    if layer_classes:
        return "TRANSFORMER_BASED_WRAP"
    return "SIZE_BASED_WRAP" if min_num_params else "NO_WRAP"


def _size_groups(model: nn.Module, min_num_params: int) -> list[nn.Module]:
    """Subtrees (innermost first) whose parameters not yet in a group reach `min_num_params`."""
    chosen, taken = [], set()

    def visit(module: nn.Module) -> int:
        free = sum(visit(child) for child in module.children())
        free += sum(p.numel() for p in module.parameters(recurse=False) if id(p) not in taken)
        if module is not model and free >= min_num_params:
            chosen.append(module)
            taken.update(id(p) for p in module.parameters())
            return 0
        return free
    visit(model)
    return chosen


def _depth(root: nn.Module, module: nn.Module) -> int:
    names = {id(m): name for name, m in root.named_modules()}
    return names[id(module)].count(".") + 1


def _full_cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _gather_for_generate(model: nn.Module) -> None:
    """A `generate` method (Hugging Face, peft) gathers the root's parameters as `forward` does: peft's `generate`
    calls the inner model, never the root's `forward`, and would meet the root's sharded embedding."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    if inspect.ismethod(getattr(model, "generate", None)):   # not a submodule named `generate`
        register_fsdp_forward_method(model, "generate")
