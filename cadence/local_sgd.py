"""`from cadence.local_sgd import LocalSGD`, where Accelerate has it (`accelerate.local_sgd`)."""

from .accelerate.local_sgd import LocalSGD

__all__ = ["LocalSGD"]
