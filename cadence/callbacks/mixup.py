"""MixUp and CutMix (fastai's), as callbacks on the same loop, equal on N processes to one process.

Each training batch is mixed with a shuffled copy of itself: MixUp blends whole inputs with a
weight `lam ~ Beta(alpha, alpha)` per item (kept >= 0.5, so the original dominates), CutMix pastes
a box of the partner image. Targets are blended the same way, or, for class-index targets (an
integer tensor, or a loss with fastai's `y_int`), the loss is `lerp(loss(partner), loss(own), lam)`.

Under distribution the partners and weights are drawn for the global batch (every process's
batch, in rank order) from generators all processes seed alike, and each process mixes its own
rows with partners from any process: the run equals one process training on the same global
batches. Their random states are saved with a checkpoint, so a resumed run mixes the same way.

>>> learn.fit_one_cycle(5, 1e-3, cbs=MixUp(0.4))
>>> learn.fit_one_cycle(5, 1e-3, cbs=CutMix(1.0))
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import torch

from ..trainer.callback import Callback, Order
from ..trainer.gather import per_item_loss

__all__ = ["MixUp", "CutMix"]


class _MixHandler(Callback):
    """Shared by MixUp and CutMix: the random draws, the global batch, the mixed loss."""

    run_valid = False
    order = Order.DEFAULT

    def __init__(self, alpha: float):
        if not isinstance(alpha, (int, float)) or alpha <= 0:
            raise ValueError(f"{type(self).__name__}(alpha=...) is the Beta distribution's parameter, > 0; got {alpha!r}")
        self.alpha = float(alpha)
        self._gen: torch.Generator | None = None
        self._np: np.random.Generator | None = None
        self._loaded: dict[str, Any] | None = None
        self._own_loss = None

    # ------------------------------------------------------------------ random draws shared by all processes
    def before_fit(self):
        if self._loaded is not None:  # a resumed run continues the saved generators
            state, self._loaded = self._loaded, None
            self._seed(0)
            self._gen.set_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
            self._np.bit_generator.state = state["numpy"]
            return
        seed = int(torch.randint(0, 2**31 - 1, ()))  # from torch's global RNG, then process 0's for all
        self._seed(int(self.learn.strategy.broadcast(seed)))

    def _seed(self, seed: int) -> None:
        self._gen, self._np = torch.Generator().manual_seed(seed), np.random.default_rng(seed)

    def state_dict(self) -> dict[str, Any]:
        if self._gen is None:
            return {}
        return {"torch": base64.b64encode(self._gen.get_state().numpy().tobytes()).decode("ascii"),
                "numpy": self._np.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loaded = state or None

    def _beta(self, n: int) -> torch.Tensor:
        return torch.from_numpy(self._np.beta(self.alpha, self.alpha, size=n)).float()

    # ------------------------------------------------------------------ the global batch
    def _global(self) -> tuple[list[torch.Tensor], list[torch.Tensor], slice, int]:
        """Every process's inputs and targets (in rank order), this process's rows in them, the global size."""
        learn = self.learn
        if type(learn.xb) is not tuple or not all(isinstance(t, torch.Tensor) for t in (*learn.xb, *learn.yb)):
            raise TypeError(f"{type(self).__name__} mixes tensor batches (inputs, targets); got a "
                            f"{type(learn.xb).__name__} batch: use it with (x, y) tensor batches")
        gather = learn.strategy.gather
        n = learn.xb[0].shape[0]
        sizes = gather(torch.tensor([n], device=learn.xb[0].device)).tolist()
        start = sum(sizes[:learn.strategy.dp_rank]) if len(sizes) > 1 else 0  # a one-process Learner gathers nothing
        return ([gather(x) for x in learn.xb], [gather(y) for y in learn.yb], slice(start, start + n), sum(sizes))

    def _set_targets(self, yb1: tuple, lam: torch.Tensor) -> None:
        """Blend float targets; for class indices mix the losses instead."""
        learn = self.learn
        self._stack_y = getattr(self._own_loss or learn.loss_func, "y_int", False) or \
            any(not torch.is_floating_point(y) for y in learn.yb)
        self.yb1, self.lam = yb1, lam
        if not self._stack_y:
            learn.yb = tuple(torch.lerp(a, b, _expand(lam, b).to(b.dtype)) for a, b in zip(yb1, learn.yb))
        elif self._own_loss is None:
            self._own_loss, learn.loss_func = learn.loss_func, self._mixed_loss

    def _mixed_loss(self, pred: torch.Tensor, *yb: torch.Tensor) -> torch.Tensor:
        lf = self._own_loss
        if not self.learn.training:
            return lf(pred, *yb)
        own, partner = per_item_loss(lf, pred, yb), per_item_loss(lf, pred, self.yb1)
        loss = torch.lerp(partner, own, _expand(self.lam, own).to(own.dtype))
        reduction = getattr(lf, "reduction", "mean")
        return loss.sum() if reduction == "sum" else loss if reduction == "none" else loss.mean()

    def _restore_loss(self) -> None:
        if self._own_loss is not None:
            self.learn.loss_func, self._own_loss = self._own_loss, None

    def after_train(self):
        self._restore_loss()

    after_cancel_train = after_cancel_fit = after_fit = after_train


def _expand(w: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-item weight shaped to broadcast over `like` (batch first)."""
    w = w.to(like.device)
    return w.reshape(-1, *([1] * (like.ndim - 1))) if w.ndim == 1 and like.ndim >= 1 else w


