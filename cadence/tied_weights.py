"""Tied weights: one Parameter that several modules share (a language model's embedding and output head).

A rebuild that replaces parameters module by module (`Module.to_empty`, `load_state_dict(assign=True)`) gives
each module its own copy; `retie` points them at one Parameter again.

>>> aliases = tied_names(gpt2)                  # {'lm_head.weight': 'transformer.wte.weight'}
>>> retie(gpt2.to_empty(device="cpu"), aliases).lm_head.weight is gpt2.transformer.wte.weight
True
"""

from __future__ import annotations

from torch import nn

__all__ = ["tied_names", "retie"]


def tied_names(model: nn.Module) -> dict[str, str]:
    """Every other name of a Parameter that several modules share (tied weights) -> the name it is stored under.

    The stored name is the one transformers keeps (not a key of the model's `all_tied_weights_keys`), else the
    first in `named_parameters` order (the module registered first: GPT-2's embedding before its head).

    >>> tied_names(gpt2)
    {'lm_head.weight': 'transformer.wte.weight'}
    """
    declared = set(getattr(model, "all_tied_weights_keys", None) or ())  # transformers 5: {tied name: source}
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    aliases = {}
    for names in names_of.values():
        kept = next((n for n in names if n not in declared), names[0])
        aliases.update({n: kept for n in names if n != kept})
    return aliases


def retie(model: nn.Module, aliases: dict[str, str]) -> nn.Module:
    """Point every alias of `aliases` (from `tied_names`) at its source's Parameter again; returns `model`.

    `Module.to_empty` (and any rebuild that replaces parameters module by module) gives each module its own.
    """
    for alias, source in aliases.items():
        owner, _, attr = alias.rpartition(".")
        setattr(model.get_submodule(owner), attr, model.get_parameter(source))
    return model
