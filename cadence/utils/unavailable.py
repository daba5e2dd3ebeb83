"""`accelerate.utils` names cadence has no counterpart for: importing one says so, and what to use instead.

`from cadence.utils import FP8RecipeKwargs` raises ImportError naming the name and the replacement, instead
of Python's bare "cannot import name". Any other lookup of such a name (`getattr`, `hasattr`, `monkeypatch.setattr`)
gets an AttributeError (PEP 562), its message naming the replacement, so `hasattr(cadence.utils, name)` is False
and `getattr(cadence.utils, name, None)` is None. Which of the two is told apart by the instruction the caller is
at (IMPORT_FROM: a `from ... import`). Generic names a library may probe for (`save`, `load`, ...) are not listed:
they get Python's usual AttributeError, as does any name that is not Accelerate's.

>>> from cadence.utils import MegatronLMPlugin
Traceback (most recent call last):
ImportError: cadence.utils has no MegatronLMPlugin (accelerate.utils.MegatronLMPlugin): Megatron-LM is not part ...
>>> import cadence.utils; hasattr(cadence.utils, "MegatronLMPlugin")
False
"""

from __future__ import annotations

import dis
import sys
from collections.abc import Mapping
from typing import Any, Callable

from ..accelerate.preparation import MODEL_PARALLEL_HINT

__all__ = ["REPLACEMENTS", "module_getattr"]

_FP8 = "fp8 training is not in cadence; train in bf16: Accelerator(mixed_precision='bf16')"
_MEGATRON = f"Megatron-LM is not part of cadence; {MODEL_PARALLEL_HINT}"
_LAUNCH = ("cadence's launchers start fresh processes themselves: `cadence launch`, or from Python "
           "notebook_launcher(fn, args, num_processes) / debug_launcher(fn)")
_FSDP = ("accelerator.save_state / load_state save and restore sharded models and optimizers on every engine, "
         "accelerator.save_model writes the full weights; prepare wraps the model in FSDP2")
_DEEPSPEED = ("accelerator.prepare builds and wraps DeepSpeed's engine (`cadence launch --use_deepspeed`); "
              "its config is accelerator.state.deepspeed_plugin.deepspeed_config")
_QUANTIZE = ("bitsandbytes quantization is not in cadence; load the model quantized (transformers' "
             "BitsAndBytesConfig in from_pretrained) and prepare it")

REPLACEMENTS: dict[str, str] = {
    **dict.fromkeys(["FP8RecipeKwargs", "AORecipeKwargs", "TERecipeKwargs", "MSAMPRecipeKwargs",
                     "convert_model_to_fp8_ao", "apply_fp8_autowrap", "contextual_fp8_autocast",
                     "has_transformer_engine_layers", "has_ao_layers", "filter_first_and_last_linear_layers",
                     "check_cuda_fp8_capability"], _FP8),
    **dict.fromkeys(["MegatronLMPlugin", "MegatronLMDummyScheduler", "MegatronLMDummyDataLoader", "AbstractTrainStep",
                     "GPTTrainStep", "BertTrainStep", "T5TrainStep", "avg_losses_across_data_parallel_group",
                     "add_model_config_to_megatron_parser"], _MEGATRON),
    **dict.fromkeys(["TorchTensorParallelPlugin", "TorchTensorParallelConfig"],
                    "tensor parallelism is ParallelismConfig(tp_size=N) (cadence.utils.ParallelismConfig) given to "
                    "Accelerator(parallelism_config=...)"),
    "TorchContextParallelConfig": "context parallelism is not in cadence; ParallelismConfig(tp_size=N) shards "
                                  "long sequences with SequenceParallel in the tensor-parallel plan",
    "DeepSpeedSequenceParallelConfig": ("Accelerate's sequence parallelism (DeepSpeed's) is not in cadence; put "
                                        "SequenceParallel in the tensor-parallel plan, ParallelismConfig(tp_size=N)"),
    **dict.fromkeys(["PrepareForLaunch", "prepare_multi_gpu_env", "prepare_simple_launcher_cmd_env",
                     "prepare_deepspeed_cmd_env", "prepare_tpu"], _LAUNCH),
    **dict.fromkeys(["save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer", "load_fsdp_optimizer",
                     "merge_fsdp_weights", "fsdp2_prepare_model", "fsdp2_load_full_state_dict",
                     "enable_fsdp_ram_efficient_loading", "disable_fsdp_ram_efficient_loading"], _FSDP),
    **dict.fromkeys(["DeepSpeedEngineWrapper", "DeepSpeedOptimizerWrapper", "DeepSpeedSchedulerWrapper",
                     "HfDeepSpeedConfig", "get_active_deepspeed_plugin", "map_pytorch_optim_to_deepspeed"], _DEEPSPEED),
    **dict.fromkeys(["BnbQuantizationConfig", "load_and_quantize_model"], _QUANTIZE),
    "synchronize_rng_state": "synchronize_rng_states(['torch', 'cuda'])",
    "get_mixed_precision_context_manager": "accelerator.autocast() (AutocastKwargs for its options)",
    "GatheredParameters": "under ZeRO-3 use DeepSpeed's own: `from deepspeed.zero import GatheredParameters`",
    **dict.fromkeys(["load_offloaded_weights", "OffloadedWeightsLoader", "PrefixedDataset"],
                    "disk_offload(model, folder) and load_checkpoint_and_dispatch(..., offload_folder=folder) write "
                    "and read the offloaded weights themselves (safetensors files), loading each module's on use; "
                    "load_offloaded_weight(file, index[name]) reads one tensor of Accelerate's offload folder"),
}


_IMPORT_FROM = dis.opmap["IMPORT_FROM"]


def module_getattr(module: str, replacements: Mapping[str, str] = REPLACEMENTS,
                   accelerate_module: str = "accelerate.utils") -> Callable[[str], Any]:
    """A module `__getattr__` (PEP 562) for `module`, cadence's counterpart of `accelerate_module`: a name of
    `replacements` (Accelerate's names cadence has not: {name: what to use instead}) raises an error naming it.

    ImportError under `from module import name` (whose "cannot import name" would replace an AttributeError's
    message), AttributeError otherwise, so that `hasattr` and `getattr(module, name, None)` work.

    >>> __getattr__ = module_getattr(__name__, {"CpuOffload": "cpu_offload(model)"}, "accelerate.hooks")
    """
    def __getattr__(name: str) -> Any:
        if name not in replacements:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        message = f"{module} has no {name} ({accelerate_module}.{name}): {replacements[name]}"
        if _importing_from(sys._getframe(1)):
            raise ImportError(message, name=module)
        raise AttributeError(message, name=name, obj=sys.modules.get(module))

    return __getattr__


def _importing_from(frame: Any) -> bool:
    """Whether `frame` is at an IMPORT_FROM instruction (`from m import name` looks `name` up on `m`)."""
    try:
        return frame.f_code.co_code[frame.f_lasti] == _IMPORT_FROM
    except (AttributeError, IndexError, TypeError):   # no frame, or an interpreter without these: the plain case
        return False
