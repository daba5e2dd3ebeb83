"""DeepSpeed: ZeRO stages 0-3, with optimizer and parameter offload, behind the Strategy interface.

The engine owns backward, step, gradient accumulation, clipping and precision; GradAccum, GradClip
and MixedPrecision configure it (the OwnsX abilities) instead of doing the work themselves. The
config is DeepSpeed's own JSON (a dict or a file), options with Accelerate's names on top, and every
`"auto"` is filled from the Learner: micro batch from the loader, accumulation, clipping, bf16/fp16,
the optimizer's hyper-parameters and the scheduler's steps.

>>> with learn.distrib_ctx(strategy="deepspeed", zero_stage=3, offload_optimizer_device="cpu"):
...     learn.fit_one_cycle(3, 1e-3)
>>> with learn.distrib_ctx(strategy="deepspeed", config="ds_config.json"): learn.fit(1)

`cadence launch --use_deepspeed --zero_stage 2 train.py` (or `--deepspeed_config_file ds.json`, or an
Accelerate config with `distributed_type: DEEPSPEED`) reaches the strategy through `$CADENCE_DEEPSPEED_CONFIG`.

This module is the strategy; the config is built in `deepspeed_config`, DeepSpeed imported and its ops compiled
in `deepspeed_install`, full tensors moved in and out of the partitions in `deepspeed_state`, and the engine's
checkpoints written and read in `deepspeed_checkpoint`.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ContextManager

import torch
from torch import nn
from torch.utils.data import DataLoader

from . import deepspeed_checkpoint, env
from .data import DistributedDL
from .deepspeed_config import (as_flag, build_config, engine_config, fill_optimizer, fill_scheduler, fit_buckets,
                               has_auto, is_auto, largest_layer, launcher_options, optimizer_entry)
from .deepspeed_install import build_ops, import_deepspeed
from .deepspeed_state import (frozen_fp32, full_fp32, full_optimizer_state, load_full_optimizer_state,
                              materialize_state, partitioned, set_zero3_partition, torch_groups)
from .kept_state import kept_on_disk
from .precision import AutocastPrecision, FullPrecision
from .staging import HostBuffers, Staging
from .strategy import (ConfiguredAtFit, MakeOpt, OwnsAccumulation, OwnsClipping, OwnsPrecision, Strategy, meta_copy,
                       rebuild)
from .transformers_zero3 import zero3_init

__all__ = ["DeepSpeed", "build_config"]


class DeepSpeed(OwnsPrecision, OwnsAccumulation, OwnsClipping, ConfiguredAtFit, Strategy):
    """Train through a DeepSpeed engine (`deepspeed.initialize`) with ZeRO stage 0, 1, 2 or 3.

    Args (Accelerate's `deepspeed_config` names; `$CADENCE_DEEPSPEED_CONFIG` fills what is not given):
        config: DeepSpeed's config, a dict or a JSON file (`config_file` is the same, Accelerate's name).
        zero_stage: 0 (data parallel), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters).
        offload_optimizer_device / offload_param_device: "cpu" (or "nvme") keeps optimizer state (ZeRO 1-3)
            or parameters (ZeRO 3) off the accelerator.
        gradient_accumulation_steps, gradient_clipping: normally set by GradAccum / GradClip.
        zero3_init_flag: build the model under `init_context()` (`deepspeed.zero.Init`): each process holds
            only its shard from the start, so a model larger than one process's memory can be built.
        zero3_save_16bit_model: DeepSpeed's `stage3_gather_16bit_weights_on_model_save`.
    The Learner's torch optimizer is used unless the config names one; cadence's schedules set the
    engine's learning rates; a config's own scheduler is honoured.
    """

    name = "deepspeed"
    steps_wait_for_staging = True  # `step` waits for an async save's late copy before the engine's step
    optimizer_replaceable = False  # its engine steps the optimizer it was built with, whatever learn.opt is

    def __init__(self, device: torch.device | str | None = None, config: str | os.PathLike | dict | None = None,
                 zero_stage: int | None = None, offload_optimizer_device: str | None = None,
                 offload_param_device: str | None = None, zero3_init_flag: bool | None = None,
                 **more_options: Any):
        super().__init__(device)
        given = {k: v for k, v in dict(zero_stage=zero_stage, offload_optimizer_device=offload_optimizer_device,
                                       offload_param_device=offload_param_device, zero3_init_flag=zero3_init_flag,
                                       **more_options).items() if v is not None}
        options = {**launcher_options(), **given}
        self.zero3_init = as_flag(options.pop("zero3_init_flag", False))
        self.config = build_config(config, **options)
        self.stage = self.config["zero_optimization"]["stage"]
        if self.zero3_init and self.stage != 3:
            raise ValueError(f"DeepSpeed zero3_init_flag needs zero_stage 3, not {self.stage}")
        self.engine = None
        self.created_group = False
        self._cadence_accumulates = False  # GradAccum scales the losses and marks the window ends
        self._skeleton, self._auto_scheduler = None, None
        self._frozen: dict[int, torch.Tensor] = {}  # the frozen parameters' fp32 values (`frozen_fp32`)
        self._groups: list[dict] = []  # the optimizer's groups as torch numbers them (`torch_groups`)

    @classmethod
    def check_launcher_config(cls, config: Any) -> None:
        """The launcher's `deepspeed_config` block must build a DeepSpeed strategy (names, stages, no typos)."""
        options = {k.removeprefix("deepspeed_"): v for k, v in config.deepspeed_config.items()}
        try:
            cls(device="cpu", **options)
        except (ValueError, TypeError, FileNotFoundError) as e:
            raise ValueError(f"deepspeed_config: {e}") from None

    # ------------------------------------------------------------------ lifecycle
    def setup_environment(self) -> None:
        """The process group (one gloo process when not launched: DeepSpeed always needs a group), then DeepSpeed's comm."""
        import torch.distributed as dist

        self.created_group = env.setup_distrib() or self.created_group
        if not dist.is_initialized() or dist.get_world_size() == 1:   # one process: the variables DeepSpeed reads
            for name in ("RANK", "LOCAL_RANK"):
                os.environ.setdefault(name, "0")
            os.environ.setdefault("WORLD_SIZE", "1")
        if not dist.is_initialized():  # and a group of one
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self.created_group = True
        deepspeed = import_deepspeed()
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.destroy()
            self.engine = None
        if self.created_group:
            from deepspeed.utils import groups

            groups._WORLD_GROUP = None  # DeepSpeed's cached clone of the group ends with it: a later engine clones anew
            env.teardown_distrib()
            self.created_group = False

    # ------------------------------------------------------------------ model and optimizer
    def init_context(self) -> ContextManager:
        """With `zero3_init_flag`, build the model sharded (`deepspeed.zero.Init`); every rank must enter it.

        >>> with strategy.init_context(): model = BigModel()
        """
        if not self.zero3_init:
            return contextlib.nullcontext()
        self.setup_environment()  # zero.Init partitions over the process group as parameters are created
        deepspeed = import_deepspeed()
        precision = os.environ.get("CADENCE_MIXED_PRECISION", "no")
        # the dtype comes from the config's bf16/fp16 sections: DeepSpeed 0.19 ignores a `dtype` argument on a
        # machine without fp16 support (an operator-precedence slip in Init._set_dtype) and builds in bf16
        return zero3_init(deepspeed, self._engine_config(precision, micro_batch=1))

    def setup(self, model: nn.Module, make_opt: MakeOpt, precision: FullPrecision | None = None
              ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Build the engine: the config's "auto" values filled, the Learner's optimizer unless the config names one."""
        deepspeed = import_deepspeed()
        if not any(p.requires_grad for p in model.parameters()):  # DeepSpeed's own error is an IndexError
            raise ValueError(f"strategy='deepspeed': no parameter of the model requires a gradient (all frozen), and "
                             f"DeepSpeed's ZeRO-{self.stage} engine needs some to build its optimizer; unfreeze the "
                             f"ones to train (requires_grad_(True)), or run inference without distrib_ctx")
        self.precision = _engine_precision(precision or self.precision, self.device)
        self._precision_fixed = True
        self._skeleton, self._frozen = meta_copy(model), frozen_fp32(model, self.precision.name, self.stage)
        cfg = self._engine_config(self.precision.name, micro_batch=1)
        fit_buckets(cfg["zero_optimization"], largest_layer(model))
        optimizer = make_opt(model)
        self._groups = torch_groups(optimizer, model)
        if "optimizer" in cfg:
            fill_optimizer(cfg["optimizer"], optimizer)
            optimizer = None
        else:
            offloaded = cfg["zero_optimization"].get("offload_optimizer", {}).get("device", "none") != "none"
            if offloaded:  # ZeRO-Offload steps on the CPU with DeepSpeedCPUAdam: the same hyper-parameters
                cfg["optimizer"] = optimizer_entry(optimizer)
                optimizer = None
        self._auto_scheduler = cfg.pop("scheduler", None) if has_auto(cfg.get("scheduler")) else None
        self.engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
        return self.engine, opt

    def _engine_config(self, precision: str, micro_batch: int) -> dict:
        """The config DeepSpeed is built with: "auto" batch sizes, accumulation, clipping and precision filled."""
        return engine_config(self.config, precision, micro_batch)

    def release(self, model: nn.Module, opt: torch.optim.Optimizer, make_opt: MakeOpt
                ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """A plain module with the trained fp32 weights (gathered on every rank) and a new optimizer over it."""
        if self.engine is None:
            return model, opt
        weights = self.model_state_dict(model)
        plain = rebuild(self._skeleton, self.device)
        plain.load_state_dict(weights)
        new_opt = make_opt(plain)
        for new, old in zip(new_opt.param_groups, opt.param_groups):
            new.update({k: v for k, v in old.items() if k != "params"})
        self.engine.destroy()
        self.engine = None
        return plain, new_opt

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the engine (and inside a `torch.compile` wrapper)."""
        return super().unwrap(getattr(model, "module", model) if model is self.engine else model)

    def shard(self, dl: DataLoader) -> DistributedDL:
        """This rank's part of `dl` (every rank sees different data)."""
        return DistributedDL(dl, device=self.device)

    # ------------------------------------------------------------------ abilities: the Learner's callbacks configure the engine
    def configure_accumulation(self, steps: int) -> None:
        """GradAccum(steps): the engine accumulates; GradAccum marks window ends and scales each micro-batch's loss."""
        configured = self.config["gradient_accumulation_steps"]
        if not is_auto(configured) and int(configured) != steps:
            raise ValueError(f"the DeepSpeed config sets gradient_accumulation_steps={configured} but GradAccum asks "
                             f"for {steps}: set it in one place (\"auto\" in the config lets GradAccum decide)")
        self._cadence_accumulates = True
        if self.engine is not None:
            self.engine._config.gradient_accumulation_steps = steps

    def configure_clipping(self, max_norm: float, norm_type: float = 2.0) -> None:
        """GradClip(max_norm): the engine clips by the global L2 norm over every shard."""
        if norm_type != 2.0:
            raise ValueError(f"DeepSpeed clips by the L2 norm only: use GradClip({max_norm}) without norm_type={norm_type}")
        configured = self.config["gradient_clipping"]
        if not is_auto(configured) and float(configured) != max_norm:
            raise ValueError(f"the DeepSpeed config sets gradient_clipping={configured} but GradClip asks for "
                             f"{max_norm}: set it in one place (\"auto\" in the config lets GradClip decide)")
        if self.engine is not None:
            self._set_engine_clipping(max_norm)

    @contextlib.contextmanager
    def clipping_once(self, max_norm: float) -> Iterator[float]:
        """The step inside clipped at the smaller of `max_norm` (inf: none) and the config's own clipping, which
        is back afterwards (`accelerator.clip_grad_norm_` clips its step only). Yields the own clipping (0.0: none)."""
        own = float(self.engine.gradient_clipping())
        self._set_engine_clipping(min((v for v in (own, max_norm) if 0 < v < math.inf), default=0.0))
        try:
            yield own
        finally:
            self._set_engine_clipping(own)

    def _set_engine_clipping(self, max_norm: float) -> None:
        self.engine._config.gradient_clipping = max_norm
        if hasattr(self.engine.optimizer, "clip_grad"):  # ZeRO and bf16 optimizers read their own copy
            self.engine.optimizer.clip_grad = max_norm

    def clip_grad_value(self, model: nn.Module, opt: torch.optim.Optimizer, value: float) -> None:
        """Refused, as Accelerate does: the engine clips only by the global norm, inside its own step."""
        raise ValueError(f"DeepSpeed does not support clip_grad_value_ (clip_value={value}): its engine clips "
                         f"gradients by their global norm inside its own step. Use clip_grad_norm_ instead "
                         f"(GradClip(max_norm) in a Learner)")

    def configure_fit(self, micro_batch_size: int | None, total_steps: int) -> None:
        """Before training: the batch sizes checked and filled, a config scheduler's "auto" steps filled."""
        engine = self.engine
        if self._auto_scheduler is not None:
            self._build_scheduler(total_steps)
        if micro_batch_size is None:  # a loader without batch_size (a list of batches): nothing to check
            return
        ga, world = engine.gradient_accumulation_steps(), engine.dp_world_size
        wanted = self.config["train_batch_size"]
        if not is_auto(wanted) and int(wanted) != micro_batch_size * ga * world:
            raise ValueError(f"DeepSpeed train_batch_size {wanted} must equal micro batch {micro_batch_size} x gradient "
                             f"accumulation {ga} x processes {world} = {micro_batch_size * ga * world}: set "
                             f"train_batch_size to \"auto\" or to {micro_batch_size * ga * world}, or change the loader's "
                             f"batch size or the accumulation")
        micro = self.config["train_micro_batch_size_per_gpu"]
        if not is_auto(micro) and int(micro) != micro_batch_size:
            raise ValueError(f"DeepSpeed train_micro_batch_size_per_gpu {micro} differs from the loader's batch size "
                             f"{micro_batch_size}: set it to \"auto\" or {micro_batch_size}")
        engine.set_train_micro_batch_size(micro_batch_size)

    def build_scheduler(self, total_steps: int | None, warmup_steps: int | None = None,
                        make: Callable[[Any], Any] | None = None) -> None:
        """The schedule an Accelerate script's `DummyScheduler` stands for: `make(optimizer)`, or the config's
        scheduler with its "auto" values from `total_steps` and `warmup_steps` (a config without "auto": as it is)."""
        if make is not None:
            self.engine.lr_scheduler, self._auto_scheduler = make(self.engine.optimizer), None
        elif self._auto_scheduler is not None:
            if total_steps is None:
                raise ValueError("the DeepSpeed config's scheduler has \"auto\" values but the DummyScheduler gives "
                                 "no total_num_steps: pass DummyScheduler(optimizer, total_num_steps=..., "
                                 "warmup_num_steps=...)")
            self._build_scheduler(total_steps, warmup_steps)

    def _build_scheduler(self, total_steps: int, warmup_steps: int | None = None) -> None:
        """The config's scheduler with its "auto" values from the fit (steps) and the optimizer (lr)."""
        lr = self.engine.optimizer.param_groups[0]["lr"]
        name, params = fill_scheduler(self._auto_scheduler, total_steps, warmup_steps, lr)
        self.engine._config.scheduler_name, self.engine._config.scheduler_params = name, params
        self.engine.lr_scheduler = self.engine._scheduler_from_config(self.engine.optimizer)
        self._auto_scheduler = None

    # ------------------------------------------------------------------ one step
    def forward_context(self) -> ContextManager:
        """Autocast for bf16/fp16 (the engine holds low-precision weights; autocast casts the inputs)."""
        return self.precision.forward_context()

    def set_gradient_sync(self, model: nn.Module, enabled: bool) -> None:
        """GradAccum's window end: the engine reduces gradients and steps on the micro-batch marked True."""
        if self.engine is not None:
            self.engine.set_gradient_accumulation_boundary(enabled)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The engine's backward (loss scaling for fp16); divided by the accumulation steps unless GradAccum scaled it.
        `kwargs` go to the engine's backward (`retain_graph`)."""
        self.engine.backward(loss, scale_wrt_gas=not self._cadence_accumulates, **kwargs)

    def step(self, opt: torch.optim.Optimizer) -> bool:
        """`engine.step()` every micro-batch; True when it updated the weights (a window's end, no fp16 overflow).
        An asynchronous save's copy of what the step writes finishes first."""
        self.wait_for_staging()
        self.engine.step()
        return self.engine.was_step_applied()

    def zero_grad(self, opt: torch.optim.Optimizer) -> None:
        """Nothing: the engine drops the gradients itself after each update (and keeps them within a window)."""

    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last update, before clipping (None before the first)."""
        norm = self.engine.get_global_grad_norm() if self.engine is not None else None
        return float(norm) if norm is not None else None

    def call_optimizer(self, name: str) -> None:
        """The user's optimizer's `name()` on the engine's fp32 master weights, copied into the model's weights
        afterwards as a step does (every rank calls it); nothing if the optimizer has no such method.

        For an optimizer that moves its weights outside `step`: a schedule-free optimizer's `train()` / `eval()`.
        ZeRO-3 lends the optimizer its master partitions only during a step; they are lent the same way here.
        """
        if self.engine is None:
            raise RuntimeError(f"optimizer.{name}() before the model was prepared with it: prepare the model first")
        self.wait_for_staging()
        opt, basic = self.engine.optimizer, self.engine.basic_optimizer
        method = getattr(basic, name, None)
        if not callable(method):
            return
        if opt is basic:                                        # no master copy: the optimizer holds the model's weights
            method()
        elif hasattr(opt, "update_lp_params"):                  # ZeRO-1/2, bf16: this rank's partition, then all-gather
            method()
            opt.update_lp_params()
        elif hasattr(opt, "fp32_partitioned_groups_flat") and not opt.swap_optimizer:   # ZeRO-3
            lent: dict[int, list[torch.Tensor]] = {}
            for sub_group, flat in enumerate(opt.fp32_partitioned_groups_flat):
                lent.setdefault(opt.sub_group_to_group_id[sub_group], []).append(flat)
            for group, flats in lent.items():
                basic.param_groups[group]["params"] = flats
            try:
                method()
            finally:
                for group in lent:
                    basic.param_groups[group]["params"] = []
            for sub_group in range(len(opt.fp32_partitioned_groups_flat)):
                opt._reassign_or_swap_out_partitioned_parameters(sub_group)
        else:
            raise NotImplementedError(f"optimizer.{name}() moves the weights outside a step, and DeepSpeed's "
                                      f"{type(opt).__name__} keeps master weights cadence cannot copy into the model: "
                                      f"use ZeRO-1/2/3 without NVMe offload, or DDP / FSDP")

    # ------------------------------------------------------------------ state
    def _named_params(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return list(self.unwrap(model).named_parameters())

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full fp32 weights on the CPU of every rank (the fp32 master copies, gathered); every rank must call it.

        Every name of a tied weight gets the same master tensor (never a bf16/fp16 working copy).
        """
        module = self.unwrap(model)
        if self.engine is None:
            return module.state_dict()
        params, masters, state = dict(module.named_parameters(remove_duplicate=False)), {}, {}
        for name, t in module.state_dict(keep_vars=True).items():
            param = params.get(name)
            if param is None:  # a buffer
                state[name] = t.detach().cpu().clone()
                continue
            if id(param) not in masters:
                masters[id(param)] = full_fp32(param, self._frozen.get(id(param)))
            state[name] = masters[id(param)]
        return state

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load full weights into the engine: the fp32 masters and the (possibly low-precision) working copies
        (`strict=False`: those `state` has)."""
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param

        module = self.unwrap(model)
        params = {name: p for name, p in self._named_params(model) if strict or name in state}
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0,
                                               enabled=self.stage == 3 and self.engine is not None):
            for name, param in params.items():
                with torch.no_grad():
                    param.copy_(state[name].to(param.dtype))
                if id(param) in self._frozen:  # a frozen weight loaded: its exact value from now on
                    self._frozen[id(param)] = state[name].detach().float().cpu()
        for name, param in params.items():
            if hasattr(param, "ds_id"):
                if param.requires_grad:  # a frozen one has no master: its gathered copy above is all there is
                    set_zero3_partition(param._z3_optimizer, param, state[name], key=None)
            else:
                safe_set_full_fp32_param(param, state[name].to(self.device, torch.float32))
        every_name = dict(module.named_parameters(remove_duplicate=False))  # a tied weight's other names too
        buffers = {k: v for k, v in state.items() if k not in every_name}
        module.load_state_dict(buffers, strict=False)

    def optimizer_state_dict(self, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
        """The full optimizer state as a one-process torch optimizer over the model, with the Learner's parameter
        groups, holds it (moments gathered from the shards; frozen parameters numbered, without state): it loads
        into a plain, DDP, FSDP or DeepSpeed Learner. Every rank calls it."""
        wrapper = self._engine_optimizer(opt)
        base = getattr(wrapper, "optimizer", wrapper)
        if wrapper is base or not partitioned(self._groups):  # the torch optimizer holds the model's own parameters
            return base.state_dict()
        deepspeed_checkpoint.link_optimizer_state(wrapper)
        return full_optimizer_state(wrapper, self._groups)

    def load_optimizer_state_dict(self, model: nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
        """Load a full torch-format optimizer state (`optimizer_state_dict`'s, or a plain run's) into the engine's
        shards."""
        wrapper = self._engine_optimizer(opt)
        base = getattr(wrapper, "optimizer", wrapper)
        if wrapper is base or not partitioned(self._groups):
            return base.load_state_dict(state)
        if not any(base.state.values()):  # a defaultdict: a read may have left empty entries
            materialize_state(wrapper)
        deepspeed_checkpoint.link_optimizer_state(wrapper)
        load_full_optimizer_state(wrapper, self._groups, state, self.device)

    def _engine_optimizer(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer the engine steps (its ZeRO wrapper), whether `opt` is it or the torch optimizer inside."""
        return self.engine.optimizer if self.engine is not None and self.engine.optimizer is not None else opt

    def save_checkpoint(self, directory: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        """DeepSpeed's own files under `directory/deepspeed/`, every rank writing its partition in parallel."""
        deepspeed_checkpoint.save(self.engine, directory, self.dp_size, self.stage, self.is_main)

    def checkpoint_writer(self, directory: Path, model: nn.Module, opt: torch.optim.Optimizer,
                          copy: bool = False, staging: Staging | None = None) -> Callable[[], None] | None:
        """The engine's save runs now (its collectives); `copy`: its files are copied into host memory (that of
        `staging.buffers`, kept from save to save, when given) and the returned callable writes them; otherwise
        they are written now and None is returned. With `staging`, what only the engine's step writes (the
        weights, the fp32 master partitions, the optimizer's state) is copied by the returned callable, first,
        and `staging.done()` said after; `step` waits for it."""
        host = None
        if copy:
            host = staging.buffers if staging is not None and staging.buffers is not None else HostBuffers()
            if staging is not None:
                staging.late = deepspeed_checkpoint.step_written(self.engine)
        write = None
        try:
            write = deepspeed_checkpoint.save(self.engine, directory, self.dp_size, self.stage, self.is_main, host,
                                              staging if copy else None)
        finally:
            if write is None and staging is not None:
                staging.done()
        return write

    def reserve_checkpoint_memory(self, buffers: HostBuffers, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        """The host memory of an asynchronous save's late copy, allocated ahead: the first save's copy finds it
        faulted in."""
        buffers.reserve_storages(deepspeed_checkpoint.saved_step_written(self.engine))

    def keep_training_state(self, model: nn.Module, opt: torch.optim.Optimizer,
                            directory: Path) -> Callable[[], None]:
        """The engine's own checkpoint in `directory` (a copy of its partitioned state cannot be loaded back)."""
        return kept_on_disk(self, model, opt, directory)

    def load_checkpoint(self, directory: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        """Read what `save_checkpoint` wrote, on any number of processes (a ZeRO checkpoint on another number is
        converted to DeepSpeed's universal format first); a full-state checkpoint (`model.safetensors`) too."""
        if not deepspeed_checkpoint.is_engine_checkpoint(directory):
            return super().load_checkpoint(directory, model, opt)
        zero = self.config["zero_optimization"]
        nvme = any(zero.get(f"offload_{what}", {}).get("device") == "nvme" for what in ("optimizer", "param"))
        deepspeed_checkpoint.load(self.engine, directory, self.dp_size, self.stage, self.is_main, self.barrier, nvme)


# ---------------------------------------------------------------------- helpers
def _engine_precision(precision: FullPrecision, device: torch.device) -> FullPrecision:
    """The engine scales fp16 losses itself: keep autocast, drop a GradScaler."""
    if precision.name == "no":
        return FullPrecision()
    return AutocastPrecision(torch.bfloat16 if precision.name == "bf16" else torch.float16, device.type)


if __name__ == "__main__" and sys.argv[1:] == ["--build-ops"]:  # `make setup-deepspeed`
    build_ops()
