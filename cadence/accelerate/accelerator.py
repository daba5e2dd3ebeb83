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
import warnings
from collections import OrderedDict
from typing import Any, Iterator

import torch
from torch import nn

from ..distributed.precision import make_precision
from . import sync
from .clipping import clip_grad_norm, clip_part, refuse_part_under_own_clipping
from .collectives import ProcessHelpers
from .dynamo import TorchDynamoPlugin, compile_options, dynamo_plugin_for
from .handlers import (AutocastKwargs, DistributedDataParallelKwargs, GradScalerKwargs, InitProcessGroupKwargs,
                       ProfileKwargs, ProjectConfiguration)
from .optional_features import OptionalFeatures
from .parallelism import ParallelismConfig, ParallelismProperties, launched_parallelism_config, parallel_engine
from .plugins import (DataLoaderConfiguration, DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin,
                      GradientAccumulationPlugin)
from .prepare_methods import PrepareMethods
from .prepared import PreparedDataLoader, PreparedOptimizer, PreparedScheduler
from .preparation import (check_rng_types, choose_engine, covers_trainable, deepspeed_precision, make_strategy,
                          one_deepspeed_plugin, owns_parameters, refuse_unsupported, sort_handlers,
                          tell_transformers_zero3)
from .properties import RunProperties
from .saving_methods import SavingMethods
from .skip_batches import skip_first_batches
from .state import GradientState, PartialState, remember_first_accelerator, shared_precision
from .state_hooks import StateHooks
from .trackers import TrackerSet

__all__ = ["Accelerator"]

