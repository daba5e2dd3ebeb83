"""The Accelerator's read-only facts of the run (and the settable accumulation), under Accelerate's names.

>>> accelerator.process_index, accelerator.num_processes, accelerator.distributed_type
(0, 2, <DistributedType.MULTI_CPU: 'MULTI_CPU'>)
>>> accelerator.gradient_accumulation_steps = 4
"""

from __future__ import annotations

import torch

from ..distributed.strategy import OwnsAccumulation
from .handlers import AutocastKwargs, DistributedDataParallelKwargs, GradScalerKwargs, InitProcessGroupKwargs
from .optional_features import is_lomo
from .plugins import DeepSpeedPlugin, DistributedType, distributed_type_of

__all__ = ["RunProperties"]


class RunProperties:
    """Mixed into `Accelerator`: needs `self.strategy`, `self.state`, `self.gradient_state`, `self._handlers`,
    `self.gradient_accumulation_plugin`, `self.dataloader_config`,
    `self.project_configuration`, `self._optimizers`, `self.trackers`."""

    # FP8 recipes: cadence takes none (their kwargs handlers are refused), as Accelerate's attributes read without them
    fp8_recipe_handler = ao_recipe_handler = te_recipe_handler = msamp_recipe_handler = None
    has_fp8_handler = fp8_enabled = delayed_fp8_autocast = False

    @property
    def ddp_handler(self) -> DistributedDataParallelKwargs | None:
        """The `DistributedDataParallelKwargs` given in `kwargs_handlers`, else None."""
        return self._handlers.get(DistributedDataParallelKwargs)

    @property
    def autocast_handler(self) -> AutocastKwargs | None:
        """The `AutocastKwargs` given in `kwargs_handlers`, else None."""
        return self._handlers.get(AutocastKwargs)

    @property
    def scaler_handler(self) -> GradScalerKwargs | None:
        return self._handlers.get(GradScalerKwargs)

    @property
    def init_handler(self) -> InitProcessGroupKwargs | None:
        return self._handlers.get(InitProcessGroupKwargs)

    @property
    def native_amp(self) -> bool:
        """True when the forward runs in torch's autocast (fp16 or bf16, DeepSpeed casting the model itself)."""
        return self.mixed_precision in ("fp16", "bf16") and self.distributed_type != DistributedType.DEEPSPEED

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """fp16's GradScaler (None in fp32, bf16 and under DeepSpeed, whose engine scales)."""
        return getattr(self.strategy.precision, "scaler", None)

    @property
    def has_lomo_optimizer(self) -> bool:
        """True when a prepared optimizer is LOMO's (`lomo_backward` steps it)."""
        return any(is_lomo(opt.optimizer) for opt in self._optimizers)

    @property
    def log_with(self) -> list:
        """The trackers `log_with` named (Accelerate's LoggerType names, or GeneralTracker instances)."""
        return list(self.trackers.kinds)

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
    def distributed_type(self) -> DistributedType:
        """Accelerate's kind of run for this strategy: MULTI_CPU / MULTI_GPU (DDP), FSDP, DEEPSPEED, XLA or NO."""
        return distributed_type_of(self.strategy.name, self.device, self.num_processes)

    @property
    def deepspeed_plugin(self) -> DeepSpeedPlugin | None:
        """The DeepSpeed plugin of this run (its `deepspeed_config` is the engine's config); None off DeepSpeed."""
        return self.state.deepspeed_plugin

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step in `accumulate`; settable (e.g. after `find_executable_batch_size`)."""
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be a positive int, got {steps!r}")
        if isinstance(self.strategy, OwnsAccumulation) and self.state.deepspeed_plugin is not None:
            # the engine's own number must agree (a config's fixed value is refused if it differs), and the engine
            # then leaves the loss scaling to `backward`
            self.strategy.configure_accumulation(steps)
        self.gradient_state.num_steps = self.gradient_accumulation_plugin.num_steps = steps

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def even_batches(self) -> bool:
        """Always True: every process gets as many batches (the last shard completed from the start); False is refused."""
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        if value is not True:
            raise ValueError(f"even_batches={value!r}: cadence's shards always have the same number of batches (the "
                             f"last completed from the start, removed again by gather_for_metrics); keep it True")

    @property
    def dispatch_batches(self) -> bool | None:
        return self.dataloader_config.dispatch_batches

    @property
    def use_seedable_sampler(self) -> bool:
        return self.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        return self.dataloader_config.non_blocking

    @property
    def use_stateful_dataloader(self) -> bool:
        return self.dataloader_config.use_stateful_dataloader

    @property
    def sync_gradients(self) -> bool:
        """False on the micro-steps of an accumulation window (no all-reduce, no optimizer step); settable, as in
        Accelerate, to make prepared optimizers step (True) or wait (False) outside `accumulate`."""
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"sync_gradients takes True or False, got {value!r}")
        self.gradient_state.sync_gradients = value

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when the last step of a prepared optimizer was skipped (fp16 overflow)."""
        return any(opt.step_was_skipped for opt in self._optimizers)

    @property
    def save_iteration(self) -> int:
        """The number the next automatically named `save_state` checkpoint gets."""
        return self.project_configuration.iteration

    @property
    def is_fsdp2(self) -> bool:
        """True under FSDP (cadence's FSDP is FSDP2, `fully_shard`)."""
        return self.distributed_type == DistributedType.FSDP

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        return self.is_fsdp2

    @property
    def multi_device(self) -> bool:
        """True on several processes with one accelerator device each (MULTI_GPU, ...; not MULTI_CPU)."""
        kind = self.distributed_type
        return self.use_distributed and kind.startswith("MULTI_") and kind != DistributedType.MULTI_CPU

    @property
    def should_save_model(self) -> bool:
        """True: every process takes part in saving the model (`save_model` / `save_state` gather what they need)."""
        return True

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir
