"""Accelerate's `is_*_available` checks: is a device there, is a package installed (without importing it).

>>> from cadence.utils import is_xpu_available, is_schedulefree_available
>>> device = "xpu" if is_xpu_available() else "cpu"
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch
from torch.torch_version import TorchVersion

__all__ = ["is_cuda_available", "is_xpu_available", "is_npu_available", "is_mlu_available", "is_sdaa_available",
           "is_musa_available", "is_hpu_available", "is_neuron_available", "is_mps_available", "is_bf16_available",
           "is_torch_xla_available", "is_deepspeed_available", "is_transformers_available", "is_datasets_available",
           "is_peft_available", "is_schedulefree_available", "is_tensorboard_available", "is_wandb_available",
           "is_comet_ml_available", "is_mlflow_available", "is_aim_available", "is_rich_available",
           "is_timm_available", "is_bnb_available", "is_torchvision_available", "is_fp16_available",
           "is_fp8_available", "is_4bit_bnb_available", "is_8bit_bnb_available", "is_torchao_available",
           "is_clearml_available", "is_dvclive_available", "is_pandas_available", "is_matplotlib_available"]


def _installed(name: str, minimum: str | None = None) -> bool:
    """`name` can be imported (it is not imported here), at version `minimum` or newer when given."""
    if importlib.util.find_spec(name) is None:
        return False
    return minimum is None or TorchVersion(importlib.metadata.version(name)) >= minimum


def _device(name: str) -> bool:
    module = getattr(torch, name, None)
    available = getattr(module, "is_available", None)
    return bool(available()) if callable(available) else False


def is_cuda_available() -> bool:
    """A CUDA (or ROCm) GPU is usable."""
    return torch.cuda.is_available()


def is_xpu_available(check_device: bool = False) -> bool:
    """An Intel XPU is usable (torch.xpu)."""
    return _device("xpu")


def is_npu_available(check_device: bool = False) -> bool:
    """An Ascend NPU is usable (torch_npu)."""
    return _installed("torch_npu") and _device("npu")


def is_mlu_available(check_device: bool = False) -> bool:
    """A Cambricon MLU is usable (torch_mlu)."""
    return _installed("torch_mlu") and _device("mlu")


def is_sdaa_available(check_device: bool = False) -> bool:
    """A Tecorigin SDAA is usable (torch_sdaa)."""
    return _installed("torch_sdaa") and _device("sdaa")


def is_musa_available(check_device: bool = False) -> bool:
    """A Moore Threads MUSA GPU is usable (torch_musa)."""
    return _installed("torch_musa") and _device("musa")


def is_hpu_available(init_hccl: bool = False) -> bool:
    """A Habana Gaudi HPU is usable (habana_frameworks)."""
    return _installed("habana_frameworks") and _device("hpu")


def is_neuron_available(check_device: bool = False) -> bool:
    """An AWS Neuron core is usable (torch_neuronx)."""
    return _installed("torch_neuronx") and _device("neuron")


def is_mps_available(min_version: str = "1.12") -> bool:
    """Apple's Metal GPU is usable."""
    return torch.backends.mps.is_available()


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """bf16 arithmetic is supported here (any CPU; a GPU that has it)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return True


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """torch_xla is installed."""
    return _installed("torch_xla")


def is_deepspeed_available() -> bool:
    return _installed("deepspeed")


def is_transformers_available() -> bool:
    return _installed("transformers")


def is_datasets_available() -> bool:
    return _installed("datasets")


def is_peft_available() -> bool:
    return _installed("peft")


def is_schedulefree_available() -> bool:
    return _installed("schedulefree")


def is_tensorboard_available() -> bool:
    return _installed("tensorboard") or _installed("tensorboardX")


def is_wandb_available() -> bool:
    return _installed("wandb")


def is_comet_ml_available() -> bool:
    return _installed("comet_ml")


def is_mlflow_available() -> bool:
    return _installed("mlflow")


def is_aim_available() -> bool:
    return _installed("aim")


def is_rich_available() -> bool:
    return _installed("rich")


def is_timm_available() -> bool:
    return _installed("timm")


def is_bnb_available() -> bool:
    return _installed("bitsandbytes")


def is_torchvision_available() -> bool:
    return _installed("torchvision")


def is_4bit_bnb_available() -> bool:
    """bitsandbytes >= 0.39.0 is installed (transformers' 4-bit loading)."""
    return _installed("bitsandbytes", "0.39.0")


def is_8bit_bnb_available() -> bool:
    """bitsandbytes >= 0.37.2 is installed (transformers' 8-bit loading)."""
    return _installed("bitsandbytes", "0.37.2")


def is_torchao_available() -> bool:
    """torchao >= 0.6.1 is installed."""
    return _installed("torchao", "0.6.1")


def is_fp16_available() -> bool:
    """fp16 mixed precision can be asked for (`Accelerator(mixed_precision="fp16")`)."""
    return True


def is_fp8_available() -> bool:
    """False: fp8 training is not in cadence (bf16 is: `Accelerator(mixed_precision="bf16")`)."""
    return False


def is_clearml_available() -> bool:
    return _installed("clearml")


def is_dvclive_available() -> bool:
    return _installed("dvclive")


def is_pandas_available() -> bool:
    return _installed("pandas")


def is_matplotlib_available() -> bool:
    return _installed("matplotlib")