class Accelerator(PrepareMethods, SavingMethods, RunProperties, ProcessHelpers, ParallelismProperties, StateHooks,
                  OptionalFeatures):
    """Accelerate's `Accelerator`: prepare your objects, then write the training loop yourself.

    Args:
        mixed_precision: "no", "fp16" or "bf16" (default: the process's first Accelerator's, else `cadence launch
            --mixed_precision`, else "no"). As in Accelerate, a later Accelerator cannot change it (ValueError);
            under DeepSpeed "no" takes the config's bf16/fp16, and another precision than the config's is refused.
        gradient_accumulation_steps: micro-batches per optimizer step inside `accumulate` (default: the launcher's).
        cpu: train on the CPU even when a GPU is there.
        strategy: "ddp", "fsdp", ... or a Strategy (default: the launcher's, else DDP).
        fsdp_plugin / deepspeed_plugin: Accelerate's engine plugins, mapped onto cadence's FSDP2 / DeepSpeed
            strategies (an FSDP plugin applies on several processes, as in Accelerate).
        dataloader_config: a `DataLoaderConfiguration` (split_batches, data_seed, ...).
        gradient_accumulation_plugin: a `GradientAccumulationPlugin` (num_steps, sync_each_batch).
        log_with: trackers for `init_trackers`: "tensorboard", "wandb", "csv", a GeneralTracker, a list, or "all"
            (every named tracker whose package is installed). An unknown name is refused here.
        project_dir / project_config: where `save_state()` and the trackers write (a `ProjectConfiguration`).
        kwargs_handlers: `DistributedDataParallelKwargs`, `GradScalerKwargs`, `InitProcessGroupKwargs`, `ProfileKwargs`.
        step_scheduler_with_optimizer: step prepared schedulers only when the optimizer stepped (default).
        split_batches: loaders' batch size is the global one, split between the processes (also in `dataloader_config`).
        device_placement: prepared loaders put batches on `accelerator.device`.
        dynamo_backend: torch.compile backend for prepared models ("inductor", "aot_eager", ...; "no": none);
            by default what `cadence launch --dynamo_backend` set. Compiled in place: saved weights keep their names.
        dynamo_plugin: a `TorchDynamoPlugin` (backend, mode, fullgraph, dynamic, ...) instead of `dynamo_backend`.
        parallelism_config: a `ParallelismConfig` (tp_size, dp_shard_size): tensor parallelism inside FSDP2
            (`cadence.accelerate.parallelism`); default the launcher's `--use_parallelism_config` sizes.
        rng_types: random states prepared loaders copy from the main process at each iteration ("torch", "cuda";
            "generator", the default, is the sampler's, given at `prepare`).
        deepspeed_plugins: one DeepSpeedPlugin (or a dict holding one): the same as deepspeed_plugin.
        torch_tp_plugin, megatron_lm_plugin: refused, naming what to use instead.

    >>> accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
    >>> accelerator.mixed_precision, accelerator.gradient_accumulation_steps
    ('bf16', 2)
    """

    def __init__(self, device_placement: bool = True, split_batches: bool = False, mixed_precision: str | None = None,
                 gradient_accumulation_steps: int | None = None, cpu: bool = False, log_with: Any = None,
                 project_dir: str | os.PathLike | None = None, project_config: ProjectConfiguration | None = None,
                 kwargs_handlers: list | None = None, dynamo_backend: str | None = None,
                 step_scheduler_with_optimizer: bool = True, strategy: Any = None,
                 dataloader_config: DataLoaderConfiguration | None = None,
                 gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
                 fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
                 deepspeed_plugin: DeepSpeedPlugin | None = None, torch_tp_plugin: Any = None,
                 megatron_lm_plugin: Any = None, rng_types: list | None = None,
                 dynamo_plugin: TorchDynamoPlugin | None = None,
                 deepspeed_plugins: Any = None, parallelism_config: ParallelismConfig | None = None):
        refuse_unsupported(torch_tp_plugin, megatron_lm_plugin)
        dynamo_plugin = dynamo_plugin_for(dynamo_backend, dynamo_plugin)
        deepspeed_plugin = one_deepspeed_plugin(deepspeed_plugin, deepspeed_plugins)
        self.rng_types = check_rng_types(rng_types)
        self._handlers = handlers = sort_handlers(kwargs_handlers)
        self.gradient_accumulation_plugin = _accumulation_plugin(gradient_accumulation_steps, gradient_accumulation_plugin)
        self.dataloader_config = dataloader_config or DataLoaderConfiguration(split_batches=split_batches)
        if split_batches and not self.dataloader_config.split_batches:
            raise ValueError("split_batches=True and a dataloader_config with split_batches=False: set it in one place")
        self.project_configuration = project_config or ProjectConfiguration()
        if project_dir is not None:
            self.project_configuration.project_dir = str(project_dir)
            self.project_configuration.logging_dir = self.project_configuration.logging_dir or str(project_dir)
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.compile_options = compile_options(dynamo_plugin)
        self.dynamo_backend = (self.compile_options or {}).get("backend", "no")
        pg = handlers.get(InitProcessGroupKwargs, InitProcessGroupKwargs())
        self.profile_handler = handlers.get(ProfileKwargs)
        self.state = PartialState(cpu=cpu, backend=pg.backend, timeout=pg.timeout)
        self.state.dynamo_plugin = dynamo_plugin
        engine, options = choose_engine(strategy, fsdp_plugin, deepspeed_plugin)
        self.parallelism_config = parallelism_config or launched_parallelism_config()
        self.state.parallelism_config = self.parallelism_config
        if self.parallelism_config is not None:
            engine, options = parallel_engine(self.parallelism_config, engine, options)
        self.strategy = make_strategy(engine, cpu, handlers.get(DistributedDataParallelKwargs), options)
        self.strategy.setup_environment()
        self.state.distributed_type = self.distributed_type
        self.mixed_precision = self.state.mixed_precision = shared_precision(mixed_precision, self.distributed_type)
        self.state.fsdp_plugin = None
        if self.distributed_type == DistributedType.FSDP:   # the launcher's, as Accelerate builds it from its variables
            self.state.fsdp_plugin = fsdp_plugin or FullyShardedDataParallelPlugin.from_launcher()
        self.state.deepspeed_plugin = None
        if self.distributed_type == DistributedType.DEEPSPEED:
            self.state.deepspeed_plugin = deepspeed_plugin or DeepSpeedPlugin.from_launcher()
            self.state.deepspeed_plugin.deepspeed_config = self.strategy.config   # the config the engine is built from
            self.mixed_precision = self.state.mixed_precision = deepspeed_precision(self.strategy,
                                                                                    self.mixed_precision)
            self.state.deepspeed_plugin.dschf = tell_transformers_zero3(self.state.deepspeed_plugin, self.strategy,
                                                                        self.mixed_precision)
        scaler = handlers.get(GradScalerKwargs, GradScalerKwargs()).to_kwargs() if self.mixed_precision == "fp16" else {}
        precision = make_precision(self.mixed_precision, self.strategy.device, **scaler)
        if AutocastKwargs in handlers:
            precision = handlers[AutocastKwargs].apply_to(precision)
        self.strategy.set_precision(precision)
        self.gradient_state = GradientState(self.gradient_accumulation_plugin.num_steps)
        if _engine_accumulation(self.state.deepspeed_plugin) is not None:   # Accelerate uses DeepSpeed's number
            self.gradient_accumulation_steps = _engine_accumulation(self.state.deepspeed_plugin)
        self.trackers = TrackerSet(log_with, self.logging_dir)
        self.step = 0   # `accumulate` blocks since a prepared loader last ended (Accelerate's `step`)
        self._models: list[nn.Module] = []
        self._model_opts: list[torch.optim.Optimizer | None] = []
        self._stepper: dict[int, PreparedOptimizer] = {}   # id(prepared model) -> the prepared optimizer stepping it
        self._optimizers: list[PreparedOptimizer] = []
        self._schedulers: list[PreparedScheduler] = []
        self._dataloaders: list[PreparedDataLoader] = []
        self._custom_objects: list[Any] = []
        self._group_sizes: dict[int, list[int]] = {}   # id(optimizer) -> its groups' sizes as given to prepare
        self._given_names: dict[int, dict[int, str]] = {}   # id(prepared model) -> {id(given parameter): name}
        self._save_state_pre_hooks: OrderedDict[int, Any] = OrderedDict()   # weakly referenced by their handles
        self._load_state_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._trigger = False
        remember_first_accelerator(self.state)

    # ------------------------------------------------------------------ the step
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward of `loss` divided by `gradient_accumulation_steps` (scaled for fp16) through the strategy;
        `kwargs` go to `loss.backward` (`retain_graph=True`, `inputs=`), as in Accelerate."""
        if self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        self._warn_about_a_second_skip()
        self.strategy.backward(loss, **kwargs)

    def _warn_about_a_second_skip(self) -> None:
        dl = self.gradient_state.active_dataloader
        skipped = dl.take_skipped_before_backward() if isinstance(dl, PreparedDataLoader) else 0
        if skipped:
            warnings.warn(f"this epoch's loader continued at batch {dl.resumed_at} (load_state restores where the "
                          f"loaders stood), yet {skipped} more of its batches went by before the first backward: a "
                          f"loop that skips the batches already done itself (`if step < resume_step: continue`) "
                          f"skips them twice here. Drop that skip (or use accelerator.skip_first_batches, which "
                          f"knows where the loader stands).", stacklevel=3)

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """One micro-step: gradients synchronise (and optimizers step) only every `gradient_accumulation_steps`
        batches and on a loader's last batch; the others run forward and backward without communicating.

        >>> with accelerator.accumulate(model):
        ...     accelerator.backward(model(**batch).loss); optimizer.step(); optimizer.zero_grad()
        """
        if self.gradient_state.end_of_dataloader:   # Accelerate's count: micro-steps since the loader's last end
            self.step = 0
        else:
            self.step += 1
        sync_now = self.step % self.gradient_accumulation_steps == 0
        self.gradient_state.sync_gradients = sync_now
        with contextlib.ExitStack() as stack:
            if not (sync_now or self.gradient_accumulation_plugin.sync_each_batch):
                for model in models:
                    stack.enter_context(self.no_sync(model))
            yield

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Forward and backward in this block keep gradients local (no all-reduce); the setting before comes back
        after (a no-op on one process). Prepared models have the same as `model.no_sync()`, on every engine."""
        return sync.no_sync(self.strategy, model)

    def trigger_sync_in_backward(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """The backward in this block synchronises gradients although the forward ran under `no_sync`.

        >>> with accelerator.no_sync(model): loss = model(**batch).loss
        >>> with accelerator.trigger_sync_in_backward(model): accelerator.backward(loss)
        """
        return sync.trigger_sync_in_backward(self.strategy, model)

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list, even_batches: bool | None = None) -> Iterator[None]:
        """Accelerate's guard for processes with different numbers of batches. cadence's prepared loaders always
        give every process as many batches, so the block just runs; `even_batches=False` is refused."""
        if even_batches is False:
            raise ValueError("join_uneven_inputs(even_batches=False): cadence's prepared loaders always give every "
                             "process as many batches (gather_for_metrics drops the repeated samples); drop even_batches")
        yield

    @contextlib.contextmanager
    def profile(self, profile_handler: ProfileKwargs | None = None) -> Iterator[torch.profiler.profile]:
        """Profile the block with torch.profiler (options from a `ProfileKwargs` handler); with `output_trace_dir`
        each process writes its Chrome trace `profile_<process index>.json` there.

        >>> with accelerator.profile() as prof: train_one_epoch()
        >>> accelerator.print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))
        """
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        path = handler.trace_path(self.process_index)
        if path is not None:
            os.makedirs(handler.output_trace_dir, exist_ok=True)
            profiler.export_chrome_trace(path)
            self.wait_for_everyone()

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> contextlib.AbstractContextManager:
        """The mixed-precision context (prepared models already run their forward in it); an `AutocastKwargs`
        adjusts it for this block (`enabled=False`: fp32 in a bf16 run)."""
        if autocast_handler is None or not self.native_amp:
            return self.strategy.forward_context()
        return autocast_handler.autocast(self.strategy.precision)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Unscale (fp16), then clip the gradients of `parameters` by their global norm (over every shard and
        process); returns that norm, before clipping, on every engine. Part of a model: that part alone.

        An engine that clips itself (DeepSpeed) is given `max_norm` and takes its optimizer step here, the
        norm it computed returned (see `cadence.accelerate.clipping`); it refuses a part of the model.
        """
        params = list(parameters)
        for model, opt in self._units():
            if opt is not None and owns_parameters(model, params, self.strategy):
                if covers_trainable(model, params, self.strategy):
                    return clip_grad_norm(self.strategy, model, opt, self._stepper.get(id(model)), max_norm,
                                          norm_type)
                return clip_part(self.strategy, opt, params, max_norm, norm_type)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Divide the fp16 loss scale out of the gradients of `optimizer` (one or a list; default: every prepared
        one) before code of your own reads them; a no-op without fp16. `clip_grad_norm_` does it by itself.

        >>> accelerator.backward(loss); accelerator.unscale_gradients(optimizer); print(grad_histogram(model))
        """
        opts = self._optimizers if optimizer is None else optimizer if isinstance(optimizer, (list, tuple)) \
            else [optimizer]
        for opt in opts:
            self.strategy.precision.unscale(opt.optimizer if isinstance(opt, PreparedOptimizer) else opt)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Unscale (fp16), then clamp every gradient element of `parameters` to [-clip_value, clip_value] (part of
        a model: that part alone; DeepSpeed refuses a part)."""
        params = list(parameters)
        for model, opt in self._units():
            if opt is not None and owns_parameters(model, params, self.strategy):
                if covers_trainable(model, params, self.strategy):
                    return self.strategy.clip_grad_value(model, opt, clip_value)
                refuse_part_under_own_clipping(self.strategy)
                self.strategy.precision.unscale(opt)
                break
        torch.nn.utils.clip_grad_value_(params, clip_value)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """`dataloader` without its first `num_batches` batches (`cadence.skip_first_batches`): a prepared loader's
        next iteration starts there, a plain DataLoader gives a new one that skips them.

        >>> for batch in accelerator.skip_first_batches(train_dl, resume_step): ...
        """
        return skip_first_batches(dataloader, num_batches)

    def free_memory(self, *objects: Any) -> list[None]:
        """Forget everything prepared, collect garbage, empty the device cache; returns Nones for `objects`.

        >>> model, optimizer = accelerator.free_memory(model, optimizer)
        """
        for registry in (self._models, self._model_opts, self._optimizers, self._schedulers, self._dataloaders,
                         self._stepper, self._group_sizes, self._given_names):
            registry.clear()
        self.step = 0
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [None] * len(objects)

    def clear(self, *objects: Any) -> list[None]:
        """`free_memory` under its other name."""
        return self.free_memory(*objects)

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
        """Finish a checkpoint being written, close the trackers' runs and wait for every process."""
        self.finish_saving()
        self.trackers.finish()
        self.wait_for_everyone()

    def __repr__(self) -> str:
        return (f"Accelerator(strategy={self.strategy.name!r}, mixed_precision={self.mixed_precision!r}, "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}, {self.state!r})")


