"""Accelerate's environment helpers (`accelerate.utils.environment`): flags read from the environment.

>>> from cadence.utils import parse_flag_from_env, str_to_bool
>>> str_to_bool("yes"), parse_flag_from_env("MY_SCRIPT_DEBUG", default=False)
(1, False)
"""

from __future__ import annotations

import os

__all__ = ["str_to_bool", "parse_flag_from_env"]

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
