"""MixedPrecision: train in bf16 or fp16 (autocast; fp16 with a GradScaler).

The callback is the switch; the strategy runs it (FSDP and DeepSpeed do mixed precision
themselves). Outside training the predictions come back in fp32, as fastai's do. An fp16 step
whose gradients overflow is skipped: `learn.step` does not advance, so schedules do not either,
and `skipped_steps` counts it.

>>> learn = Learner(dls, model, loss_func=F.cross_entropy).to_bf16()
>>> learn.fit(1, cbs=MixedPrecision("fp16"))
>>> learn.mixed_precision.skipped_steps
"""

from __future__ import annotations

from typing import Any, ContextManager

import torch

from ..distributed.ops import map_tensors
from ..distributed.precision import FullPrecision, make_precision
from ..distributed.strategy import OwnsPrecision
from ..trainer.callback import Callback, Order


class MixedPrecision(Callback):
    """Run forward and loss under autocast in `precision` ("bf16" or "fp16"); fp16 scales the loss.

    `scaler_kwargs` go to `torch.amp.GradScaler` (e.g. `init_scale=2.**16`, `growth_interval=2000`).
    Removed (`learn.remove_cb`, or after `fit(cbs=...)`), it takes its precision off the strategy: fp32 again.

    >>> with learn.no_bar(): learn.fit(1, cbs=MixedPrecision("bf16"))   # or learn.to_bf16()
    """

    order = Order.PRECISION

    def __init__(self, precision: str = "bf16", **scaler_kwargs):
        if precision not in ("bf16", "fp16"):
            raise ValueError(f"MixedPrecision takes 'bf16' or 'fp16', got {precision!r}; use learn.to_fp32() for fp32")
        self.precision, self.scaler_kwargs = precision, scaler_kwargs
        self.plugin: FullPrecision | None = None

    def plugin_for(self, device) -> FullPrecision:
        """The plugin for `device` (made once; a new device type gets a new one)."""
        if self.plugin is None or self.plugin.device_type != torch.device(device).type:
            self.plugin = make_precision(self.precision, device, **self.scaler_kwargs)
        return self.plugin

    def _plugin(self) -> FullPrecision:
        return self.plugin_for(self.learn.strategy.device)

    def before_fit(self):
        self.learn.strategy.set_precision(self._plugin())

    def forward_context(self) -> ContextManager:
        """The strategy's autocast, with this callback's precision set on it: in `fit` and outside it (`validate`,
        `get_preds`, `predict`, `summary`), before the first fit as after it."""
        strategy = self.learn.strategy
        if strategy.precision is not self.plugin:   # a new strategy (distrib_ctx), or not set yet
            plugin = self._plugin()
            if strategy.precision is not plugin:
                strategy.set_precision(plugin)
        return strategy.forward_context()

    def on_remove(self) -> None:
        """Full precision again on the learner's strategy if it runs this callback's precision (a later fit without
        this callback neither scales the loss nor autocasts). An engine that fixed its precision when it wrapped the
        model (FSDP, DeepSpeed) keeps it until `distrib_ctx` ends."""
        strategy = self.learn.strategy
        if self.plugin is not None and strategy.precision is self.plugin and not isinstance(strategy, OwnsPrecision):
            strategy.set_precision(FullPrecision())

    def after_pred(self):
        """Outside training, predictions in fp32 (fastai's): what validation's loss and metrics and `get_preds` see."""
        if not self.learn.training:
            self.learn.pred = map_tensors(_to_float, self.learn.pred)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because fp16 gradients overflowed."""
        return getattr(self.plugin, "skipped_steps", 0)

    def state_dict(self) -> dict[str, Any]:
        return {"precision": self.precision, "plugin": self.plugin.state_dict() if self.plugin is not None else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["precision"] != self.precision:
            raise ValueError(f"the checkpoint was trained with {state['precision']}, this run uses {self.precision}")
        if state["plugin"]:
            self._plugin().load_state_dict(state["plugin"])


def _to_float(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def set_precision(learn: Any, precision: str, **scaler_kwargs) -> Any:
    """Switch `learn` to "bf16", "fp16" or "no" (fp32): replaces any MixedPrecision callback."""
    learn.remove_cb(MixedPrecision)   # its precision leaves the strategy with it
    if precision == "no":
        learn.strategy.set_precision(FullPrecision())
        return learn
    return learn.add_cb(MixedPrecision(precision, **scaler_kwargs))
