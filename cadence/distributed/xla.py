"""XLA: train on torch_xla devices (TPU; the XLA CPU device here) behind the Strategy interface.

Opt-in only (`strategy="xla"`); torch_xla is imported here and nowhere else. The device comes from
the XLA runtime; every step ends with `torch_xla.sync()`, which runs the step's graph once; the
loaders (`XlaDL`) move batches to the device and sync at every batch boundary (validation too), so
values the loop and the Recorder keep are read only after a sync. Shapes stay static: a ragged last
batch keeps its size (every sample counts once) and adds one graph, compiled in the first epoch and
reused after, so the compile count stays constant after warm-up. bf16 runs under
`torch.autocast("xla", dtype=torch.bfloat16)`; checkpoints are written from CPU copies and load
without torch_xla.

Three forms:
- one process, one device: `XLA()`;
- SPMD, one process driving every device of the host through a mesh: `XLA(spmd=True)` shards the
  batch over all devices (data parallel), `XLA(spmd=True, fsdp=True)` also shards the weights
  (torch_xla's FSDPv2, mesh axis "fsdp"), `mesh_shape=(2, 2)` gives a 2-D ("data", "fsdp") mesh;
- one process per device under torchrun (`cadence launch --tpu`): the "xla" process group,
  gradients all-reduced once per optimizer step. Untested here: XLA collectives do not run on CPU.

>>> with learn.distrib_ctx(strategy="xla"): learn.fit(2)
>>> with learn.distrib_ctx(strategy="xla", spmd=True, fsdp=True): learn.fit(2)     # CPU_NUM_DEVICES=4 here
>>> XLA.counts()    # {'compiles': 3, 'executions': 41, ...}: graphs compiled and run so far in this process
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from .data import DistributedDL
from .ops import map_tensors
from .precision import FullPrecision
from .staging import Staging
from .strategy import MakeOpt, Strategy

__all__ = ["XLA", "XlaDL", "torch_xla_module"]

INSTALL_HINT = ('pip install "cadence[xla]" (torch and torch_xla of the same version, e.g. torch==2.9.0 '
                'torch-xla==2.9.0), or `make setup-xla` in a clone of cadence')


def torch_xla_module() -> Any:
    """`import torch_xla`, or an ImportError saying how to install it."""
    try:
        import torch_xla
        import torch_xla.runtime  # noqa: F401
    except ImportError as e:
        raise ImportError(f'strategy "xla" needs torch_xla, which is not importable here ({e}): {INSTALL_HINT}') from None
    return torch_xla


class XlaDL(DistributedDL):
    """DistributedDL for XLA: batches on the XLA device (sharded over the mesh in SPMD), a sync before each."""

    def __init__(self, dl: DataLoader, strategy: XLA, **kwargs: Any):
        super().__init__(dl, rank=strategy.dp_rank, world_size=strategy.dp_size, device=strategy.device, **kwargs)
        self.strategy = strategy

    def __iter__(self) -> Iterator[Any]:
        for batch in super().__iter__():
            self.strategy.sync_pending()  # what the last batch left (a validation forward, metric sums) runs now
            self.strategy.seed_next_batch()
            yield self.strategy.place(batch)


class XLA(Strategy):
    """Train on the XLA device(s) of this host; see the module docstring.

    Args:
        spmd: one process drives every device through a mesh (`torch_xla.runtime.use_spmd()`).
        fsdp: with spmd, shard the weights too (FSDPv2 over the mesh axis "fsdp").
        mesh_shape: devices per mesh axis; its product must be the runtime's device count
            (default: all devices on one axis).
        axis_names: names of the mesh axes (default "data", or "fsdp" with fsdp; ("data", "fsdp") in 2-D).
            The batch is sharded over the axes named "data" and "fsdp".
    """

    name = "xla"

    def __init__(self, device: torch.device | str | None = None, spmd: bool = False, fsdp: bool = False,
                 mesh_shape: tuple[int, ...] | None = None, axis_names: tuple[str, ...] | None = None):
        self.xla = torch_xla_module()
        if (fsdp or mesh_shape is not None or axis_names is not None) and not spmd:
            raise ValueError("fsdp, mesh_shape and axis_names describe an SPMD mesh: pass spmd=True with them")
        if mesh_shape is not None and (not mesh_shape or any(not isinstance(n, int) or n < 1 for n in mesh_shape)):
            raise ValueError(f"mesh_shape must be a tuple of positive ints, got {mesh_shape!r}")
        self.spmd, self.fsdp = spmd, fsdp
        self.mesh_shape = tuple(mesh_shape) if mesh_shape is not None else None
        self.axis_names = tuple(axis_names) if axis_names is not None else None
        self.mesh: Any = None
        self.created_group = False
        self._device = torch.device(device) if device is not None else None
        self._sync_grads = True
        self._just_synced = False  # the optimizer step has just run its graph (XlaDL need not sync again)
        self._step_pending = False  # an optimizer step traced, its graph not run yet (see `step`)
        self._rng_base: int | None = None   # see seed_next_batch
        self._batches_served = 0
        self._params: list[nn.Parameter] = []  # what backward all-reduces with one process per device
        self.precision = FullPrecision()

    # ------------------------------------------------------------------ lifecycle
    @property
    def device(self) -> torch.device:
        if self._device is None:
            self.setup_environment()
        return self._device

    @device.setter
    def device(self, value: torch.device) -> None:
        self._device = torch.device(value)

    def setup_environment(self) -> None:
        """SPMD mode and the mesh, or the "xla" process group under torchrun; then the device."""
        import torch_xla.runtime as xr

        if self.spmd:
            xr.use_spmd()  # before any tensor is on the device
            self.mesh = self._make_mesh(xr.global_runtime_device_count())
        elif int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            self._init_process_group()
        if self._device is None:
            self._device = self.xla.device()

    def _make_mesh(self, n_devices: int) -> Any:
        import numpy as np
        import torch_xla.distributed.spmd as xs

        shape = self.mesh_shape or (n_devices,)
        names = self.axis_names or (("data", "fsdp") if len(shape) == 2 else ("fsdp",) if self.fsdp else ("data",))
        if math.prod(shape) != n_devices:
            raise ValueError(f"mesh_shape={shape} covers {math.prod(shape)} devices but the XLA runtime has "
                             f"{n_devices} (TPU chips, or CPU_NUM_DEVICES on the CPU): give a shape whose product "
                             f"is {n_devices}, e.g. ({n_devices},)")
        if len(names) != len(shape):
            raise ValueError(f"axis_names={names} names {len(names)} axes but mesh_shape={shape} has {len(shape)}")
        if self.fsdp and "fsdp" not in names:
            raise ValueError(f"fsdp=True shards the weights over the mesh axis 'fsdp'; axis_names={names} has none")
        if not {"data", "fsdp"} & set(names):
            raise ValueError(f"axis_names={names}: the batch is sharded over the axes 'data' and 'fsdp'; name one so")
        mesh = xs.Mesh(np.arange(n_devices), shape, names)
        xs.set_global_mesh(mesh)
        return mesh

    def _init_process_group(self) -> None:
        """One process per device (torchrun / `cadence launch --tpu`): the "xla" backend, checked against torchrun."""
        import torch_xla.distributed.xla_backend  # noqa: F401  (registers the "xla" backend)

        expected = int(os.environ["WORLD_SIZE"])
        dist.init_process_group("xla", init_method="xla://")
        self.created_group = True
        if dist.get_world_size() != expected:
            got = dist.get_world_size()
            dist.destroy_process_group()
            self.created_group = False
            raise RuntimeError(
                f"torchrun started {expected} processes but the XLA runtime gives this one a world of {got}: "
                f"each would train alone on its own copy of the data. On a TPU host launch one process per chip "
                f"as torch_xla documents (PJRT_DEVICE=TPU); on the CPU (PJRT_DEVICE=CPU), "
                f"whose XLA collectives do not work across processes, use one process with "
                f'strategy="xla", spmd=True and CPU_NUM_DEVICES=N instead')

    def teardown(self) -> None:
        if self.created_group:
            dist.destroy_process_group()
            self.created_group = False

    # ------------------------------------------------------------------ model, data
    def setup(self, model: nn.Module, make_opt: MakeOpt, precision: FullPrecision | None = None
              ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Move `model` to the device (FSDPv2-wrap it with fsdp=True), then build the optimizer over it."""
        if precision is not None:
            self.set_precision(precision)
        model = model.to(self.device)
        if self.fsdp:
            from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

            model = SpmdFullyShardedDataParallel(model, mesh=self.mesh, shard_output=self._shard_output)
        self._params = list(model.parameters())
        return model, make_opt(model)

    def unwrap(self, model: nn.Module) -> nn.Module:
        model = super().unwrap(model)
        return super().unwrap(model.module) if self.fsdp and hasattr(model, "module") else model

    def release(self, model: nn.Module, opt: torch.optim.Optimizer, make_opt: MakeOpt
                ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The user's module back on the CPU with the trained weights, and an optimizer over it with the trained state."""
        self.xla.sync()
        state = self.optimizer_state_dict(model, opt)
        plain = self.unwrap(model).to("cpu")
        new_opt = make_opt(plain)
        new_opt.load_state_dict(state)
        return plain, new_opt

    def shard(self, dl: DataLoader) -> XlaDL:
        """This process's part of `dl` (all of it in SPMD), batches on the device."""
        return XlaDL(dl, self)

    def place(self, batch: Any) -> Any:
        """In SPMD, shard every tensor of a batch (already on the device) along dim 0 over the data axes."""
        if self.mesh is None:
            return batch
        import torch_xla.distributed.spmd as xs

        def mark(t: torch.Tensor) -> torch.Tensor:
            if t.ndim:
                xs.mark_sharding(t, self.mesh, self._batch_spec(t))
            return t
        return map_tensors(mark, batch)

    def _batch_spec(self, t: torch.Tensor) -> tuple:
        """`t` split along dim 0 over the mesh's data axes ("data", "fsdp" or both), whole along the others."""
        axes = tuple(a for a in self.mesh.axis_names if a in ("data", "fsdp"))
        return (axes[0] if len(axes) == 1 else axes, *([None] * (t.ndim - 1)))

    def _shard_output(self, output: Any, mesh: Any) -> None:
        """FSDPv2's mark of the forward's output as split along the batch, as the batch is: the output itself, or
        a Hugging Face model's `logits` (torch_xla's own mark takes a tensor or a tuple, and refused a ModelOutput),
        or the first tensor of any other tuple, list or dict."""
        import torch_xla.distributed.spmd as xs

        tensor = _batch_tensor(output)
        if tensor is None:
            raise RuntimeError(f"strategy='xla' with fsdp=True marks the model's output as split along the batch, and "
                               f"its {type(output).__name__} holds no tensor with a batch dimension: return a tensor, "
                               f"a tuple of them or a dict (a Hugging Face ModelOutput)")
        xs.mark_sharding(tensor, mesh, self._batch_spec(tensor))

    # ------------------------------------------------------------------ one step
    def set_precision(self, precision: FullPrecision) -> None:
        if precision.name == "fp16":
            raise ValueError('fp16 (with a GradScaler) is not supported on XLA: use bf16 (MixedPrecision("bf16"), '
                             'learn.to_bf16() or --mixed_precision bf16)')
        self.precision = precision

    def set_gradient_sync(self, model: nn.Module, enabled: bool) -> None:
        self._sync_grads = enabled

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward, traced on this thread; with one process per device, the gradients are averaged once, at the
        optimizer step's micro-step.

        Autograd hands the backward of device tensors to a worker thread of its own and waits for it; on XLA that
        thread only traces the graph, and the hand-off cost ~65 us a step (a quarter of the backward's tracing for
        bench/xla.py's model) and, now and then, milliseconds at a fit's first step. One process drives one
        device here (SPMD included), so nothing runs in parallel on another device's thread.
        """
        with torch.autograd.set_multithreading_enabled(False):
            self.precision.backward(loss, **kwargs)
        if self._sync_grads and self.created_group:
            import torch_xla.core.xla_model as xm

            grads = [p.grad for p in self._params if p.grad is not None]
            xm.all_reduce(xm.REDUCE_SUM, grads, scale=1.0 / dist.get_world_size())

    def step(self, opt: torch.optim.Optimizer) -> bool:
        """Step the optimizer; its graph runs once the gradients are dropped (`zero_grad` / `end_of_step`), so they
        are not among the graph's outputs (a hand-written loop's zero_grad before its sync does the same)."""
        stepped = self.precision.step(opt)
        self._step_pending = True
        return stepped

    def zero_grad(self, opt: torch.optim.Optimizer) -> None:
        super().zero_grad(opt)
        self.end_of_step()

    def end_of_step(self) -> None:
        """Run the optimizer step's graph (`torch_xla.sync()`): one execution per step."""
        if self._step_pending:
            self.xla.sync()
            self._step_pending, self._just_synced = False, True

    def sync_pending(self) -> None:
        """Run what was traced since the last sync; nothing when that was the optimizer step's (nothing new to run)."""
        if self._step_pending:
            self.end_of_step()
        elif not self._just_synced:
            self.xla.sync()
        self._just_synced = False

    # ------------------------------------------------------------------ the data-parallel group
    @property
    def dp_rank(self) -> int:
        return dist.get_rank() if self.created_group else 0

    @property
    def dp_size(self) -> int:
        return dist.get_world_size() if self.created_group else 1

    def barrier(self) -> None:
        if self.created_group:
            import torch_xla.core.xla_model as xm

            xm.rendezvous("cadence")

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self.created_group:
            return obj
        out = [obj]
        dist.broadcast_object_list(out, src)
        return out[0]

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if not self.created_group:
            return t
        import torch_xla.core.xla_model as xm

        return xm.all_reduce(xm.REDUCE_SUM, t.to(self.device)).to(t.device)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        if not self.created_group:
            return t
        import torch_xla.core.xla_model as xm

        return xm.all_gather(t.to(self.device), dim=0).to(t.device)

    # ------------------------------------------------------------------ state: CPU copies
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The user's module's state, copied to the CPU (whole tensors, also when SPMD shards them)."""
        self.xla.sync()
        return {k: _host(v) for k, v in self.unwrap(model).state_dict().items()}

    def optimizer_state_dict(self, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
        """The optimizer's state with every tensor copied to the CPU (loads without torch_xla; the step counts
        torch keeps on the CPU copied too)."""
        self.xla.sync()
        return map_tensors(_host, opt.state_dict())

    def checkpoint_writer(self, directory: Path, model: nn.Module, opt: torch.optim.Optimizer,
                          copy: bool = False, staging: Staging | None = None) -> Callable[[], None] | None:
        """The base format, written from the CPU copies the state dicts take now (after a sync): they already are
        the host copy an asynchronous save writes from (`copy` copies nothing more), and nothing is left for the
        writer's thread to copy (`staging.done()` said): it cannot read XLA tensors, which have no host memory."""
        write = super().checkpoint_writer(directory, model, opt)
        if staging is not None:
            staging.done()
        return write

    # ------------------------------------------------------------------ the device's random numbers
    # Dropout on the device draws from XLA's generator, whose seed also moves at every graph execution (a
    # checkpoint's or an evaluation's included), so its running value cannot be saved and given back at the
    # same point of the run. Each batch therefore gets its own seed, from torch's initial seed (`set_seed`)
    # and the number of batches served: a resumed run draws what the uninterrupted one drew.
    def seed_next_batch(self) -> None:
        """Seed XLA's generator for the batch about to run (called by `XlaDL` before each batch)."""
        import torch_xla.core.xla_model as xm

        if self._rng_base is None:
            self._rng_base = torch.initial_seed()
        self._batches_served += 1
        xm.set_rng_state(_mix(self._rng_base, self._batches_served), self.device)

    def device_rng_state(self) -> dict[str, Any]:
        """The per-batch seeding's position, and XLA's running seed (for loops whose loaders are not `XlaDL`)."""
        import torch_xla.core.xla_model as xm

        return {"xla_base": self._rng_base, "xla_batches": self._batches_served,
                "xla_seed": int(xm.get_rng_state(self.device))}

    def set_device_rng_state(self, state: dict[str, Any]) -> None:
        import torch_xla.core.xla_model as xm

        self._rng_base, self._batches_served = state.get("xla_base"), state.get("xla_batches", 0)
        if "xla_seed" in state:
            xm.set_rng_state(int(state["xla_seed"]), self.device)

    # ------------------------------------------------------------------ what the runtime did
    @staticmethod
    def counts() -> dict[str, int]:
        """Graphs compiled, graph executions, device buffers the executions returned (their outputs) and transfers
        between host and device (`to_device`, `to_host`: calls, each maybe of several tensors) so far in this
        process (torch_xla.debug.metrics), once the device has finished what it was given (an execution is counted
        when it ends).

        >>> before = XLA.counts(); learn.fit(1); XLA.counts()["compiles"] - before["compiles"]
        """
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.metrics as met

        xm.wait_device_ops()

        def count(name: str) -> int:
            data = met.metric_data(name)
            return int(data[0]) if data else 0
        return {"compiles": count("CompileTime"), "executions": count("ExecuteTime") + count("ExecuteReplicatedTime"),
                "outputs": int(met.counter_value("CreateDataHandles") or 0),
                "to_device": count("TransferToDeviceTime"), "to_host": count("TransferFromDeviceTime")}


def _host(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of `t`, never `t` itself (a CPU tensor of the state goes on changing after the save point)."""
    return t.detach().to("cpu", copy=True)


def _mix(base: int, n: int) -> int:
    """A 63-bit seed for batch `n` of a run seeded with `base` (splitmix64: neighbouring n give unrelated seeds)."""
    z = (base + n * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1


def _batch_tensor(output: Any) -> torch.Tensor | None:
    """The tensor of a model's output that has the batch along dim 0: the output, its `logits`, else the first
    tensor of at least one dimension in a tuple, list or dict."""
    if isinstance(output, torch.Tensor):
        return output if output.ndim else None
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor) and logits.ndim:
        return logits
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return next((v for v in values if isinstance(v, torch.Tensor) and v.ndim), None)

