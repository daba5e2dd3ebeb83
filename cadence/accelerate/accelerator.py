"""`Accelerator`: Hugging Face Accelerate's low-level API on cadence's strategies.

A script written for Accelerate runs after one changed import, on every engine cadence has:
`prepare` hands models and optimizers to the same Strategy `learn.distrib_ctx()` uses (from the
registry: DDP, FSDP, ...), loaders become `DistributedDL` shards and precision is the same plugin
the Learner's MixedPrecision uses. Nothing here asks which engine runs.

>>> from cadence import Accelerator                 # was: from accelerate import Accelerator
>>> accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=4)
>>> model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)
>>> for batch in train_dl:
...     with accelerator.accumulate(model):
...         loss = model(**batch).loss
...         accelerator.backward(loss)
...         optimizer.step(); scheduler.step(); optimizer.zero_grad()
>>> preds = accelerator.gather_for_metrics(preds)
>>> accelerator.save_state()
"""

from __future__ import annotations

import contextlib
import gc
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..compile import check_compile_options, compile_model, options_from_env
from ..distributed import ops
from ..distributed.data import DistributedDL
from ..distributed.precision import make_precision
from .checkpointing import (automatic_checkpoint_dir, latest_checkpoint_dir, load_accelerator_state,
                            save_accelerator_state)
from .handlers import (DistributedDataParallelKwargs, DummyOptim, DummyScheduler, GradScalerKwargs,
                       InitProcessGroupKwargs, ProjectConfiguration)
from .prepared import PreparedDataLoader, PreparedOptimizer, PreparedScheduler
from .preparation import (all_tensors, autocast_forward, make_strategy, optimizes, owns_parameters, restore_forward,
                          retarget, sort_handlers, split_loader)
from .state import GradientState, PartialState
from .trackers import TrackerSet

__all__ = ["Accelerator"]