def _engine_accumulation(plugin: DeepSpeedPlugin | None) -> int | None:
    """The accumulation steps a DeepSpeed config fixes (None: "auto" or no DeepSpeed)."""
    configured = plugin.deepspeed_config.get("gradient_accumulation_steps", "auto") if plugin is not None else "auto"
    return None if configured == "auto" else int(configured)


def _accumulation_plugin(steps: int | None, plugin: GradientAccumulationPlugin | None) -> GradientAccumulationPlugin:
    """The accumulation plugin from `gradient_accumulation_steps`, a plugin, or the launcher's steps (one place only)."""
    if plugin is not None and steps is not None:
        raise ValueError("give gradient_accumulation_steps or gradient_accumulation_plugin, not both")
    if plugin is not None and not isinstance(plugin, GradientAccumulationPlugin):
        raise TypeError(f"gradient_accumulation_plugin takes a GradientAccumulationPlugin, got {type(plugin).__name__}")
    plugin = plugin or GradientAccumulationPlugin()
    if steps is not None:
        plugin.num_steps = steps
    if plugin.num_steps is None:
        plugin.num_steps = int(os.environ.get("CADENCE_GRADIENT_ACCUMULATION_STEPS", "1"))
    if not isinstance(plugin.num_steps, int) or isinstance(plugin.num_steps, bool) or plugin.num_steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be a positive int, got {steps!r}")
    return plugin
