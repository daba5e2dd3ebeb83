"""ModelParallel: tensor (and sequence) parallelism inside FSDP2 data parallelism, on one device mesh.

The processes form a (dp, tp) mesh, tp innermost: the `tp` ranks of one group hold slices of the
same layers and see the same batches; the `dp` groups see different data and shard what is left
with FSDP2 (2-D parallelism; with one dp group, no FSDP). The model says how it is sliced: a function
`parallelize(model, tp_mesh)` that calls `torch.distributed.tensor.parallel.parallelize_module`
(ColwiseParallel, RowwiseParallel, SequenceParallel, ...), a `model.parallelize(tp_mesh)` method, or, for a
Hugging Face model, the tensor-parallel plan its config carries (`base_model_tp_plan`: Llama, Mistral, Qwen...).

>>> def parallelize(model, tp_mesh):
...     parallelize_module(model, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
>>> with learn.distrib_ctx(strategy="model_parallel", tp_size=2, parallelize=parallelize):   # dp = the rest
...     learn.fit(3)

What the rest of cadence sees: data, metrics and `get_preds` over the dp group (`dp_rank`, `dp_size`,
`all_sum`, `gather`), files written by global rank 0 (`is_main`), gradients clipped by the true
global norm (computed per mesh and combined), tied weights kept tied. Checkpoints are FSDP's sharded
format (torch.distributed.checkpoint) with the optimizer state flattened, which torch reshards as it loads: weights
and optimizer state load exactly on any other mesh (sizes, pipeline split, number of processes), in one process, or
under `strategy="fsdp"`; FSDP's checkpoints (optimizer state per parameter group) load here as exactly.
Their state.json records the mesh that wrote them (`checkpoint_layout`).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from ..tied_weights import retie, tied_names
from . import env
from .data import DistributedDL
from .fsdp import FSDP
from .grad_norm import clip_by_total_norm
from .precision import FullPrecision
from .strategy import MakeOpt, meta_copy

__all__ = ["ModelParallel", "checkpoint_layout"]

Parallelize = Callable[[nn.Module, Any], Any]


class ModelParallel(FSDP):
    """Tensor parallelism over `tp_size` processes, FSDP2 over the `world // tp_size` data-parallel groups.

    Args:
        tp_size: processes per tensor-parallel group (a divisor of the world size); `cadence launch
            --use_parallelism_config --parallelism_config_tp_size N` (or the YAML's parallelism_config) sets it.
        dp_shard_size: checked to be world // (tp_size x dp_replicate_size) when given (Accelerate's name).
        dp_replicate_size: FSDP2 groups that replicate each other (HSDP: shard within a group, all-reduce across).
        parallelize: `fn(model, tp_mesh)` slicing the model's layers; else the model's own `parallelize(tp_mesh)`,
            else a Hugging Face model's `base_model_tp_plan`.
        loss_parallel: the output layer leaves the logits sliced over the vocabulary (`use_local_output=False`) and
            the loss is torch's parallel cross-entropy (forward and backward inside `loss_parallel()`).
        cp_size: context parallelism; refused (1 only).
        Other keywords are FSDP's (`transformer_layer_cls_to_wrap`, `sharding_strategy`, ...), applied over dp.
    """

    name = "model_parallel"
    pp_size = 1

    def __init__(self, device: torch.device | str | None = None, tp_size: int | None = None,
                 parallelize: Parallelize | None = None, loss_parallel: bool = False, cp_size: int | None = None,
                 dp_shard_size: int | None = None, dp_replicate_size: int | None = None, pp_size: int | None = None,
                 **fsdp_options: Any):
        super().__init__(device, **fsdp_options)
        launched = _launcher_sizes()
        tp_size = launched.get("tp_size") if tp_size is None else tp_size
        cp_size = launched.get("cp_size", 1) if cp_size is None else cp_size
        self.dp_shard_size = launched.get("dp_shard_size") if dp_shard_size is None else dp_shard_size
        dp_replicate_size = launched.get("dp_replicate_size", 1) if dp_replicate_size is None else dp_replicate_size
        if int(dp_replicate_size) < 1:
            raise ValueError(f"dp_replicate_size={dp_replicate_size}: a whole number >= 1 (replicated FSDP groups, HSDP)")
        self.dp_replicate_size = int(dp_replicate_size)
        self._flat_dp = None
        if int(cp_size) != 1:
            raise ValueError(f"cp_size={cp_size}: context parallelism is not available in cadence yet (and torch has no "
                             f"CPU implementation of sharded attention); shard long sequences with sequence "
                             f"parallelism instead (SequenceParallel in the parallelize plan), cp_size=1")
        if tp_size is None or int(tp_size) < 1:
            raise ValueError(f"model_parallel needs tp_size, a whole number >= 1 dividing the process count; got {tp_size!r}")
        self.tp_size, self.parallelize, self.loss_parallel = int(tp_size), parallelize, loss_parallel
        self.device_mesh = None

    @classmethod
    def check_launcher_config(cls, config: Any) -> None:
        """The launcher's parallelism_config sizes (and fsdp_config) must fit its number of processes."""
        options = {k.removeprefix("fsdp_"): v for k, v in config.fsdp_config.items()}
        try:
            cls(device="cpu", **parallelism_sizes(config.parallelism_config), **options)._mesh_shape_for(config.num_processes)
        except (ValueError, TypeError) as e:
            raise ValueError(f"parallelism_config: {e}") from None

    # ------------------------------------------------------------------ the mesh
    def _mesh_shape_for(self, world: int) -> tuple[int, ...]:
        if world == 1:  # one process trains the plain model
            return (1, 1)
        if world % self.tp_size:
            raise ValueError(f"tp_size={self.tp_size} does not divide the {world} processes: dp x tp = world, so "
                             f"tp_size must be one of {[d for d in range(1, world + 1) if world % d == 0]}")
        rep, dp = self.dp_replicate_size, world // self.tp_size
        if dp % rep:
            raise ValueError(f"dp_replicate_size={rep} does not divide the {dp} data-parallel processes ({world} / "
                             f"tp_size={self.tp_size}): pick one of {[d for d in range(1, dp + 1) if dp % d == 0]}")
        replicas = f" x dp_replicate_size={rep}" if rep > 1 else ""
        if self.dp_shard_size is not None and self.dp_shard_size * self.tp_size * rep != world:
            raise ValueError(f"dp_shard_size={self.dp_shard_size}{replicas} x tp_size={self.tp_size} = "
                             f"{self.dp_shard_size * self.tp_size * rep}, not the {world} processes: make dp_shard_size "
                             f"{dp // rep} or leave it out")
        return (rep, dp // rep, self.tp_size) if rep > 1 else (dp, self.tp_size)

    def _mesh(self):
        """The mesh FSDP2 shards over: dp, or (dp_replicate, dp_shard) for HSDP."""
        if self.device_mesh is None:
            self.device_mesh = env.device_mesh(self.device.type, self._mesh_shape(), self._mesh_names())
        dims = self._dp_dims()
        return self.device_mesh[dims if len(dims) > 1 else dims[0]]

    def _dp_dims(self) -> tuple[str, ...]:
        """The data-parallel dimensions: ("dp",), or Accelerate's names on the Accelerator's mesh."""
        if self.dp_replicate_size > 1:
            return ("dp_replicate", "dp_shard")
        given = self.device_mesh.mesh_dim_names if self.device_mesh is not None else ()
        return ("dp_shard",) if "dp_shard" in given else ("dp",)

    def _mesh_names(self) -> tuple[str, ...]:
        return (*self._dp_dims(), "tp")

    # ------------------------------------------------------------------ model and optimizer
    def setup(self, model: nn.Module, make_opt: MakeOpt, precision: FullPrecision | None = None
              ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Slice the layers over tp (ties restored), then shard over dp with FSDP2, then build the optimizer."""
        if not env.is_initialized():  # one process: nothing to slice, the same script still runs (as FSDP)
            return super().setup(model, make_opt, precision)
        skeleton, ties = meta_copy(model), tied_names(model)
        model = model.to(self.device)
        self._mesh()
        tp_mesh = self.device_mesh["tp"]
        if _sliced_already(model, tp_mesh):  # from_pretrained(tp_plan="auto") or the user sliced it
            pass
        elif self.parallelize is not None:
            self.parallelize(model, tp_mesh)
            _retie_sliced(model, ties)
        elif callable(getattr(model, "parallelize", None)):
            model.parallelize(tp_mesh)
            _retie_sliced(model, ties)
        elif _has_tp_plan(model):
            _apply_tp_plan(model, tp_mesh, self.tp_size)
            retie(model, ties)
        elif self.tp_size > 1:  # tp_size=1: FSDP2 over dp alone (e.g. resuming a pipeline's checkpoint with pp_size=1)
            raise ValueError(f"model_parallel does not know how to slice {type(model).__name__}: pass "
                             f"`parallelize=fn(model, tp_mesh)`, give the model a `parallelize(tp_mesh)` method, "
                             f"or use a Hugging Face model whose config has a `base_model_tp_plan`")
        if self.dp_size > 1:
            model, opt = super().setup(model, make_opt, precision)
        else:  # tensor parallel only: no data-parallel dimension to shard (FSDP over one process costs 1.8x a step)
            if precision is not None:
                self.set_precision(precision)
            self._precision_fixed = True
            opt = make_opt(model)
        self._skeleton = skeleton
        return model, opt

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_state(self, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
        """FSDP's sharded format with the optimizer state flattened to one key per parameter, which every
        `model_parallel` mesh (pipelines included: torch's nested `param_groups` would be written once, by rank 0,
        for every stage) writes and reads: a checkpoint resumes on any pp x dp x tp mesh, in one process, or under
        FSDP (`DirectReader.load` reads either layout into the other)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, opt_state = get_state_dict(model, opt, options=_flat_options())
        return {"model": model_state, "optimizer": opt_state}

    def _set_checkpoint_state(self, model: nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=_flat_options())

    def loss_context(self) -> ContextManager | None:
        """With `loss_parallel`: torch's `loss_parallel()`, cross-entropy on logits sliced over the vocabulary."""
        return _loss_parallel() if self.loss_parallel and env.is_initialized() else None

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """With `loss_parallel`, the backward of the sliced cross-entropy runs inside it too (torch requires both)."""
        with _loss_parallel() if self.loss_parallel and env.is_initialized() else contextlib.nullcontext():
            super().backward(loss, **kwargs)

    def shard(self, dl: DataLoader) -> DistributedDL:
        """This dp group's part of `dl`: the ranks of one tp group get the same batches."""
        group = self._dp_group() if env.is_initialized() else None   # a stream's end is agreed over dp
        return DistributedDL(dl, rank=self.dp_rank, world_size=self.dp_size, device=self.device, group=group)

    def clip_grad_norm(self, model: nn.Module, opt: torch.optim.Optimizer, max_norm: float,
                       norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm: one norm per mesh (sliced, sharded and plain parameters), combined."""
        return self._clip_by_total(model, opt, max_norm, norm_type, lambda norm, _: norm)

    def _clip_by_total(self, model: nn.Module, opt: torch.optim.Optimizer, max_norm: float, norm_type: float,
                       combine: Callable[[torch.Tensor, float], torch.Tensor]) -> torch.Tensor:
        """Unscale; the norm per mesh, combined, then `combine(norm, norm_type)` (over pipeline stages); clip by it."""
        self.precision.unscale(opt)
        return clip_by_total_norm(model.parameters(), max_norm, norm_type, combine)

    # ------------------------------------------------------------------ the data-parallel group
    @property
    def is_main(self) -> bool:
        """Global rank 0: one process writes each file and prints (dp rank 0 exists once per tp rank)."""
        return env.rank() == 0

    @property
    def dp_rank(self) -> int:
        return self._dp_coordinate()[0]

    @property
    def dp_size(self) -> int:
        return self._dp_coordinate()[1]

    def _dp_coordinate(self) -> tuple[int, int]:
        """(rank, size) in the dp group: ranks are laid out (pp, dp, tp), tp innermost."""
        if not env.is_initialized():
            return 0, 1
        size = env.world_size() // (self.tp_size * self.pp_size)
        return (env.rank() // self.tp_size) % size, size

    def _dp_group(self):
        """The data-parallel group (the two HSDP dimensions flattened into one)."""
        mesh = self._mesh()
        if mesh.ndim == 1:
            return mesh.get_group()
        if self._flat_dp is None:  # Accelerate's mesh has flattened "dp" already: torch gives that one back
            self._flat_dp = mesh._flatten("dp").get_group()
            dist.distributed_c10d._set_pg_timeout(env.timeout(), self._flat_dp)  # as env.device_mesh does
        return self._flat_dp

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the dp group (the tp ranks of a group hold the same values)."""
        t = _whole(t)
        if self.dp_size == 1:
            return t
        t = t.clone()
        dist.all_reduce(t, group=self._dp_group())
        return t

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every dp group's `t` concatenated on dim 0 in dp order (lengths may differ); sliced logits made whole."""
        t = _whole(t)
        if self.dp_size == 1:
            return t
        group = self._dp_group()
        sizes = [torch.zeros((), dtype=torch.long, device=t.device) for _ in range(self.dp_size)]
        dist.all_gather(sizes, torch.tensor(t.shape[0], device=t.device), group=group)
        longest = int(max(sizes))
        padded = torch.cat([t, t.new_zeros((longest - t.shape[0], *t.shape[1:]))]) if t.shape[0] < longest else t
        parts = [torch.empty_like(padded) for _ in range(self.dp_size)]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([part[:int(n)] for part, n in zip(parts, sizes)])


SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "pp_size", "pp_microbatches")


def parallelism_sizes(block: dict[str, Any]) -> dict[str, int]:
    """The sizes of Accelerate's parallelism_config block (`parallelism_config_tp_size: 2`, ...) as ModelParallel's
    arguments; its other keys (backends, Accelerate's DeepSpeed sequence parallelism) only with their size 1.

    >>> parallelism_sizes({"parallelism_config_tp_size": 2, "parallelism_config_cp_backend": "torch"})
    {'tp_size': 2}
    """
    plain = {k.removeprefix("parallelism_config_"): v for k, v in block.items()}
    if int(plain.get("sp_size") or 1) != 1:
        raise ValueError(f"sp_size={plain['sp_size']}: Accelerate's sequence parallelism (DeepSpeed's) is not in cadence; "
                         f"sequence parallelism is part of the tensor-parallel plan (SequenceParallel): use tp_size")
    sizes: dict[str, Any] = {k: int(plain[k]) for k in SIZES if plain.get(k) is not None}
    return {**sizes, "pp_schedule": str(plain["pp_schedule"])} if plain.get("pp_schedule") else sizes


def checkpoint_layout(strategy: Any) -> dict[str, Any] | None:
    """The engine and mesh sizes a sharded checkpoint of `strategy` is written on (a checkpoint's state.json keeps
    them as "mesh"); None for one that writes the plain files (one process, FULL_STATE_DICT, engines outside FSDP's).

    >>> checkpoint_layout(learn.strategy)   # inside distrib_ctx(strategy="model_parallel", tp_size=2) on 4 processes
    {'strategy': 'model_parallel', 'processes': 4, 'pp_size': 1, 'dp_replicate_size': 1, 'dp_shard_size': 2, 'tp_size': 2}
    """
    if not isinstance(strategy, FSDP) or strategy._skeleton is None or strategy.state_dict_type == "FULL_STATE_DICT":
        return None
    world = env.world_size()
    if isinstance(strategy, ModelParallel):
        dp = world // (strategy.tp_size * strategy.pp_size)
        return {"strategy": ModelParallel.name, "processes": world, "pp_size": strategy.pp_size,
                "dp_replicate_size": strategy.dp_replicate_size, "dp_shard_size": dp // strategy.dp_replicate_size,
                "tp_size": strategy.tp_size}
    shape = strategy._mesh_shape()   # (shard,) or (replicate, shard)
    return {"strategy": FSDP.name, "processes": world, "dp_replicate_size": shape[0] if len(shape) == 2 else 1,
            "dp_shard_size": shape[-1]}


def _flat_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _launcher_sizes() -> dict[str, int]:
    """`$CADENCE_PARALLELISM_CONFIG`: the launcher's parallelism_config block."""
    return parallelism_sizes(json.loads(os.environ.get("CADENCE_PARALLELISM_CONFIG") or "{}"))


def _has_tp_plan(model: nn.Module) -> bool:
    """A transformers model that carries its own tensor-parallel plan (Llama, Mistral, Qwen, ...)."""
    return callable(getattr(model, "_resolve_parallel_plans", None)) and bool(getattr(model, "tp_plan", None))


def _apply_tp_plan(model: nn.Module, tp_mesh: Any, tp_size: int) -> None:
    """Slice a transformers model by its own plan, with transformers' own styles (its layers expect them)."""
    from transformers.distributed.configuration_utils import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    _check_heads(model, tp_size)
    plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=tp_size))
    aliases = tied_names(model)  # a tied weight is sliced once, through its first name (transformers 5.24 fails on
    apply_tensor_parallelism(model, tp_mesh, {k: v for k, v in plan.items() if k not in aliases})  # the alias)


def _check_heads(model: nn.Module, tp_size: int) -> None:
    """ValueError naming them when the attention heads (and key-value heads) cannot be split over `tp_size`: the
    plan slices whole heads, and a model with a split head fails in its first forward with a reshape error."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide the model's {key}={heads}: tensor parallelism gives "
                             f"each process whole heads; pick tp_size among "
                             f"{[d for d in range(1, heads + 1) if heads % d == 0]}")


def _loss_parallel() -> ContextManager:
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (logits sliced over the vocabulary with loss_parallel) as the full local tensor."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _sliced_already(model: nn.Module, tp_mesh: Any) -> bool:
    """Whether `model` came sliced (DTensor parameters); refused when sliced on another mesh than `tp_mesh`, which
    FSDP2 could not combine with its dp dimension."""
    from torch.distributed.tensor import DTensor

    meshes = {p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
    if meshes - {tp_mesh}:
        other = next(iter(meshes - {tp_mesh}))
        raise ValueError(f"{type(model).__name__} is sliced on {other}, not on the strategy's tensor-parallel mesh "
                         f"{tp_mesh}: pass the plain model and let prepare slice it, or slice it on "
                         f"accelerator.torch_device_mesh['tp']")
    return bool(meshes)


def _retie_sliced(model: nn.Module, aliases: dict[str, str]) -> None:
    """parallelize_module gives each module its own sliced Parameter: tie them again, or refuse when the slices differ."""
    from torch.distributed.tensor import DTensor

    def layout(name: str) -> str:
        p = model.get_parameter(name)
        return f"{tuple(p.placements)} on {p.device_mesh}" if isinstance(p, DTensor) else "not sliced"

    for alias, source in aliases.items():
        if layout(alias) != layout(source):
            raise ValueError(f"tied parameters {source!r} and {alias!r} were sliced differently by the parallelize "
                             f"plan ({layout(source)} and {layout(alias)}); slice them the same way (e.g. the "
                             f"embedding RowwiseParallel and the output layer ColwiseParallel: both Shard(0)) or untie them")
    retie(model, aliases)
