"""`accelerate.utils` names cadence has no counterpart for: importing one says so, and what to use instead.

`from cadence.utils import FP8RecipeKwargs` raises ImportError naming the name and the replacement, instead
of Python's bare "cannot import name". Names that are not Accelerate's get Python's usual AttributeError.

>>> from cadence.utils import MegatronLMPlugin
Traceback (most recent call last):
ImportError: cadence.utils has no MegatronLMPlugin (accelerate.utils.MegatronLMPlugin): Megatron-LM is not part ...
"""

from __future__ import annotations

from typing import Any, Callable

from ..accelerate.preparation import _MODEL_PARALLEL

__all__ = ["REPLACEMENTS", "module_getattr"]

_FP8 = "fp8 training is not in cadence; train in bf16: Accelerator(mixed_precision='bf16')"
_MEGATRON = f"Megatron-LM is not part of cadence; {_MODEL_PARALLEL}"
_LAUNCH = ("cadence's launchers start fresh processes themselves: `cadence launch`, or from Python "
           "notebook_launcher(fn, args, num_processes) / debug_launcher(fn)")
_REGIONAL = ("cadence compiles each prepared model whole, in place: Accelerator(dynamo_backend='inductor') or "
             "TorchDynamoPlugin; for regional compilation call torch.compile on each repeated block yourself")
_FSDP = ("accelerator.save_state / load_state save and restore sharded models and optimizers on every engine, "
         "accelerator.save_model writes the full weights; prepare wraps the model in FSDP2")
_DEEPSPEED = ("accelerator.prepare builds and wraps DeepSpeed's engine (`cadence launch --use_deepspeed`); "
              "its config is accelerator.state.deepspeed_plugin.deepspeed_config")
_QUANTIZE = ("bitsandbytes quantization is not in cadence; load the model quantized (transformers' "
             "BitsAndBytesConfig in from_pretrained) and prepare it")

REPLACEMENTS: dict[str, str] = {
    **dict.fromkeys(["FP8RecipeKwargs", "AORecipeKwargs", "TERecipeKwargs", "MSAMPRecipeKwargs", "convert_model",
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
    **dict.fromkeys(["compile_regions", "compile_regions_deepspeed", "has_compiled_regions"], _REGIONAL),
    **dict.fromkeys(["save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer", "load_fsdp_optimizer",
                     "merge_fsdp_weights", "fsdp2_prepare_model", "fsdp2_load_full_state_dict",
                     "enable_fsdp_ram_efficient_loading", "disable_fsdp_ram_efficient_loading"], _FSDP),
    **dict.fromkeys(["DeepSpeedEngineWrapper", "DeepSpeedOptimizerWrapper", "DeepSpeedSchedulerWrapper",
                     "HfDeepSpeedConfig", "get_active_deepspeed_plugin", "map_pytorch_optim_to_deepspeed"], _DEEPSPEED),
    **dict.fromkeys(["BnbQuantizationConfig", "load_and_quantize_model"], _QUANTIZE),
    "get_grad_scaler": ("the Accelerator makes its own with mixed_precision='fp16' (accelerator.scaler; options in "
                        "GradScalerKwargs); by hand, torch.amp.GradScaler(device_type)"),
    "save": "accelerator.save(obj, f, safe_serialization=...) (the main process writes)",
    "load": "torch.load(f, weights_only=True), or safetensors.torch.load_file for a .safetensors file",
    "synchronize_rng_state": "synchronize_rng_states(['torch', 'cuda'])",
    "get_mixed_precision_context_manager": "accelerator.autocast() (AutocastKwargs for its options)",
}


def module_getattr(module: str) -> Callable[[str], Any]:
    """A module `__getattr__` (PEP 562) for `module`: ImportError naming an Accelerate name and its replacement.

    An ImportError, not an AttributeError: `from module import name` would replace an AttributeError's message with
    its own "cannot import name".
    """
    def __getattr__(name: str) -> Any:
        if name in REPLACEMENTS:
            raise ImportError(f"{module} has no {name} (accelerate.utils.{name}): {REPLACEMENTS[name]}")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
