"""GradClip: clip gradients before every optimizer step, after unscaling (fp16), over the whole model.

The norm before clipping is kept in `learn.grad_norm` (trackers log it): a float on the CPU, a tensor on
an accelerator (read it when you need it).

>>> learn.fit(3, cbs=GradClip(1.0))            # clip the global L2 norm to 1
>>> learn.fit(3, cbs=GradClip(value=0.5))      # clamp every gradient element
"""

from __future__ import annotations

import math

from ..distributed.strategy import OwnsClipping
from ..trainer.callback import Callback, Order


class GradClip(Callback):
    """Clip by global norm (`max_norm`, `norm_type`) or by value (`value`).

    >>> with learn.no_bar(): learn.fit(1, cbs=GradClip(1.0))
    >>> learn.grad_norm > 0   # the norm before clipping
    True
    """

    order = Order.CLIP
    run_valid = False

    def __init__(self, max_norm: float | None = None, norm_type: float = 2.0, value: float | None = None):
        if (max_norm is None) == (value is None):
            raise ValueError("GradClip takes either max_norm (e.g. GradClip(1.0)) or value (GradClip(value=0.5)), not both")
        for name, v in (("max_norm", max_norm), ("value", value)):
            if v is not None and not v > 0:
                raise ValueError(f"GradClip {name} must be > 0, got {v}")
        self.max_norm, self.norm_type, self.value = max_norm, norm_type, value
        self.engine_owned = False  # the strategy clips itself (DeepSpeed): configured in before_fit

    def before_fit(self):
        strategy = self.learn.strategy
        self.engine_owned = isinstance(strategy, OwnsClipping)
        if self.engine_owned:
            if self.max_norm is None:
                raise ValueError(f"{strategy.name} clips by norm only: use GradClip(max_norm)")
            strategy.configure_clipping(self.max_norm, self.norm_type)

    def after_step(self):
        if self.engine_owned:
            self.learn.grad_norm = self.learn.strategy.last_grad_norm()

    def before_step(self):
        learn = self.learn
        if self.engine_owned:
            return
        if self.max_norm is not None:
            norm = learn.strategy.clip_grad_norm(learn.model, learn.opt, self.max_norm, self.norm_type)
        else:
            norm = learn.strategy.clip_grad_norm(learn.model, learn.opt, math.inf, self.norm_type)
            learn.strategy.clip_grad_value(learn.model, learn.opt, self.value)
        # read on the CPU; elsewhere kept on the device (reading it would wait for it, on XLA run the step twice)
        learn.grad_norm = float(norm) if norm.device.type == "cpu" else norm.detach()
