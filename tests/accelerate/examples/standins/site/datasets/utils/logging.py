"""`datasets.utils.logging.set_verbosity_*`: the stand-in logs nothing, so these only record the level."""

import logging

_logger = logging.getLogger("datasets")


def set_verbosity(level: int) -> None:
    _logger.setLevel(level)


def set_verbosity_warning() -> None:
    set_verbosity(logging.WARNING)


def set_verbosity_error() -> None:
    set_verbosity(logging.ERROR)


def set_verbosity_info() -> None:
    set_verbosity(logging.INFO)
