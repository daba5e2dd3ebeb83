"""Accelerate's environment helpers (`accelerate.utils.environment`) and the `is_*_available` checks user code
reads that `cadence.accelerate.imports` does not hold.

>>> from cadence.utils import parse_flag_from_env, str_to_bool, is_pandas_available
>>> str_to_bool("yes"), parse_flag_from_env("MY_SCRIPT_DEBUG", default=False)
(1, False)
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

from .versions import compare_versions

__all__ = ["str_to_bool", "parse_flag_from_env", "is_fp16_available", "is_fp8_available", "is_4bit_bnb_available",
           "is_8bit_bnb_available", "is_torchao_available", "is_clearml_available", "is_dvclive_available",
           "is_pandas_available", "is_matplotlib_available"]

_TRUE, _FALSE = ("y", "yes", "t", "true", "on", "1"), ("n", "no", "f", "false", "off", "0")


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """1 for y/yes/t/true/on/1, 0 for n/no/f/false/off/0 (any case); True/False with `to_bool`; else ValueError."""
    if value.lower() in _TRUE:
        return True if to_bool else 1
    if value.lower() in _FALSE:
        return False if to_bool else 0
    raise ValueError(f"invalid truth value {value!r}: use one of {', '.join(_TRUE + _FALSE)}")


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """Whether environment variable `key` is set true (`str_to_bool`); `default` when it is not set."""
    return str_to_bool(os.environ.get(key, str(default))) == 1


def _installed(name: str, minimum: str | None = None) -> bool:
    if importlib.util.find_spec(name) is None:
        return False
    return minimum is None or compare_versions(importlib.metadata.version(name), ">=", minimum)


def is_fp16_available() -> bool:
    """fp16 mixed precision can be asked for (`Accelerator(mixed_precision="fp16")`)."""
    return True


def is_fp8_available() -> bool:
    """False: fp8 training is not in cadence (bf16 is: `Accelerator(mixed_precision="bf16")`)."""
    return False


def is_4bit_bnb_available() -> bool:
    """bitsandbytes >= 0.39.0 is installed (transformers' 4-bit loading)."""
    return _installed("bitsandbytes", "0.39.0")


def is_8bit_bnb_available() -> bool:
    """bitsandbytes >= 0.37.2 is installed (transformers' 8-bit loading)."""
    return _installed("bitsandbytes", "0.37.2")


def is_torchao_available() -> bool:
    """torchao >= 0.6.1 is installed."""
    return _installed("torchao", "0.6.1")


def is_clearml_available() -> bool:
    return _installed("clearml")


def is_dvclive_available() -> bool:
    return _installed("dvclive")


def is_pandas_available() -> bool:
    return _installed("pandas")


def is_matplotlib_available() -> bool:
    return _installed("matplotlib")
