"""`accelerate.utils.extract_model_from_parallel`, `is_compiled_module` and `is_peft_model` under cadence."""

from __future__ import annotations

import sys

from torch import nn

from ..compile import unwrap_compiled

__all__ = ["extract_model_from_parallel", "is_compiled_module", "is_peft_model"]


def extract_model_from_parallel(model: nn.Module, keep_fp32_wrapper: bool = True) -> nn.Module:
    """The user's module inside DDP / DataParallel / a DeepSpeed engine / torch.compile (FSDP2 shards in place).

    >>> extract_model_from_parallel(accelerator.prepare(model)) is model
    True
    """
    from ..accelerate.preparation import restore_forward

    while True:
        model = unwrap_compiled(model)
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            break
        model = inner
    if not keep_fp32_wrapper:
        restore_forward(model)
    return model


def is_compiled_module(module: nn.Module) -> bool:
    """True for a `torch.compile`d module (its `OptimizedModule` wrapper).

    >>> is_compiled_module(torch.compile(net)), is_compiled_module(net)
    (True, False)
    """
    return unwrap_compiled(module) is not module


def is_peft_model(model: nn.Module) -> bool:
    """True for a PEFT model (`peft.PeftModel`); answered without importing peft, which such a model already did.

    >>> is_peft_model(get_peft_model(base, LoraConfig(target_modules=["q_proj"]))), is_peft_model(base)
    (True, False)
    """
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)