class MixUp(_MixHandler):
    """fastai's MixUp: each input becomes `lerp(partner, own, lam)`, `lam = max(l, 1 - l)`, `l ~ Beta(alpha, alpha)`.

    >>> learn.fit_one_cycle(5, 1e-3, cbs=MixUp(0.4))
    """

    def __init__(self, alpha: float = 0.4):
        super().__init__(alpha)

    def before_batch(self):
        learn = self.learn
        xs, ys, mine, total = self._global()
        lam = self._beta(total)
        lam = torch.maximum(lam, 1 - lam)[mine]
        self.partner = partner = torch.randperm(total, generator=self._gen)[mine].to(xs[0].device)
        learn.xb = tuple(torch.lerp(x[partner], own, _expand(lam, own).to(own.dtype)) if torch.is_floating_point(own)
                         else own for x, own in zip(xs, learn.xb))
        self._set_targets(tuple(y[partner] for y in ys), lam)


class CutMix(_MixHandler):
    """fastai's CutMix: a box of each image comes from its partner in the batch.

    Images are (batch, channels, height, width); `lam` (one per batch) is the share of the image left its own.

    >>> learn.fit_one_cycle(5, 1e-3, cbs=CutMix(1.0))
    """

    def __init__(self, alpha: float = 1.0):
        super().__init__(alpha)

    def before_batch(self):
        learn = self.learn
        x = learn.xb[0]
        if x.ndim != 4:
            raise ValueError(f"CutMix cuts boxes out of image batches (batch, channels, height, width); got inputs "
                             f"of shape {tuple(x.shape)}: use MixUp for other inputs")
        xs, ys, mine, total = self._global()
        H, W = x.shape[-2:]
        lam = float(self._beta(1)[0])
        self.partner = partner = torch.randperm(total, generator=self._gen)[mine].to(x.device)
        cut = (1.0 - lam) ** 0.5
        cut_w, cut_h = round(W * cut), round(H * cut)
        cx, cy = (int(torch.randint(0, size, (), generator=self._gen)) for size in (W, H))
        x1, x2 = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, W)
        y1, y2 = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, H)
        mixed = x.clone()
        mixed[..., y1:y2, x1:x2] = xs[0][partner][..., y1:y2, x1:x2]
        learn.xb = (mixed, *learn.xb[1:])
        kept = 1 - (x2 - x1) * (y2 - y1) / float(W * H)
        self._set_targets(tuple(y[partner] for y in ys), torch.full((x.shape[0],), kept))
