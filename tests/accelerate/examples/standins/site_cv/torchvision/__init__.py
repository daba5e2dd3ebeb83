"""Offline stand-in for the part of torchvision cv_example uses (torchvision's CPU build cannot be installed here)."""

from . import transforms  # noqa: F401
