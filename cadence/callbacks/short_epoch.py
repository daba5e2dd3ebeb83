"""ShortEpochCallback (fastai's): train and validate on only the first `pct` of each epoch, to try a setup fast.

>>> learn.fit(1, cbs=ShortEpochCallback(pct=0.1))        # a tenth of the batches, then the epoch ends
"""

from __future__ import annotations

from ..trainer.callback import Callback
from ..trainer.events import CancelTrainException, CancelValidateException

__all__ = ["ShortEpochCallback"]


class ShortEpochCallback(Callback):
    """Stop each training pass once `pct` of its batches ran; the validation passes too if `short_valid`.

    Every process stops at the same batch (each has the same number of batches).

    >>> with learn.no_bar(): learn.fit(1, cbs=ShortEpochCallback(pct=0.5))
    >>> learn.train_iter < 4   # of 4 batches
    True
    """

    def __init__(self, pct: float = 0.01, short_valid: bool = True):
        if not 0 < pct <= 1:
            raise ValueError(f"ShortEpochCallback(pct=...) is the fraction of each epoch to run, in (0, 1]; got {pct!r}")
        self.pct, self.short_valid = pct, short_valid

    def after_batch(self):
        n_iter = self.learn.n_iter
        if not n_iter or self.learn.iter / n_iter < self.pct:
            return
        if self.learn.training:
            raise CancelTrainException()
        if self.short_valid:
            raise CancelValidateException()
