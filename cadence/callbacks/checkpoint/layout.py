"""Which engine and mesh wrote a sharded checkpoint, and whether this run's engine reads it: checked before anything
loads, for the Learner's `load_state` and the Accelerator's.

Sharded checkpoints (torch.distributed.checkpoint's format in `sharded/`) are written by `strategy="fsdp"` and
`strategy="model_parallel"` (TP, 2-D, PP); state.json records the engine and its mesh sizes as "mesh"
(`cadence.distributed.model_parallel.checkpoint_layout`). torch reshards as it loads and each engine reads the other's
optimizer layout (`distcp_read.DirectReader.load`), so weights and optimizer state load exactly under either engine, on
any mesh (tp, pp, dp sizes, pipeline split, number of processes, one process). Refused, naming what wrote it and what
reads it: an engine that reads only the plain files (`model.safetensors`: a Learner outside `distrib_ctx`, a plain
Accelerator, DDP, DeepSpeed).

>>> check_engine_reads(learn.strategy, Path("ckpt/step-00000200"), state, "learner")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from .validate import refuse

__all__ = ["check_engine_reads"]

_SIZES = ("pp_size", "dp_replicate_size", "dp_shard_size", "tp_size")
_ENGINES = ("fsdp", "model_parallel")


def check_engine_reads(strategy: Any, directory: Path, state: dict[str, Any], api: Literal["learner", "accelerator"],
                       unit: Path | None = None) -> None:
    """ValueError, before anything is loaded, when the checkpoint `directory` (its state.json read as `state`) holds
    a sharded model in `unit` (default `directory`: the folder holding `sharded/`) that `strategy` cannot read; `api`
    says which one the message tells how to load it with.

    >>> check_engine_reads(accelerator.strategy, Path("ckpt"), state, "accelerator", unit=Path("ckpt/model_1"))
    """
    from ...distributed.distcp_read import is_sharded
    from ...distributed.env import world_size
    from ...distributed.fsdp import FSDP
    from ...distributed.sharded_checkpoint import SHARDED_DIR
    from ...distributed.strategy import SingleDevice

    mesh, unit = _recorded_mesh(state, directory), unit or directory
    if isinstance(strategy, FSDP) or not is_sharded(unit, SHARDED_DIR):   # model_parallel is an FSDP
        return
    written = (f"written by {mesh['processes']} processes under strategy=\"{mesh['strategy']}\" ({_sizes(mesh)})"
               if mesh else f"written by {state.get('world_size')} processes under strategy=\"model_parallel\" (TP, "
               f"2-D, PP) or \"fsdp\"")
    processes = f"{world_size()} process{'es' if world_size() > 1 else ''}"
    engine = ("a Learner outside distrib_ctx" if api == "learner" and isinstance(strategy, SingleDevice) else
              f"this {'Accelerator' if api == 'accelerator' else 'engine'} ({type(strategy).__name__} on {processes})")
    raise ValueError(f"{unit} is a sharded checkpoint (torch.distributed.checkpoint's format in {SHARDED_DIR}/) "
                     f"{written}, which {engine} cannot read. Load it inside either sharded engine: "
                     f"{_how(api, mesh['strategy'] if mesh else None)}; or convert it into one file with "
                     f"torch.distributed.checkpoint.format_utils.dcp_to_torch_save(\"{unit / SHARDED_DIR}\", "
                     f"\"full.pt\"), whose \"model\" entry holds the full weights "
                     f"(model.load_state_dict(torch.load(\"full.pt\")[\"model\"]))")


def _how(api: str, wrote: str | None) -> str:
    """How to load a sharded checkpoint with the Learner or the Accelerator: either engine, the one that wrote it
    (`wrote`; None: not recorded) first."""
    if api == "learner":
        model_parallel = ("`with learn.distrib_ctx(strategy=\"model_parallel\", tp_size=..., pp_size=...):` with "
                          "any sizes that divide the processes (tp_size=1: FSDP2 over them all) and the pipeline's "
                          "split if pp_size > 1; in one process too (a script run without the launcher trains the "
                          "plain model)")
        fsdp = "`with learn.distrib_ctx(strategy=\"fsdp\"):` on any number of processes, one too"
    else:
        model_parallel = ("`Accelerator(parallelism_config=ParallelismConfig(tp_size=...))` launched on several "
                          "processes (`cadence launch --num_processes N`), tp_size > 1 dividing them")
        fsdp = ("`Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())` or `ParallelismConfig(dp_shard_size=N)` "
                "launched on N processes, or `Accelerator(strategy=\"fsdp\")` on any number, one too")
    return f"{fsdp}; or {model_parallel}" if wrote == "fsdp" else f"{model_parallel}; or {fsdp}"


def _sizes(mesh: dict[str, Any]) -> str:
    return ", ".join(f"{k}={mesh[k]}" for k in _SIZES if k in mesh)


def _recorded_mesh(state: dict[str, Any], directory: Path) -> dict[str, Any] | None:
    """state.json's "mesh" (None when absent: a plain checkpoint, or one written before it was recorded); a value
    that is not what `checkpoint_layout` writes is refused, naming it."""
    mesh = state.get("mesh")
    if mesh is None:
        return None
    file = directory / "state.json"
    if not isinstance(mesh, dict) or mesh.get("strategy") not in _ENGINES:
        raise refuse(file, "mesh", mesh, f"null or an object whose strategy is one of {list(_ENGINES)}")
    for key in ("processes", *_SIZES):
        value = mesh.get(key, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise refuse(file, f"mesh.{key}", value, "an int >= 1")
    return mesh
