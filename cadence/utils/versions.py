"""`accelerate.utils.is_torch_version` and `compare_versions` under cadence.

>>> is_torch_version(">=", "2.0")
True
"""

from __future__ import annotations

import importlib.metadata
import operator
from typing import Any

from torch.torch_version import TorchVersion

__all__ = ["compare_versions", "is_torch_version"]

# TorchVersion (a str) compares as a version with >, >=, ==, <=, <; its != is str's, so it is `not ==` here
_OPERATIONS = {">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": lambda a, b: not a == b,
               "<=": operator.le, "<": operator.lt}


def compare_versions(library_or_version: Any, operation: str, requirement_version: str) -> bool:
    """Whether an installed library's version (by name) or a version object (`packaging`'s `Version`) stands in
    `operation` (">", ">=", "==", "!=", "<=", "<") to `requirement_version`.

    >>> compare_versions("torch", ">=", "2.0"), compare_versions(TorchVersion("1.2"), "<", "1.10")
    (True, True)
    """
    if operation not in _OPERATIONS:
        raise ValueError(f"compare_versions: operation must be one of {list(_OPERATIONS)}, got {operation!r}")
    version = (importlib.metadata.version(library_or_version) if isinstance(library_or_version, str)
               else str(library_or_version))
    return _OPERATIONS[operation](TorchVersion(version), requirement_version)


def is_torch_version(operation: str, version: str) -> bool:
    """Whether the installed torch's version stands in `operation` (">", ">=", "==", "!=", "<=", "<") to `version`.

    >>> is_torch_version(">=", "2.0"), is_torch_version("<", "2.0")
    (True, False)
    """
    return compare_versions("torch", operation, version)
