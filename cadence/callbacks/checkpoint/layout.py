"""Which engine and mesh wrote a sharded checkpoint, and whether this run's engine reads it: checked before anything
loads, for the Learner's `load_state` and the Accelerator's.

Sharded checkpoints (torch.distributed.checkpoint's format in `sharded/`) are written by `strategy="fsdp"` and
`strategy="model_parallel"` (TP, 2-D, PP); state.json records the engine and its mesh sizes as "mesh"
(`cadence.distributed.model_parallel.checkpoint_layout`). torch reshards as it loads, so a `model_parallel`
checkpoint's weights and optimizer state load exactly on any other mesh (tp, pp, dp sizes, pipeline split, number of
processes, one process) and an FSDP one's on any number of processes. Refused, naming what wrote it and what reads it:
- an engine that reads only the plain files (`model.safetensors`: a Learner outside `distrib_ctx`, a plain
  Accelerator, DDP, DeepSpeed);
- FSDP's checkpoint read by `model_parallel` or the other way round: their optimizer states are laid out
  differently (per parameter group, per parameter).
A checkpoint written before the record was kept is checked for the first only.

>>> check_engine_reads(learn.strategy, Path("ckpt/step-00000200"), state, "learner")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from .validate import refuse

__all__ = ["check_engine_reads"]

_SIZES = ("pp_size", "dp_replicate_size", "dp_shard_size", "tp_size")
_OPTIMIZER_LAYOUT = {"fsdp": "per parameter group", "model_parallel": "per parameter"}


def check_engine_reads(strategy: Any, directory: Path, state: dict[str, Any], api: Literal["learner", "accelerator"],
                       unit: Path | None = None) -> None:
    """ValueError, before anything is loaded, when the checkpoint `directory` (its state.json read as `state`) holds
    a sharded model in `unit` (default `directory`: the folder holding `sharded/`) that `strategy` cannot read; `api`
    says which one the message tells how to load it with.

    >>> check_engine_reads(accelerator.strategy, Path("ckpt"), state, "accelerator", unit=Path("ckpt/model_1"))
    """
    from ...distributed.distcp_read import is_sharded
    from ...distributed.env import world_size
    from ...distributed.fsdp import FSDP, SHARDED_DIR
    from ...distributed.model_parallel import ModelParallel, checkpoint_layout
    from ...distributed.strategy import SingleDevice

    mesh, unit = _recorded_mesh(state, directory), unit or directory
    if not is_sharded(unit, SHARDED_DIR):
        return
    reads = "model_parallel" if isinstance(strategy, ModelParallel) else "fsdp" if isinstance(strategy, FSDP) else None
    wrote = mesh["strategy"] if mesh else None
    if reads is not None and wrote in (None, reads):
        return
    written = (f"written by {mesh['processes']} processes under strategy=\"{wrote}\" ({_sizes(mesh)})" if mesh else
               f"written by {state.get('world_size')} processes under strategy=\"model_parallel\" (TP, 2-D, PP) or "
               f"\"fsdp\"")
    processes = f"{world_size()} process{'es' if world_size() > 1 else ''}"
    if reads is None:
        engine = ("a Learner outside distrib_ctx" if api == "learner" and isinstance(strategy, SingleDevice) else
                  f"this {'Accelerator' if api == 'accelerator' else 'engine'} "
                  f"({type(strategy).__name__} on {processes})")
        problem = f"which {engine} cannot read"
    else:
        now = checkpoint_layout(strategy)
        problem = (f"which this engine, strategy=\"{reads}\" ({_sizes(now) + ' ' if now else ''}on {processes}), does "
                   f"not read: the two lay the optimizer state out differently ({wrote} {_OPTIMIZER_LAYOUT[wrote]}, "
                   f"{reads} {_OPTIMIZER_LAYOUT[reads]})")
    raise ValueError(f"{unit} is a sharded checkpoint (torch.distributed.checkpoint's format in {SHARDED_DIR}/) "
                     f"{written}, {problem}. Load it inside the engine that wrote it: {_how(api, wrote)}; or convert "
                     f"it into one file with torch.distributed.checkpoint.format_utils.dcp_to_torch_save("
                     f"\"{unit / SHARDED_DIR}\", \"full.pt\"), whose \"model\" entry holds the full weights "
                     f"(model.load_state_dict(torch.load(\"full.pt\")[\"model\"]))")


def _how(api: str, wrote: str | None) -> str:
    """How to load a checkpoint of the engine `wrote` (None: not recorded) with the Learner or the Accelerator."""
    if api == "learner":
        model_parallel = ("`with learn.distrib_ctx(strategy=\"model_parallel\", tp_size=..., pp_size=...):` with "
                          "any sizes that divide the processes (tp_size=1: FSDP2 over them all) and the pipeline's "
                          "split if pp_size > 1; in one process too (a script run without the launcher trains the "
                          "plain model)")
        fsdp = "`with learn.distrib_ctx(strategy=\"fsdp\"):` on any number of processes, one too"
    else:
        model_parallel = ("`Accelerator(parallelism_config=ParallelismConfig(tp_size=...))` launched on several "
                          "processes (`cadence launch --num_processes N`), tp_size > 1 dividing them")
        fsdp = ("`Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())` launched on several processes, or "
                "`Accelerator(strategy=\"fsdp\")` on any number, one too")
    return {"model_parallel": model_parallel, "fsdp": fsdp}.get(wrote, f"e.g. {model_parallel}; or {fsdp}")


def _sizes(mesh: dict[str, Any]) -> str:
    return ", ".join(f"{k}={mesh[k]}" for k in _SIZES if k in mesh)


def _recorded_mesh(state: dict[str, Any], directory: Path) -> dict[str, Any] | None:
    """state.json's "mesh" (None when absent: a plain checkpoint, or one written before it was recorded); a value
    that is not what `checkpoint_layout` writes is refused, naming it."""
    mesh = state.get("mesh")
    if mesh is None:
        return None
    file = directory / "state.json"
    if not isinstance(mesh, dict) or mesh.get("strategy") not in _OPTIMIZER_LAYOUT:
        raise refuse(file, "mesh", mesh, f"null or an object whose strategy is one of {sorted(_OPTIMIZER_LAYOUT)}")
    for key in ("processes", *_SIZES):
        value = mesh.get(key, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise refuse(file, f"mesh.{key}", value, "an int >= 1")
    return mesh