class Accelerator:
    """Accelerate's `Accelerator`: prepare your objects, then write the training loop yourself.

    Args:
        mixed_precision: "no", "fp16" or "bf16" (default: `cadence launch --mixed_precision`, else "no").
        gradient_accumulation_steps: micro-batches per optimizer step inside `accumulate` (default: the launcher's).
        cpu: train on the CPU even when a GPU is there.
        strategy: "ddp", "fsdp", ... or a Strategy (default: the launcher's, else DDP).
        log_with: trackers for `init_trackers`: "tensorboard", "wandb", "csv", a GeneralTracker, a list, or "all"
            (every named tracker whose package is installed). An unknown name is refused here.
        project_dir / project_config: where `save_state()` and the trackers write (a `ProjectConfiguration`).
        kwargs_handlers: `DistributedDataParallelKwargs`, `GradScalerKwargs`, `InitProcessGroupKwargs`.
        step_scheduler_with_optimizer: step prepared schedulers only when the optimizer stepped (default).
        split_batches: loaders' batch size is the global one, split between the processes.
        device_placement: prepared loaders put batches on `accelerator.device`.
        dynamo_backend: torch.compile backend for prepared models ("inductor", "aot_eager", ...; "no": none);
            by default what `cadence launch --dynamo_backend` set. Compiled in place: saved weights keep their names.

    >>> accelerator = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024)])
    """

    def __init__(self, device_placement: bool = True, split_batches: bool = False, mixed_precision: str | None = None,
                 gradient_accumulation_steps: int | None = None, cpu: bool = False, log_with: Any = None,
                 project_dir: str | os.PathLike | None = None, project_config: ProjectConfiguration | None = None,
                 kwargs_handlers: list | None = None, dynamo_backend: str | None = None,
                 step_scheduler_with_optimizer: bool = True, strategy: Any = None):
        handlers = sort_handlers(kwargs_handlers)
        steps = (gradient_accumulation_steps if gradient_accumulation_steps is not None
                 else int(os.environ.get("CADENCE_GRADIENT_ACCUMULATION_STEPS", "1")))
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be a positive int, got {gradient_accumulation_steps!r}")
        self.mixed_precision = mixed_precision or os.environ.get("CADENCE_MIXED_PRECISION", "no")
        self.project_configuration = project_config or ProjectConfiguration()
        if project_dir is not None:
            self.project_configuration.project_dir = str(project_dir)
            self.project_configuration.logging_dir = self.project_configuration.logging_dir or str(project_dir)
        self.device_placement, self.split_batches = device_placement, split_batches
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.compile_options = _compile_options(dynamo_backend)
        self.dynamo_backend = (self.compile_options or {}).get("backend", "no")
        pg = handlers.get(InitProcessGroupKwargs, InitProcessGroupKwargs())
        self.state = PartialState(cpu=cpu, backend=pg.backend, timeout=pg.timeout)
        self.strategy = make_strategy(strategy, cpu, handlers.get(DistributedDataParallelKwargs))
        self.strategy.setup_environment()
        scaler = handlers.get(GradScalerKwargs, GradScalerKwargs()).to_kwargs() if self.mixed_precision == "fp16" else {}
        self.strategy.set_precision(make_precision(self.mixed_precision, self.strategy.device, **scaler))
        self.gradient_state = GradientState(steps)
        self.trackers = TrackerSet(log_with, self.logging_dir)
        self.step = 0   # micro-steps seen by `accumulate` in the current window
        self._models: list[nn.Module] = []
        self._model_opts: list[torch.optim.Optimizer | None] = []
        self._optimizers: list[PreparedOptimizer] = []
        self._schedulers: list[PreparedScheduler] = []
        self._dataloaders: list[PreparedDataLoader] = []
        self._custom_objects: list[Any] = []
        self._trigger = False

    # ------------------------------------------------------------------ who am I
    @property
    def device(self) -> torch.device:
        return self.strategy.device

    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        return self.state.local_process_index

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.state.is_last_process

    @property
    def use_distributed(self) -> bool:
        return self.state.use_distributed

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @property
    def sync_gradients(self) -> bool:
        """False on the micro-steps of an accumulation window (no all-reduce, no optimizer step)."""
        return self.gradient_state.sync_gradients

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when the last step of a prepared optimizer was skipped (fp16 overflow)."""
        return any(opt.step_was_skipped for opt in self._optimizers)

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    # ------------------------------------------------------------------ prepare
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
                out[i] = self._prepare_model(arg, mine)
                prepared_opts.update({id(o): PreparedOptimizer(o, self) for o in mine})
        for i, arg in enumerate(args):
            if is_opt[i]:
                out[i] = prepared_opts.get(id(arg)) or PreparedOptimizer(self._refuse_dummy(arg), self)
                self._optimizers.append(out[i])
            elif isinstance(arg, DataLoader):
                out[i] = self._prepare_loader(arg, placement[i])
        for i, arg in enumerate(args):
            if isinstance(arg, torch.optim.lr_scheduler.LRScheduler):
                out[i] = self._prepare_scheduler(arg)
            elif isinstance(arg, DummyScheduler):
                out[i] = arg  # the engine that built the optimizer from its config steps this schedule itself
        return out[0] if len(out) == 1 else tuple(out)

    def _prepare_model(self, model: nn.Module, opts: list) -> nn.Module:
        if any(model is m for m in self._models):
            return model
        if self.strategy.precision.name != "no":
            autocast_forward(model, self.strategy.forward_context)
        names = {id(p): n for n, p in model.named_parameters()}

        def make_opt(wrapped: nn.Module) -> Any:
            params = dict(self.strategy.unwrap(wrapped).named_parameters())
            for opt in opts:
                retarget(opt, names, params)
            return opts[0] if opts else None
        wrapped, opt = self.strategy.setup(model, make_opt, self.strategy.precision)
        self._refuse_dummy(opt)
        wrapped = self._compile_model(wrapped)
        self._models.append(wrapped)
        self._model_opts.append(opt)
        return wrapped

    def _compile_model(self, model: nn.Module) -> nn.Module:
        """torch.compile the module inside the engine's wrapper, in place (`cadence.compile.compile_model`)."""
        if self.compile_options is not None:
            compile_model(self.strategy.unwrap(model), **self.compile_options)
        return model

    def _refuse_dummy(self, opt: Any) -> Any:
        if isinstance(opt, DummyOptim):
            raise ValueError(f"DummyOptim stands for an optimizer a DeepSpeed config names, but strategy "
                             f"{self.strategy.name!r} builds none from a config: pass a torch optimizer, or launch "
                             f"with --use_deepspeed and a config that has an `optimizer` section")
        return opt

    def _prepare_loader(self, dl: DataLoader, placement: bool) -> PreparedDataLoader:
        if self.split_batches:
            dl = split_loader(dl, self.num_processes)
        sharded = self.strategy.shard(dl)
        if not isinstance(sharded, DistributedDL):  # one device: a one-process shard, resumable and device-placing
            sharded = DistributedDL(dl, rank=0, world_size=1, device=self.device)
        sharded.device = self.device if placement else None
        prepared = PreparedDataLoader(sharded, self.gradient_state)
        self._dataloaders.append(prepared)
        return prepared

    def _prepare_scheduler(self, scheduler: Any) -> PreparedScheduler:
        mine = [o for o in self._optimizers if scheduler.optimizer in (o, o.optimizer)]  # built before or after prepare
        prepared = PreparedScheduler(scheduler, mine, self, self.step_scheduler_with_optimizer)
        self._schedulers.append(prepared)
        return prepared

    # ------------------------------------------------------------------ the step
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` divided by `gradient_accumulation_steps` (scaled for fp16) through the strategy."""
        if self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        self.strategy.backward(loss)

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """One micro-step: gradients synchronise (and optimizers step) only every `gradient_accumulation_steps`
        batches and on a loader's last batch; the others run forward and backward without communicating.

        >>> with accelerator.accumulate(model):
        ...     accelerator.backward(model(**batch).loss); optimizer.step(); optimizer.zero_grad()
        """
        self.step += 1
        sync = self.step % self.gradient_accumulation_steps == 0 or self.gradient_state.end_of_dataloader
        if sync:
            self.step = 0
        self.gradient_state.sync_gradients = sync
        with contextlib.ExitStack() as stack:
            if not sync:
                for model in models:
                    stack.enter_context(self.no_sync(model))
            yield

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Forward and backward in this block keep gradients local (no all-reduce); a no-op on one process."""
        self.strategy.set_gradient_sync(model, False)
        try:
            yield
        finally:
            self.strategy.set_gradient_sync(model, True)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The mixed-precision context (prepared models already run their forward in it)."""
        return self.strategy.forward_context()

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Unscale (fp16), then clip the gradients of the prepared model owning `parameters`; the norm before clipping."""
        params = list(parameters)
        for model, opt in self._units():
            if opt is not None and owns_parameters(model, params, self.strategy):
                return self.strategy.clip_grad_norm(model, opt, max_norm, norm_type)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Unscale (fp16), then clamp every gradient element of the owning prepared model to [-clip_value, clip_value]."""
        params = list(parameters)
        for model, opt in self._units():
            if opt is not None and owns_parameters(model, params, self.strategy):
                return self.strategy.clip_grad_value(model, opt, clip_value)
        torch.nn.utils.clip_grad_value_(params, clip_value)

    # ------------------------------------------------------------------ models and weights
    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True) -> nn.Module:
        """The user's module inside what `prepare` returned (without the autocast forward unless `keep_fp32_wrapper`)."""
        module = self.strategy.unwrap(model)
        if not keep_fp32_wrapper:
            restore_forward(module)
        return module

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full (unsharded) state dict of a prepared model, complete on the main process (sharded engines
        gather it there); every process must call it."""
        return self.strategy.model_state_dict(model)

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike, max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> Path:
        """Full weights as safetensors in the Hugging Face layout (shards and an index above `max_shard_size`)."""
        if not safe_serialization:
            raise ValueError("cadence writes weights as safetensors only; call save_model(..., safe_serialization=True)")
        from ..callbacks.checkpoint import save_model

        return save_model(SimpleNamespace(strategy=self.strategy, model=model), save_directory, max_shard_size)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and load these objects (anything with `state_dict` / `load_state_dict`) with `save_state`."""
        bad = [f"Item at index {i}, of type {type(o).__name__}" for i, o in enumerate(objects)
               if not (callable(getattr(o, "state_dict", None)) and callable(getattr(o, "load_state_dict", None)))]
        if bad:
            raise ValueError("register_for_checkpointing takes objects with state_dict() and load_state_dict(); "
                             "these have not: " + "; ".join(bad))
        self._custom_objects.extend(objects)

    def save_state(self, output_dir: str | os.PathLike | None = None, **kwargs: Any) -> Path:
        """Write a resumable checkpoint of everything prepared and registered (every process calls it).

        With `ProjectConfiguration(automatic_checkpoint_naming=True)` the directory is
        `project_dir/checkpoints/checkpoint_<n>` and only the newest `total_limit` are kept.

        >>> accelerator.save_state("ckpt")       # or accelerator.save_state() with automatic naming
        """
        if kwargs.get("safe_serialization") is False:
            raise ValueError("cadence writes weights as safetensors only; drop safe_serialization=False")
        config = self.project_configuration
        if config.automatic_checkpoint_naming:
            if config.project_dir is None:
                raise ValueError("automatic_checkpoint_naming needs a project_dir: Accelerator(project_dir=...)")
            directory = automatic_checkpoint_dir(Path(config.project_dir), config.iteration, config.total_limit)
        elif output_dir is None:
            raise ValueError("save_state needs output_dir, or ProjectConfiguration(automatic_checkpoint_naming=True)")
        else:
            directory = Path(output_dir)
        save_accelerator_state(self, directory)
        config.iteration += 1
        return directory

    def load_state(self, input_dir: str | os.PathLike | None = None, **kwargs: Any) -> None:
        """Restore a `save_state` checkpoint (default with automatic naming: the newest one).

        Loaders continue where they stood when it was saved (the rest of that epoch).
        """
        if input_dir is None:
            if not self.project_configuration.automatic_checkpoint_naming or self.project_dir is None:
                raise ValueError("load_state needs input_dir, or ProjectConfiguration(automatic_checkpoint_naming=True)")
            input_dir = latest_checkpoint_dir(Path(self.project_dir))
        load_accelerator_state(self, input_dir)

    def skip_first_batches(self, dataloader: PreparedDataLoader, num_batches: int = 0) -> PreparedDataLoader:
        """`dataloader`, whose next iteration starts at batch `num_batches` (the skipped ones are not loaded)."""
        if not isinstance(dataloader, PreparedDataLoader):
            raise TypeError(f"skip_first_batches takes a loader returned by prepare, got {type(dataloader).__name__}")
        dataloader.skip_batches(num_batches)
        return dataloader

    def _units(self) -> list[tuple[nn.Module, torch.optim.Optimizer | None]]:
        return list(zip(self._models, self._model_opts))

    # ------------------------------------------------------------------ collectives
    def gather(self, tensor: Any) -> Any:
        """Every process's tensors concatenated on dim 0, in process order."""
        return ops.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """`gather` without the samples the loader being iterated added as padding: each sample counted once.

        Tensors (nested in tuples, lists, dicts) are gathered as tensors; other objects (strings)
        with `gather_object`, or whenever `use_gather_object`.

        >>> preds, refs = accelerator.gather_for_metrics((logits.argmax(-1), batch["labels"]))
        """
        dl = self.gradient_state.active_dataloader
        if use_gather_object or not all_tensors(input_data):
            return self._gather_objects_for_metrics(input_data, dl)
        if dl is None:
            return ops.gather(input_data)
        return ops.gather_for_metrics(input_data, dl.base)

    def _gather_objects_for_metrics(self, data: Any, dl: PreparedDataLoader | None) -> list:
        parts = ops.gather_object(list(data))
        if dl is None or dl.base.last_batch is None:
            return [x for part in parts for x in part]
        start = dl.base.last_batch[0]
        return [x for r, part in enumerate(parts)
                for x, real in zip(part, dl.base.real_mask(r, start, len(part)).tolist()) if real]

    def gather_object(self, obj: Any) -> list:
        """Every process's picklable `obj`; lists are concatenated (Accelerate's convention)."""
        parts = ops.gather_object(obj)
        return [x for part in parts for x in part] if all(isinstance(p, (list, tuple)) for p in parts) else parts

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """`reduction` ("sum", "mean", "max", "min") of the tensors over every process, times `scale`."""
        out = ops.reduce(tensor, reduction)
        return out if scale == 1.0 else ops.map_tensors(lambda t: t * scale, out)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
        """Pad along `dim` to the largest size any process has (so the tensors can be gathered)."""
        return ops.pad_across_processes(tensor, dim, pad_index, pad_first)

    def split_between_processes(self, inputs: Any, apply_padding: bool = False):
        """Context manager giving this process its contiguous part of `inputs` (see `PartialState`)."""
        return self.state.split_between_processes(inputs, apply_padding)

    def set_trigger(self) -> None:
        """Raise a flag on this process; `check_trigger` sees it on every process (e.g. to stop early)."""
        self._trigger = True

    def check_trigger(self) -> bool:
        """True on every process when any process called `set_trigger` since the last check (which resets it)."""
        flag = ops.reduce(torch.tensor(float(self._trigger), device=self.device), "sum")
        self._trigger = False
        return bool(flag.item() > 0)

    # ------------------------------------------------------------------ processes
    def wait_for_everyone(self) -> None:
        self.state.wait_for_everyone()

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return self.state.main_process_first()

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return self.state.local_main_process_first()

    def on_main_process(self, function: Callable) -> Callable:
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Callable) -> Callable:
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Callable) -> Callable:
        return self.state.on_last_process(function)

    def on_process(self, function: Callable, process_index: int) -> Callable:
        return self.state.on_process(function, process_index)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` once, on the main process."""
        self.state.print(*args, **kwargs)

    def free_memory(self, *objects: Any) -> list[None]:
        """Forget everything prepared, collect garbage, empty the device cache; returns Nones for `objects`.

        >>> model, optimizer = accelerator.free_memory(model, optimizer)
        """
        for registry in (self._models, self._model_opts, self._optimizers, self._schedulers, self._dataloaders):
            registry.clear()
        self.step = 0
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [None] * len(objects)

    # ------------------------------------------------------------------ trackers
    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        """Open a run on every tracker given as `log_with` (main process only), storing `config`."""
        self.trackers.init(project_name, config, init_kwargs or {}, self.is_main_process)

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Log `values` at `step` (default: one after the last) on the main process."""
        self.trackers.log(values, step)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called `name` (with `unwrap`, its writer or W&B run); a do-nothing tracker off the main process."""
        return self.trackers.get(name, unwrap)

    def end_training(self) -> None:
        """Close the trackers' runs and wait for every process."""
        self.trackers.finish()
        self.wait_for_everyone()

    def __repr__(self) -> str:
        return (f"Accelerator(strategy={self.strategy.name!r}, mixed_precision={self.mixed_precision!r}, "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}, {self.state!r})")


def _compile_options(dynamo_backend: str | None) -> dict[str, Any] | None:
    """torch.compile options from `dynamo_backend`, else from the launcher's `CADENCE_DYNAMO_*`; None: no compile."""
    if dynamo_backend is None:
        return options_from_env()
    if str(dynamo_backend).lower() == "no":
        return None
    return check_compile_options({"backend": str(dynamo_backend).lower()})
