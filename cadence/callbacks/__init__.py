"""Training features, one callback per module."""

from .progress import ProgressCallback

__all__ = ["ProgressCallback"]
