"""DDP: data-parallel training with `torch.nn.parallel.DistributedDataParallel`.

Every rank holds the whole model; gradients are averaged during backward. In a single
process (no process group) the model is left unwrapped, so the same script runs on one process.

>>> strategy = DDP(sync_bn=True)
>>> strategy.setup_environment()
>>> model, opt = strategy.setup(model, make_opt)
>>> train_dl = strategy.shard(train_dl)
>>> ...
>>> strategy.teardown()
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from . import env
from .data import DistributedDL
from .precision import FullPrecision
from .shm_allreduce import SharedMemoryAllReduce, SharedMemoryUnavailable
from .strategy import MakeOpt, Strategy

__all__ = ["DDP"]

_SYNC_BN_DEVICES = ("cuda", "hpu", "xpu")
# Faster than torch's defaults and as safe: gradients live in the communication buckets (no copy in
# and out of them each step, and one less gradient-sized buffer); see bench/ddp.py for the measurement.
DDP_DEFAULTS = {"gradient_as_bucket_view": True}


# torch's bf16 hooks (and the bf16 wrapper) need NCCL on CUDA or XCCL on XPU; torch checks only when DDP registers them
_BF16_HOOKS = ("bf16_compress_hook", "bf16_compress_wrapper_hook")


def _check_hook_device(hook: Any, device: torch.device) -> None:
    if getattr(hook, "__name__", None) in _BF16_HOOKS and device.type not in ("cuda", "xpu"):
        raise ValueError(f"DDP comm hook {hook.__name__} sends bf16 gradients, which torch does only over NCCL (CUDA) "
                         f"or XCCL (XPU), not on {device.type}: use the fp16 hook/wrapper, or none")


def _has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


class TransparentDDP(DistributedDataParallel):
    """DistributedDataParallel that also answers the wrapped model's own public attributes (`generate`, `config`), as
    a model under FSDP2 or DeepSpeed's engine does: `learn.model.generate(ids)` is the same line on every engine.
    Its `state_dict()` is still the wrapper's (`module.` names): give functions that read a model's weights (peft's
    `get_peft_model_state_dict`, ...) `learn.strategy.unwrap(learn.model)`.

    >>> with learn.distrib_ctx(strategy="ddp"):
    ...     tokens = learn.model.generate(ids, max_new_tokens=8)
    """

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # DDP's own, its parameters and submodules
        except AttributeError as missing:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None or name == "module" or name.startswith("_"):   # a compiled model's `_orig_mod` is not
                raise                                                        # the wrapper's: unwrapping stops here
            try:
                return getattr(inner, name)
            except AttributeError:
                raise missing from None


class DDP(Strategy):
    """Wrap the model in DistributedDataParallel; BatchNorm becomes SyncBatchNorm when `sync_bn`.

    Extra keyword arguments go to DistributedDataParallel (e.g. `find_unused_parameters=True`,
    `bucket_cap_mb=50`) and override cadence's defaults (`gradient_as_bucket_view=True`).
    `comm_hook` (and `comm_state`) registers a DDP communication hook, e.g.
    `torch.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_hook`; `None` keeps
    DDP's own all-reduce; the default, "auto", averages gradients through shared memory when every
    rank trains on this machine's CPU (`SharedMemoryAllReduce`, same result, faster than gloo).

    >>> with learn.distrib_ctx(strategy="ddp", sync_bn=False, bucket_cap_mb=50): learn.fit(1)
    """

    name = "ddp"

    def __init__(self, device: torch.device | str | None = None, sync_bn: bool = False,
                 comm_hook: Callable | str | None = "auto", comm_state: Any = None, **ddp_kwargs: Any):
        super().__init__(device)
        unknown = sorted(set(ddp_kwargs) - set(inspect.signature(DistributedDataParallel).parameters))
        if unknown:
            raise TypeError(f"unknown DDP option(s) {unknown}: DDP takes sync_bn, comm_hook, comm_state and "
                            f"DistributedDataParallel's keyword arguments (bucket_cap_mb, find_unused_parameters, ...)")
        if isinstance(comm_hook, str) and comm_hook != "auto":
            raise ValueError(f"comm_hook={comm_hook!r}: pass a DDP communication hook function, None for DDP's own "
                             f"all-reduce, or 'auto'")
        self.sync_bn, self.comm_hook, self.comm_state = sync_bn, comm_hook, comm_state
        _check_hook_device(comm_hook, self.device)
        self.ddp_kwargs = {**DDP_DEFAULTS, **ddp_kwargs}
        self.created_group = False
        self.shared_memory: SharedMemoryAllReduce | None = None     # the "auto" hook's state, one per group

    def setup_environment(self) -> None:
        """Create the process group if the launcher asked for several processes and none exists yet."""
        self.created_group = env.setup_distrib() or self.created_group

    def teardown(self) -> None:
        """Destroy the process group, only if `setup_environment` created it."""
        self.shared_memory = None
        if self.created_group:
            env.teardown_distrib()
            self.created_group = False

    def setup(self, model: nn.Module, make_opt: MakeOpt, precision: FullPrecision | None = None
              ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Move `model` to the device, convert BatchNorm if asked, wrap it in DDP, build the optimizer.

        SyncBatchNorm runs on GPUs only: on cpu and mps the BatchNorm layers stay per-process, with a warning.
        """
        if precision is not None:
            self.set_precision(precision)
        model = model.to(self.device)
        if self.sync_bn and _has_batchnorm(model):
            model = self._convert_sync_bn(model)
        opt = make_opt(model)  # DDP keeps the module's Parameter objects: the optimizer may see them unwrapped
        if not env.is_initialized():
            return model, opt
        return self._wrap(model), opt

    def _wrap(self, model: nn.Module) -> DistributedDataParallel:
        device_ids = [self.device] if self.device.type == "cuda" else None
        wrapped = TransparentDDP(model, device_ids=device_ids, **self.ddp_kwargs)
        if self.comm_hook == "auto":
            self._use_shared_memory(wrapped)
        elif callable(self.comm_hook):
            wrapped.register_comm_hook(self.comm_state, self.comm_hook)
        return wrapped

    def _use_shared_memory(self, wrapped: DistributedDataParallel) -> None:
        """The "auto" hook: shared-memory averaging when it can serve this DDP (made once, kept for re-wraps)."""
        whole_world = self.ddp_kwargs.get("process_group") is None and self.ddp_kwargs.get("device_mesh") is None
        if self.shared_memory is None and whole_world and SharedMemoryAllReduce.available(self.device):
            try:
                self.shared_memory = SharedMemoryAllReduce()
            except SharedMemoryUnavailable as e:
                if env.rank() == 0:
                    warnings.warn(str(e))
        if self.shared_memory is not None:
            wrapped.register_comm_hook(self.shared_memory, SharedMemoryAllReduce.hook)

    def trainable_changed(self, model: nn.Module, opt: torch.optim.Optimizer
                          ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Wrap the module again: DDP registers its all-reduce hooks for the parameters that required
        gradients when it wrapped (a newly frozen one would be waited for forever, an unfrozen one
        never averaged). The optimizer holds the module's own parameters and stays as it is."""
        if not isinstance(model, DistributedDataParallel):
            return model, opt
        wrapped = self._wrap(model.module)
        wrapped.require_backward_grad_sync = model.require_backward_grad_sync
        return wrapped, opt

    def _convert_sync_bn(self, model: nn.Module) -> nn.Module:
        if self.device.type in _SYNC_BN_DEVICES or self.device.type == torch._C._get_privateuse1_backend_name():
            return nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if env.is_main_process():
            warnings.warn(f"sync_bn=True ignored on {self.device.type}: SyncBatchNorm needs a GPU, so BatchNorm "
                          "statistics stay per-process; pass sync_bn=False to silence this", stacklevel=4)
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the DDP wrapper (and inside a `torch.compile` wrapper, outside DDP or in it)."""
        model = super().unwrap(model)
        return super().unwrap(model.module) if isinstance(model, DistributedDataParallel) else model

    def set_gradient_sync(self, model: nn.Module, enabled: bool) -> None:
        """DDP decides at forward time whether backward all-reduces: set it before the micro-step's forward.

        This is what `DistributedDataParallel.no_sync()` toggles, without a context spanning two events.
        """
        if isinstance(model, DistributedDataParallel):
            model.require_backward_grad_sync = enabled

    def shard(self, dl: DataLoader) -> DistributedDL:
        """This rank's part of `dl` (fastai's sharding), batches moved to this strategy's device."""
        return DistributedDL(dl, device=self.device)
