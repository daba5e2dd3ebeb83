"""Accelerate's string enums: `LoggerType` (tracker names), `PrecisionType`, `RNGType`; same members and values.

>>> Accelerator(log_with=LoggerType.TENSORBOARD, mixed_precision=PrecisionType.BF16)
>>> "wandb" in LoggerType, str(LoggerType.WANDB), PrecisionType.list()
(True, 'wandb', ['no', 'fp8', 'fp16', 'bf16'])
"""

from __future__ import annotations

import enum

__all__ = ["LoggerType", "PrecisionType", "RNGType"]


class _ContainsValues(enum.EnumMeta):
    """`value in Enum` is True for a member's value (`"wandb" in LoggerType`), as in Accelerate."""

    def __contains__(cls, item: object) -> bool:
        try:
            cls(item)
        except ValueError:
            return False
        return True


class _ValueEnum(enum.Enum, metaclass=_ContainsValues):
    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        """Every member's value, in order."""
        return [str(member) for member in cls]


class LoggerType(_ValueEnum):
    """Accelerate's tracker names, for `log_with`; cadence runs "all", "tensorboard" and "wandb" (and "csv", its
    own), and refuses the others naming these."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"


class PrecisionType(str, _ValueEnum):
    """`mixed_precision` values; a member equals its string (`PrecisionType.BF16 == "bf16"`). cadence runs no, fp16
    and bf16."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class RNGType(_ValueEnum):
    """The random generators `rng_types` names."""

    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    NEURON = "neuron"
    GENERATOR = "generator"
