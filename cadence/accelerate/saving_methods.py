"""The Accelerator's models, weights and checkpoints: `unwrap_model`, `get_state_dict`, `save`, `save_model`,
`register_for_checkpointing`, `save_state`, `load_state` and `finish_saving` (a mixin of `Accelerator`, which holds
the strategy, the prepared models and the project configuration they read).

>>> accelerator.save_state("ckpt"); accelerator.load_state("ckpt")
>>> accelerator.save_model(model, "export")          # Hugging Face's layout, full weights
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ..compile import unwrap_compiled
from .accelerate_checkpoint import is_accelerate_checkpoint, load_accelerate_checkpoint
from .checkpointing import (automatic_checkpoint_dir, latest_checkpoint_dir, load_accelerator_state,
                            save_accelerator_state)
from .plugins import DistributedType
from .preparation import restore_forward
from .saving import save_object

__all__ = ["SavingMethods"]


class SavingMethods:
    """What the Accelerator saves and loads (see the module's docstring)."""

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> nn.Module:
        """The user's module inside what `prepare` returned (without the autocast forward unless `keep_fp32_wrapper`).

        A model compiled with `torch.compile` before `prepare` comes back in its compile wrapper (`OptimizedModule`,
        whose state dict names start `_orig_mod.`) with `keep_torch_compile`, as Accelerate's; without, bare.

        >>> accelerator.unwrap_model(accelerator.prepare(torch.compile(model)), keep_torch_compile=False) is model
        True
        """
        module = self.strategy.unwrap(model)
        if not keep_fp32_wrapper:
            restore_forward(module)
        compiled = next((m for m in (model, getattr(model, "module", None))
                         if isinstance(m, nn.Module) and unwrap_compiled(m) is not m), None)
        if keep_torch_compile and compiled is not None:
            compiled._orig_mod = module
            return compiled
        return module

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full (unsharded) state dict of a prepared model, complete on the main process (sharded engines
        gather it there); every process must call it.

        `unwrap=False`, as in Accelerate: the wrapper's own state dict (DDP's names start with `module.`); FSDP
        and DeepSpeed give the model's names either way.

        >>> accelerator.get_state_dict(model, unwrap=False)     # {"module.0.weight": ...} under DDP
        """
        if unwrap or self.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
            return self.strategy.model_state_dict(model)
        return model.state_dict()

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """Save `obj` to `f` once per run (on the main process): `torch.save`, or safetensors for a dict of tensors
        with `safe_serialization` (Accelerate's `save`, e.g. `save_pretrained(..., save_function=accelerator.save)`).

        >>> accelerator.save(accelerator.unwrap_model(model).state_dict(), "weights.pt")
        """
        save_object(obj, f, safe_serialization, self.is_main_process)

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike, max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> Path:
        """Full weights in the Hugging Face layout (shards and an index above `max_shard_size`; a peft model's whole
        state, as Accelerate's): safetensors, or with
        `safe_serialization=False` `torch.save` files as Accelerate writes them (`pytorch_model.bin`, see
        `cadence.callbacks.checkpoint.bin_export`), swapped in whole. The main process writes; as Accelerate's, it
        waits for no other process, so under DDP or on one device `if accelerator.is_main_process:` may guard it
        (sharding engines gather the weights: every process calls it there).

        >>> accelerator.save_model(model, "export", max_shard_size="500MB", safe_serialization=False)
        """
        from ..callbacks.checkpoint import save_model

        return save_model(SimpleNamespace(strategy=self.strategy, model=model), save_directory, max_shard_size,
                          safe_serialization=safe_serialization, wait=False, adapter_only=False)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and load these objects (anything with `state_dict` / `load_state_dict`) with `save_state`."""
        bad = [f"Item at index {i}, of type {type(o).__name__}" for i, o in enumerate(objects)
               if not (callable(getattr(o, "state_dict", None)) and callable(getattr(o, "load_state_dict", None)))]
        if bad:
            raise ValueError("register_for_checkpointing takes objects with state_dict() and load_state_dict(); "
                             "these have not: " + "; ".join(bad))
        self._custom_objects.extend(objects)

    def save_state(self, output_dir: str | os.PathLike | None = None, async_save: bool = False,
                   **kwargs: Any) -> Path:
        """Write a resumable checkpoint of everything prepared and registered (every process calls it).

        With `ProjectConfiguration(automatic_checkpoint_naming=True)` the directory is
        `project_dir/checkpoints/checkpoint_<n>` and only the newest `total_limit` are kept.
        `async_save=True`: the state is copied to host memory and written in the background; the
        checkpoint appears once every process's part is written. The next `save_state`, `load_state`
        or `end_training` waits for it (and raises if it failed): call one of them before the script ends.
        `safe_serialization=False` writes Accelerate's files instead (`pytorch_model.bin`, `optimizer.bin`,
        `random_states_<rank>.pkl`, ...), which Accelerate's `load_state` reads too; the loaders' position is not in
        them (a resume starts its epoch over, as after Accelerate's own checkpoints).

        >>> accelerator.save_state("ckpt")       # or accelerator.save_state() with automatic naming
        """
        self.finish_saving()
        config = self.project_configuration
        if config.automatic_checkpoint_naming:
            if config.project_dir is None:
                raise ValueError("automatic_checkpoint_naming needs a project_dir: Accelerator(project_dir=...)")
            directory = automatic_checkpoint_dir(Path(config.project_dir), config.iteration)
        elif output_dir is None:
            raise ValueError("save_state needs output_dir, or ProjectConfiguration(automatic_checkpoint_naming=True)")
        else:
            directory = Path(output_dir)
        write = save_accelerator_state(self, directory, async_save=async_save,
                                       safe_serialization=kwargs.get("safe_serialization", True))
        self._save_in_flight = None if write.committed else write
        config.iteration += 1
        return directory

    def load_state(self, input_dir: str | os.PathLike | None = None, **kwargs: Any) -> None:
        """Restore a `save_state` checkpoint (default with automatic naming: the newest one).

        Loaders continue where they stood when it was saved (the rest of that epoch). A checkpoint that Hugging Face
        Accelerate's `save_state` wrote loads too (`cadence.accelerate.accelerate_checkpoint`): weights, optimizers,
        schedulers, registered objects, random states and `step`, read without unpickling code.

        >>> accelerator.load_state("accelerate_run/checkpoints/checkpoint_3")     # written by Accelerate or cadence
        """
        self.finish_saving()
        if input_dir is None:
            if not self.project_configuration.automatic_checkpoint_naming or self.project_dir is None:
                raise ValueError("load_state needs input_dir, or ProjectConfiguration(automatic_checkpoint_naming=True)")
            input_dir = latest_checkpoint_dir(Path(self.project_dir))
        if is_accelerate_checkpoint(input_dir):
            load_accelerate_checkpoint(self, input_dir)
        else:
            load_accelerator_state(self, input_dir)

    def _units(self) -> list[tuple[nn.Module, torch.optim.Optimizer | None]]:
        return list(zip(self._models, self._model_opts))

    def finish_saving(self) -> None:
        """Wait (every process) until a `save_state(async_save=True)` is written and visible; raise if it failed."""
        write, self._save_in_flight = getattr(self, "_save_in_flight", None), None
        if write is not None:
            write.wait()
