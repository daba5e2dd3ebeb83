"""`datasets.utils.logging` of the offline stand-in (see ../__init__.py)."""

from . import logging  # noqa: F401
