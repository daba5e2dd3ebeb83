"""`accelerate.utils.constants` under cadence: the file names of a saved model, as `save_model` writes them.

>>> safetensors.torch.load_file(Path("export") / SAFE_WEIGHTS_NAME)      # after accelerator.save_model(model, "export")
"""

from ..callbacks.checkpoint.bin_export import WEIGHTS_INDEX_NAME, WEIGHTS_NAME
from ..callbacks.checkpoint.export import INDEX_NAME as SAFE_WEIGHTS_INDEX_NAME
from ..callbacks.checkpoint.export import SINGLE_NAME as SAFE_WEIGHTS_NAME

__all__ = ["MODEL_NAME", "SAFE_MODEL_NAME", "WEIGHTS_NAME", "SAFE_WEIGHTS_NAME", "WEIGHTS_INDEX_NAME",
           "SAFE_WEIGHTS_INDEX_NAME"]

MODEL_NAME, SAFE_MODEL_NAME = WEIGHTS_NAME.removesuffix(".bin"), SAFE_WEIGHTS_NAME.removesuffix(".safetensors")
