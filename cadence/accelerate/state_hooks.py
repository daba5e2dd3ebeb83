"""`register_save_state_pre_hook` / `register_load_state_pre_hook`: code of the user's run just before
`save_state` / `load_state`, with Accelerate's signatures (diffusers' training scripts save their models
with `save_pretrained` this way).

- save: `hook(models, weights, output_dir)`. `weights` holds each prepared model's state dict on the main
  process of a one-process or DDP run, and is empty elsewhere (sharded engines; Accelerate does the same).
  A model whose state dict the hook removes from `weights` is not written by `save_state`; its
  optimizer still is.
- load: `hook(models, input_dir)`. A model the hook removes from `models` is not loaded by `load_state`
  (the hook loaded it); its optimizer still is.

The main process's choice holds on every process. Sharded engines save each model with its optimizer in
one collective format, so there a hook may add files but not take a model's place.

>>> def save_unet(models, weights, output_dir):
...     if accelerator.is_main_process:
...         models[0].save_pretrained(f"{output_dir}/unet"); weights.pop()
>>> handle = accelerator.register_save_state_pre_hook(save_unet)
>>> handle.remove()                                                 # no longer called
"""

from __future__ import annotations

from typing import Any, Callable

from torch.utils.hooks import RemovableHandle

from ..distributed.strategy import Strategy

__all__ = ["StateHooks", "run_save_hooks", "run_load_hooks"]


class StateHooks:
    """Mixed into `Accelerator`: needs `self._save_state_pre_hooks` and `self._load_state_pre_hooks` (OrderedDicts)."""

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call `hook(models, weights, output_dir)` at the start of every `save_state`; returns a handle whose
        `remove()` unregisters it. Removing a state dict from `weights` keeps that model out of the checkpoint."""
        handle = RemovableHandle(self._save_state_pre_hooks)
        self._save_state_pre_hooks[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call `hook(models, input_dir)` at the start of every `load_state`; returns a handle whose `remove()`
        unregisters it. Removing a model from `models` leaves its loading to the hook."""
        handle = RemovableHandle(self._load_state_pre_hooks)
        self._load_state_pre_hooks[handle.id] = hook
        return handle


def run_save_hooks(acc: Any, output_dir: str) -> set[int]:
    """Run the save hooks; the indices of the prepared models whose weights `save_state` must not write."""
    if not acc._save_state_pre_hooks:
        return set()
    models = list(acc._models)
    given = [acc.strategy.unwrap(m).state_dict() for m in models] if _plain_format(acc) and acc.is_main_process else []
    weights = list(given)
    for hook in list(acc._save_state_pre_hooks.values()):
        hook(models, weights, output_dir)
    skipped = {k for k, w in enumerate(given) if not any(w is kept for kept in weights)}
    return _agreed(acc, skipped, "a save_state pre-hook removed weights")


def run_load_hooks(acc: Any, input_dir: str) -> set[int]:
    """Run the load hooks; the indices of the prepared models `load_state` must not load."""
    if not acc._load_state_pre_hooks:
        return set()
    models = list(acc._models)
    for hook in list(acc._load_state_pre_hooks.values()):
        hook(models, input_dir)
    skipped = {k for k, m in enumerate(acc._models) if not any(m is kept for kept in models)}
    return _agreed(acc, skipped, "a load_state pre-hook removed models")


def _agreed(acc: Any, skipped: set[int], what: str) -> set[int]:
    skipped = acc.strategy.broadcast(sorted(skipped)) if acc.num_processes > 1 else sorted(skipped)
    if skipped and not _plain_format(acc):
        raise ValueError(f"{what} ({len(skipped)} model(s)), but strategy {acc.strategy.name!r} saves each model "
                         f"with its optimizer in one sharded format: let save_state/load_state handle the models "
                         f"(a hook may still write or read files of its own)")
    return set(skipped)


def _plain_format(acc: Any) -> bool:
    """Does the strategy write the base format (full weights and optimizer files, main process)?"""
    kind = type(acc.strategy)
    return all(getattr(kind, name) is getattr(Strategy, name)
               for name in ("save_checkpoint", "checkpoint_writer", "load_checkpoint"))
