"""Telling transformers that ZeRO-3 is on, so that the models it builds are partitioned as they are built.

Untold, transformers builds as if the parameters were whole: under `deepspeed.zero.Init`, `from_pretrained` fails on
the partitions' sizes and `from_config` initialises empty partitions (GPT-2's embedding kept torch's std 1). Told, it
loads into the partitions and initialises each module gathered. What it reads is its `HfDeepSpeedConfig`'s
`is_zero3()` and `config`; that class needs Accelerate, so cadence gives transformers a small object with those two.

>>> told = tell_transformers({"zero_optimization": {"stage": 3}})   # None where transformers is not installed
>>> forget_transformers(told)
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["TransformersZero3Config", "tell_transformers", "forget_transformers", "zero3_init"]


class TransformersZero3Config:
    """What transformers reads of the DeepSpeed config it is given."""

    def __init__(self, config: dict):
        self.config = config

    def is_zero3(self) -> bool:
        return True


def tell_transformers(config: dict) -> TransformersZero3Config | None:
    """Tell transformers that ZeRO-3 is on with engine config `config`, until `forget_transformers`. Transformers
    holds the returned object weakly: keep it. None where transformers is not installed."""
    if importlib.util.find_spec("transformers") is None:
        return None
    from transformers.integrations.deepspeed import set_hf_deepspeed_config

    told = TransformersZero3Config(config)
    set_hf_deepspeed_config(told)
    return told


def forget_transformers(told: TransformersZero3Config | None) -> None:
    """Undo `tell_transformers` (nothing when it returned None)."""
    if told is not None:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()


@contextlib.contextmanager
def zero3_init(deepspeed: Any, config: dict) -> Iterator[None]:
    """`deepspeed.zero.Init`, with transformers told that ZeRO-3 is on while it lasts (when the script imported it)."""
    told = tell_transformers(config) if "transformers" in sys.modules else None
    try:
        with deepspeed.zero.Init(config_dict_or_path=config):
            yield
    finally:
        forget_transformers(told)
