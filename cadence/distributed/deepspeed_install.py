"""DeepSpeed made ready for this machine: imported with the right accelerator and op cache, its ops compiled.

>>> deepspeed = import_deepspeed()      # instead of `import deepspeed`
>>> build_ops()                         # `python -m cadence.distributed.deepspeed --build-ops`
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

_INSTALL = ("DeepSpeed is not installed: `make setup-deepspeed`, or "
            "`DS_BUILD_OPS=0 pip install --no-build-isolation 'deepspeed>=0.19,<0.20'` after torch")


def import_deepspeed():
    """`import deepspeed` set up for this machine: the CPU accelerator without a GPU, JIT ops cached in the venv.

    DeepSpeed compiles some ops (cpu_adam for optimizer offload) on first use, ~100 s; they are cached
    under `$TORCH_EXTENSIONS_DIR`, by default `<venv>/torch_extensions` so a rebuilt venv starts clean.
    Its shared-memory collectives (another JIT build, a minute at every start) stay off: gloo does the work.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if sys.prefix != sys.base_prefix:
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    _drop_stale_build_locks()
    try:
        import deepspeed
        import deepspeed.ops
    except ImportError as e:
        raise ImportError(f"{_INSTALL} ({e})") from None
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    _quiet_deprecated_collectives()
    return deepspeed


def _quiet_deprecated_collectives() -> None:
    """DeepSpeed calls two torch collectives that torch deprecates, a FutureWarning per call (thousands in a ZeRO-3
    fit): hide those two messages, where torch raises them, and nothing else."""
    import warnings

    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
                            r"is deprecated", category=FutureWarning, module=r"torch\.distributed")


STALE_LOCK_S = 30 * 60


def _drop_stale_build_locks() -> None:
    """A build killed mid-way leaves torch's `lock` file, and every later build waits on it forever: drop old ones."""
    import time
    import warnings

    cache = os.environ.get("TORCH_EXTENSIONS_DIR")
    for lock in Path(cache).glob("*/lock") if cache else ():
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            warnings.warn(f"removing {lock}, left by an interrupted build of a DeepSpeed op {STALE_LOCK_S // 60}+ "
                          f"minutes ago; the op is rebuilt", stacklevel=3)
            lock.unlink(missing_ok=True)


def build_ops() -> None:
    """Compile the DeepSpeed ops cadence uses into the cache, once (~100 s each): CPU Adam (optimizer offload) and,
    without a GPU, the CPU FusedAdam (what a DeepSpeed config's `"optimizer": {"type": "AdamW"}` builds there).

    `make setup-deepspeed` runs it (`python -m cadence.distributed.deepspeed --build-ops`), so the first
    offloaded fit, or the first fit on a DeepSpeed config's optimizer, does not pay for it; a build already cached
    loads in a second.
    """
    import_deepspeed()
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder import CPUAdamBuilder

    CPUAdamBuilder().load(verbose=False)
    if get_accelerator().device_name() == "cpu":  # on a GPU it is a CUDA op, built where it is first used
        get_accelerator().create_op_builder("FusedAdamBuilder").load(verbose=False)
    print(f"DeepSpeed ops built in {os.environ.get('TORCH_EXTENSIONS_DIR', 'the torch extensions cache')}")
