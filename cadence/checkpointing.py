"""`accelerate.checkpointing` under cadence: the names of the files `accelerator.save_state` writes in
Accelerate's layout (`save_state(dir, safe_serialization=False)`); saving and loading are the accelerator's.

>>> from cadence.checkpointing import OPTIMIZER_NAME, RNG_STATE_NAME
>>> accelerator.save_state("ckpt", safe_serialization=False)
>>> torch.load(f"ckpt/{OPTIMIZER_NAME}.bin")["param_groups"][0]["lr"], os.path.exists(f"ckpt/{RNG_STATE_NAME}_0.pkl")
(0.1, True)
"""

from .utils.constants import (MODEL_NAME, OPTIMIZER_NAME, RNG_STATE_NAME, SAFE_MODEL_NAME, SAFE_WEIGHTS_NAME,
                              SAMPLER_NAME, SCALER_NAME, SCHEDULER_NAME, WEIGHTS_NAME)
from .utils.unavailable import module_getattr

__all__ = ["MODEL_NAME", "SAFE_MODEL_NAME", "WEIGHTS_NAME", "SAFE_WEIGHTS_NAME", "OPTIMIZER_NAME", "SCHEDULER_NAME",
           "SCALER_NAME", "SAMPLER_NAME", "RNG_STATE_NAME"]

_STATE = ("accelerator.save_state(directory) and accelerator.load_state(directory) save and restore every prepared "
          "object and registered one (accelerator.register_for_checkpointing(obj))")
__getattr__ = module_getattr(__name__, dict.fromkeys(
    ["save_accelerator_state", "load_accelerator_state", "save_custom_state", "load_custom_state"], _STATE),
    "accelerate.checkpointing")
