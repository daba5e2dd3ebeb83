"""`Accelerator.prepare` and its one-object forms (`prepare_model`, `prepare_optimizer`, `prepare_scheduler`,
`prepare_data_loader`), mixed into `Accelerator`.

Objects may be prepared together or apart, in any order: an optimizer prepared after its model (in a
later call, or built over the parameters of the model as given) is bound to that model, pointed at
its wrapped parameters (FSDP replaces them by shards) and saved with it by `save_state`.

>>> model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
>>> model = accelerator.prepare_model(model)                           # or apart: the same result
>>> optimizer = accelerator.prepare_optimizer(torch.optim.AdamW(model.parameters()))
>>> teacher = accelerator.prepare_model(teacher, evaluation_mode=True)   # device, autocast, compile; no wrapper
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..compile import compile_model
from . import sync
from .handlers import DummyOptim, DummyScheduler
from .loaders import shard_loader
from .parallelism import refuse_presliced
from .plugins import DistributedType
from .prepared import EngineScheduler, PreparedDataLoader, PreparedOptimizer, PreparedScheduler
from .preparation import autocast_forward, fit_scheduler_to_groups, optimizes, retarget, split_loader

__all__ = ["PrepareMethods"]

_ONE_CALL_UNDER_DEEPSPEED = ("DeepSpeed builds its engine from the model and its optimizer together: pass both to one "
                             "call, accelerator.prepare(model, optimizer, ...)")


class PrepareMethods:
    """Mixed into `Accelerator`: needs `self.strategy`, the registries set in its `__init__` and `self.device`."""

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Return every argument ready for this run, in the same order (one object: that object).

        Models are wrapped by the strategy before their optimizers are rebuilt over the wrapped
        parameters (FSDP's rule), whatever the order given; loaders become this process's shard,
        schedulers step with their optimizer.

        >>> model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
        """
        if device_placement is not None and len(device_placement) != len(args):
            raise ValueError(f"device_placement has {len(device_placement)} entries for {len(args)} objects")
        placement = device_placement or [self.device_placement] * len(args)
        out = list(args)
        is_opt = [isinstance(a, (torch.optim.Optimizer, DummyOptim)) and not isinstance(a, PreparedOptimizer)
                  for a in args]
        opts = [a for a, o in zip(args, is_opt) if o]
        prepared_opts: dict[int, PreparedOptimizer] = {}
        for i, arg in enumerate(args):
            if isinstance(arg, nn.Module):
                mine = [o for o in opts if optimizes(o, arg)]
                earlier = [] if mine else self._unbound_optimizers_of(arg)
                out[i], built = self._prepare_model(arg, mine or [o.optimizer for o in earlier])
                # a DummyOptim stands for the optimizer the engine built from its config
                prepared_opts.update({id(o): PreparedOptimizer(built if isinstance(o, DummyOptim) else o, self)
                                      for o in mine})
                if mine or earlier:
                    self._stepper[id(out[i])] = prepared_opts[id(mine[0])] if mine else earlier[0]
        for i, arg in enumerate(args):
            if is_opt[i]:
                out[i] = prepared_opts.get(id(arg)) or self._bind_optimizer(arg)
                self._optimizers.append(out[i])
            elif isinstance(arg, DataLoader):
                out[i] = self._prepare_loader(arg, placement[i])
        for i, arg in enumerate(args):
            if isinstance(arg, torch.optim.lr_scheduler.LRScheduler):
                out[i] = self._prepare_scheduler(arg)
            elif isinstance(arg, DummyScheduler):
                out[i] = self._prepare_engine_scheduler(arg)
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """`prepare(model)`; with `evaluation_mode` only moved to the device, run in the mixed precision and
        compiled as configured: no engine wrapper, no gradient sync, not saved by `save_state` (it does not train).

        >>> teacher = accelerator.prepare_model(teacher, evaluation_mode=True)
        """
        if evaluation_mode:
            return self._prepare_for_evaluation(model, self.device_placement if device_placement is None
                                                else device_placement)
        return self._prepare_model(model, [])[0]

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
                          ) -> PreparedOptimizer:
        """`prepare(optimizer)`: bound to the prepared model whose parameters it holds (if that model was prepared).

        >>> optimizer = accelerator.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
        """
        return self.prepare(optimizer)

    def prepare_scheduler(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> PreparedScheduler:
        """`prepare(scheduler)`: steps with its (prepared) optimizer, once per optimizer step taken."""
        if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise TypeError(f"prepare_scheduler takes a torch LRScheduler, got {type(scheduler).__name__}")
        return self._prepare_scheduler(scheduler)

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> PreparedDataLoader:
        """`prepare(data_loader)`: this process's shard, batches on the device unless `device_placement=False`."""
        if slice_fn_for_dispatch is not None:
            raise ValueError("slice_fn_for_dispatch applies to dispatch_batches=True, which cadence does not do (every "
                             "process reads its own shard): drop slice_fn_for_dispatch")
        if not isinstance(data_loader, DataLoader):
            raise TypeError(f"prepare_data_loader takes a torch DataLoader, got {type(data_loader).__name__}")
        return self._prepare_loader(data_loader, self.device_placement if device_placement is None
                                    else device_placement)

    # ------------------------------------------------------------------ one object of each kind
    def _prepare_model(self, model: nn.Module, opts: list) -> tuple[nn.Module, Any]:
        """(the wrapped model, the optimizer the engine gave for it: `opts[0]` rebuilt, or the one a config named)."""
        for k, m in enumerate(self._models):
            if model is m:
                return model, self._model_opts[k]
        refuse_presliced(model, self.parallelism_config)
        self.torch_device_mesh   # model_parallel slices and shards on Accelerate's mesh, the one users were given
        self._refuse_engine_without_optimizer(opts)
        dummy = next((o for o in opts if isinstance(o, DummyOptim)), None)
        if dummy is not None and not (self.distributed_type == DistributedType.DEEPSPEED
                                      and "optimizer" in self.strategy.config):
            self._refuse_dummy(dummy)   # before the engine is built: its own error would not say what to change
        if self.strategy.precision.name != "no":
            autocast_forward(model, self.strategy.forward_context)
        names = {id(p): n for n, p in model.named_parameters()}
        self._group_sizes.update({id(o): [len(g["params"]) for g in o.param_groups] for o in opts
                                  if not isinstance(o, DummyOptim)})

        def make_opt(wrapped: nn.Module) -> Any:
            params = dict(self.strategy.unwrap(wrapped).named_parameters())
            for opt in opts:
                retarget(opt, names, params)
            return opts[0] if opts else None
        wrapped, opt = self.strategy.setup(model, make_opt, self.strategy.precision)
        wrapped = self._compile_model(wrapped)
        sync.give_no_sync(self.strategy, wrapped)
        self._models.append(wrapped)
        self._model_opts.append(opt)
        self._given_names[id(wrapped)] = names
        return wrapped, opt

    def _unbound_optimizers_of(self, model: nn.Module) -> list[PreparedOptimizer]:
        """Optimizers over `model`'s parameters prepared in an earlier call than it, standing alone so far: the
        model's wrapping rebuilds them over its wrapped parameters (FSDP's), as if both came in one call."""
        bound = {id(o) for o in self._model_opts if o is not None}
        earlier = [o for o in self._optimizers if id(o.optimizer) not in bound and optimizes(o.optimizer, model)]
        if earlier and self.distributed_type == DistributedType.DEEPSPEED:
            raise ValueError(_ONE_CALL_UNDER_DEEPSPEED)
        return earlier

    def _refuse_engine_without_optimizer(self, opts: list) -> None:
        """DeepSpeed ZeRO-1/2 engines partition the optimizer: they cannot be built from a model alone."""
        if opts or self.distributed_type != DistributedType.DEEPSPEED:
            return
        stage = self.strategy.config.get("zero_optimization", {}).get("stage", 0)
        if stage in (1, 2) and "optimizer" not in self.strategy.config:
            raise ValueError(f"DeepSpeed ZeRO-{stage} builds its engine from the model and its optimizer together: "
                             f"pass both to one call, accelerator.prepare(model, optimizer, ...) (a model only run "
                             f"forward: prepare_model(model, evaluation_mode=True))")

    def _prepare_for_evaluation(self, model: nn.Module, placement: bool) -> nn.Module:
        if placement:
            model = model.to(self.device)
        if self.strategy.precision.name != "no":
            autocast_forward(model, self.strategy.forward_context)
        return self._compile_model(model)

    def _bind_optimizer(self, opt: Any) -> PreparedOptimizer:
        """A prepared optimizer for `opt`, bound to the prepared model without one whose parameters it holds
        (those the model was given with, or its wrapped ones); any other optimizer stands alone."""
        held = {id(p) for group in opt.param_groups for p in group["params"]} if isinstance(
            opt, torch.optim.Optimizer) else set()
        for k, model in enumerate(self._models):
            names = self._given_names.get(id(model), {})
            current = dict(self.strategy.unwrap(model).named_parameters())
            if not held & (set(names) | {id(p) for p in current.values()}):
                continue
            if self.distributed_type == DistributedType.DEEPSPEED:
                raise ValueError(_ONE_CALL_UNDER_DEEPSPEED)
            if self._model_opts[k] is not None:
                continue   # a second optimizer of one model stands alone (saved apart by save_state)
            retarget(opt, names, current)
            prepared = PreparedOptimizer(opt, self)
            self._model_opts[k], self._stepper[id(model)] = opt, prepared
            return prepared
        return PreparedOptimizer(self._refuse_dummy(opt), self)

    def _compile_model(self, model: nn.Module) -> nn.Module:
        """torch.compile the module inside the engine's wrapper, in place (`cadence.compile.compile_model`)."""
        if self.compile_options is not None:
            compile_model(self.strategy.unwrap(model), **self.compile_options)
        return model

    def _refuse_dummy(self, opt: Any) -> Any:
        if isinstance(opt, DummyOptim):
            here = ("this DeepSpeed config names none" if self.distributed_type == DistributedType.DEEPSPEED
                    else f"strategy {self.strategy.name!r} builds none from a config")
            raise ValueError(f"DummyOptim stands for the optimizer a DeepSpeed config names, and {here}: pass a "
                             f"torch optimizer, or run under DeepSpeed (--use_deepspeed) with a config that has an "
                             f"`optimizer` section")
        return opt

    def _prepare_loader(self, dl: DataLoader, placement: bool) -> PreparedDataLoader:
        if self.split_batches:
            dl = split_loader(dl, self.strategy.dp_size)   # the ranks of a tensor-parallel group share a batch
        sharded = shard_loader(dl, self.strategy, self.dataloader_config)   # in Accelerate's order
        sharded.device = self.device if placement else None
        prepared = PreparedDataLoader(sharded, self.gradient_state, self.rng_types)
        self._dataloaders.append(prepared)
        return prepared

    def _prepare_engine_scheduler(self, dummy: DummyScheduler) -> EngineScheduler:
        """The schedule a DeepSpeed config names, its "auto" values from `dummy`; the engine steps it."""
        if self.distributed_type != DistributedType.DEEPSPEED or self.strategy.engine is None:
            raise ValueError("DummyScheduler stands for the scheduler a DeepSpeed config names: prepare it with the "
                             "model and optimizer under DeepSpeed, or give a torch scheduler on this engine")
        if "scheduler" not in self.strategy.config and dummy.lr_scheduler_callable is None:
            raise ValueError("DummyScheduler stands for the scheduler a DeepSpeed config names, and this config names "
                             "none: add a `scheduler` section, pass DummyScheduler(..., lr_scheduler_callable=fn), or "
                             "give a torch scheduler")
        self.strategy.build_scheduler(dummy.total_num_steps, dummy.warmup_num_steps, dummy.lr_scheduler_callable)
        return EngineScheduler(self.strategy.engine)

    def _prepare_scheduler(self, scheduler: Any) -> PreparedScheduler:
        mine = [o for o in self._optimizers if scheduler.optimizer in (o, o.optimizer)]  # built before or after prepare
        for opt in mine:
            if id(opt.optimizer) in self._group_sizes:
                fit_scheduler_to_groups(scheduler, self._group_sizes[id(opt.optimizer)], opt.param_groups)
        prepared = PreparedScheduler(scheduler, mine, self, self.step_scheduler_with_optimizer)
        self._schedulers.append(prepared)
        return prepared
