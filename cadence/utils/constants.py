"""`accelerate.utils.constants` under cadence: the file names of a saved model, as `save_model` writes them, and
the stems of Accelerate's `save_state` files, as `save_state(safe_serialization=False)` writes them
(`optimizer.bin`, `scheduler.bin`, `random_states_0.pkl`, `scaler.pt`).

>>> safetensors.torch.load_file(Path("export") / SAFE_WEIGHTS_NAME)      # after accelerator.save_model(model, "export")
>>> torch.load(Path(checkpoint) / f"{OPTIMIZER_NAME}.bin")               # after save_state(checkpoint, safe_serialization=False)
"""

from ..callbacks.checkpoint.bin_export import WEIGHTS_INDEX_NAME, WEIGHTS_NAME
from ..callbacks.checkpoint.export import INDEX_NAME as SAFE_WEIGHTS_INDEX_NAME
from ..callbacks.checkpoint.export import SINGLE_NAME as SAFE_WEIGHTS_NAME

__all__ = ["MODEL_NAME", "SAFE_MODEL_NAME", "WEIGHTS_NAME", "SAFE_WEIGHTS_NAME", "WEIGHTS_INDEX_NAME",
           "SAFE_WEIGHTS_INDEX_NAME", "RNG_STATE_NAME", "OPTIMIZER_NAME", "SCHEDULER_NAME", "SCALER_NAME",
           "SAMPLER_NAME"]

MODEL_NAME, SAFE_MODEL_NAME = WEIGHTS_NAME.removesuffix(".bin"), SAFE_WEIGHTS_NAME.removesuffix(".safetensors")
RNG_STATE_NAME, OPTIMIZER_NAME, SCHEDULER_NAME, SAMPLER_NAME = "random_states", "optimizer", "scheduler", "sampler"
SCALER_NAME = "scaler.pt"
