"""The Strategy interface every engine adapter implements, its ability interfaces, and `SingleDevice`.

The Learner's loop, the callbacks and the checkpoint code only call these methods, so DDP, FSDP,
DeepSpeed and XLA slot in without an `if` on the kind of engine. A strategy owns the device, the
process group, the wrapping of model and optimizer, how backward and step run (precision
included), the collectives of its data-parallel group, and its checkpoint format.

>>> strategy = SingleDevice("cpu")
>>> model, opt = strategy.setup(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
>>> with strategy.forward_context(): loss = loss_func(model(x), y)
>>> strategy.backward(loss); stepped = strategy.step(opt); strategy.zero_grad(opt)
"""

from __future__ import annotations

import contextlib
import copy
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, ContextManager, TypeVar

import torch
from torch import nn

from ..compile import unwrap_compiled
from ..tied_weights import retie, tied_names
from . import env, ops
from .kept_state import kept_in_memory
from .load_in_place import load_optimizer_in_place
from .precision import FullPrecision
from .staging import HostBuffers, Staging, host_copy
from .state_files import OPTIMIZER_FILE, file_writers, load_model_file, load_optimizer_file, write_state_files

T = TypeVar("T")
MakeOpt = Callable[[nn.Module], torch.optim.Optimizer]


class Strategy:
    """Base class: one process, one device. Subclasses override what their engine changes."""

    name = "single"
    _skeleton: nn.Module | None = None  # a sharding engine's meta copy of the user's module, taken before it wraps
    staging: Staging | None = None  # an asynchronous save still copying the parameters and optimizer state
    steps_wait_for_staging = False  # this engine's `step` waits for `staging` itself (else: a hook on the optimizer)
    optimizer_replaceable = True  # `new_optimizer` gives an optimizer `step` steps (False: refused)
    _writers: tuple[int, int] | None = None  # the ranks writing model.safetensors and optimizer.pt (`_file_writers`)

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else env.default_device()
        self.precision: FullPrecision = FullPrecision()

    @classmethod
    def check_launcher_config(cls, config: Any) -> None:
        """Refuse (ValueError) engine options in the launcher's config before any worker starts."""

    # ------------------------------------------------------------------ lifecycle
    def setup_environment(self) -> None:
        """Create the process group / select the device. Nothing to do on one device."""

    def teardown(self) -> None:
        """Undo `setup_environment`."""

    # ------------------------------------------------------------------ model and optimizer
    def init_context(self) -> ContextManager:
        """Where a big model is built (meta device, sharded init); a null context by default.

        >>> with strategy.init_context(): model = BigModel()
        """
        return contextlib.nullcontext()

    def setup(self, model: nn.Module, make_opt: MakeOpt, precision: FullPrecision | None = None
              ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Wrap `model` for this engine, then build the optimizer over the wrapped parameters.

        `precision` (a plugin from `precision.make_precision`) is known here because some engines
        (FSDP's MixedPrecisionPolicy, DeepSpeed's config) need it when they wrap.
        """
        if precision is not None:
            self.set_precision(precision)
        if not _on_meta(model):  # a model built under another engine's init_context waits for that engine
            model = model.to(self.device)
        return model, make_opt(model)

    def release(self, model: nn.Module, opt: torch.optim.Optimizer, make_opt: MakeOpt
                ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Undo `setup`: the user's plain module and an optimizer over it, with the trained state."""
        return self.unwrap(model), opt

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside whatever `setup` returned (and inside a `torch.compile` wrapper)."""
        return unwrap_compiled(model)

    def wait_for_staging(self) -> None:
        """Before anything but a forward and backward writes the parameters or the optimizer state (an optimizer
        step, a load, a change of what trains): an asynchronous save's copy of them (`staging`) finishes first.

        >>> learn.strategy.wait_for_staging(); learn.strategy.load_model_state_dict(learn.model, weights)
        """
        staging, self.staging = self.staging, None
        if staging is not None:
            staging.wait()

    def trainable_changed(self, model: nn.Module, opt: torch.optim.Optimizer
                          ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Called after parameters' `requires_grad` changed (`learn.freeze()`); returns the model and optimizer
        to use from now on. Nothing to do for most engines; DDP re-wraps (it fixes its parameters at wrap time).

        >>> learn.model, learn.opt = learn.strategy.trainable_changed(learn.model, learn.opt)
        """
        return model, opt

    def new_optimizer(self, model: nn.Module, make_opt: Callable[[nn.Module], torch.optim.Optimizer]
                      ) -> torch.optim.Optimizer:
        """A fresh optimizer over the parameters `model` holds (`learn.create_opt()`, `fit(reset_opt=True)`), which
        `step` then steps; refused by an engine that steps the optimizer it was built with (DeepSpeed).

        >>> learn.opt = learn.strategy.new_optimizer(learn.model, learn._make_opt)
        """
        if not self.optimizer_replaceable:
            raise ValueError(f"learn.create_opt() (or fit(reset_opt=True)) cannot replace the optimizer under "
                             f"{self.name}: its engine steps the one it was built with in distrib_ctx; call it "
                             f"before distrib_ctx (the engine is then built with the new optimizer)")
        return make_opt(self.unwrap(model))

    def shard(self, dl):
        """The part of `dl` this process iterates; all of it on one device."""
        return dl

    # ------------------------------------------------------------------ one optimisation step
    def set_precision(self, precision: FullPrecision) -> None:
        """Use a precision plugin (see `precision.make_precision`); the MixedPrecision callback calls this."""
        self.precision = precision

    def forward_context(self) -> ContextManager:
        """Context the forward pass and loss run in (autocast for mixed precision)."""
        return self.precision.forward_context()

    def loss_context(self) -> ContextManager | None:
        """A context the forward pass and loss need besides precision (torch's `loss_parallel`); None for none."""
        return None

    def set_gradient_sync(self, model: nn.Module, enabled: bool) -> None:
        """With `enabled=False` the next forward and backward keep gradients local (accumulation micro-steps)."""

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward of `loss` (scaled for fp16); `kwargs` go to `loss.backward` (`retain_graph`, `inputs`)."""
        self.precision.backward(loss, **kwargs)

    def step(self, opt: torch.optim.Optimizer) -> bool:
        """Step the optimizer; False when the step was skipped (e.g. fp16 overflow)."""
        return self.precision.step(opt)

    def zero_grad(self, opt: torch.optim.Optimizer) -> None:
        """Drop the gradients (set to None) after a step."""
        opt.zero_grad(set_to_none=True)

    def end_of_step(self) -> None:
        """The step's gradients are gone (a hand-written loop zeroed them): an engine that runs lazily (XLA) runs
        the step now. Nothing here."""

    def clip_grad_norm(self, model: nn.Module, opt: torch.optim.Optimizer, max_norm: float,
                       norm_type: float = 2.0) -> torch.Tensor:
        """Unscale, then clip the gradients of the whole model to `max_norm`; returns the norm before clipping."""
        self.precision.unscale(opt)
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)

    def clip_grad_value(self, model: nn.Module, opt: torch.optim.Optimizer, value: float) -> None:
        """Unscale, then clamp every gradient element to [-value, value]."""
        self.precision.unscale(opt)
        torch.nn.utils.clip_grad_value_(model.parameters(), value)

    # ------------------------------------------------------------------ the data-parallel group
    @property
    def is_main(self) -> bool:
        """True on the process that writes files and prints (rank 0 of the data-parallel group)."""
        return self.dp_rank == 0

    @property
    def dp_rank(self) -> int:
        """This process's rank in the data-parallel group."""
        return env.rank()

    @property
    def dp_size(self) -> int:
        """Processes in the data-parallel group (each sees different data)."""
        return env.world_size()

    def barrier(self) -> None:
        """Wait until every process of the group gets here."""
        ops.wait_for_everyone()

    def broadcast(self, obj: T, src: int = 0) -> T:
        """Process `src`'s `obj` on every process."""
        return ops.broadcast(obj, src)

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of `t` over the data-parallel group."""
        return ops.reduce(t, "sum")

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every process's `t` concatenated on dim 0, in rank order."""
        return ops.gather(t)

    # ------------------------------------------------------------------ state
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full (unsharded) state dict of the user's module; every rank must call it (a collective for sharded engines)."""
        return self.unwrap(model).state_dict()

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load a full state dict into the (possibly wrapped or sharded) model; every rank calls it. `strict=False`:
        `state` may hold only some of the model's names (the others keep their values)."""
        self.unwrap(model).load_state_dict(state, strict=strict)

    def state_template(self, model: nn.Module) -> nn.Module:
        """The module whose state dict `model_state_dict`'s full weights match (what `learn.load` checks a file
        against): the user's module; an engine holding only part of it (a pipeline stage) gives the whole model."""
        return self.unwrap(model)

    def optimizer_state_dict(self, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
        """Full optimizer state, as `torch.optim.Optimizer.state_dict` of the unwrapped model would give."""
        return opt.state_dict()

    def load_optimizer_state_dict(self, model: nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
        opt.load_state_dict(state)

    def plain_copy(self, model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
        """A plain module of the user's architecture on the CPU holding `state` (full weights from `model_state_dict`),
        its tied weights tied: what an export changes (a peft adapter merged in) without touching the trained model.

        >>> merged = strategy.plain_copy(model, strategy.model_state_dict(model)).merge_and_unload()
        """
        template = self._skeleton if self._skeleton is not None else self.unwrap(model)
        plain = rebuild(meta_copy(template), "cpu")
        plain.load_state_dict(state)
        return plain

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Unsharded weights on the CPU, for export (`save_model`); meaningful on the main process."""
        return {k: v.detach().cpu() for k, v in self.model_state_dict(model).items()}

    def device_rng_state(self) -> dict[str, Any]:
        """The random state of this engine's device where torch's CPU/CUDA states do not hold it (XLA's
        generator); saved with every checkpoint's RNG states. None here."""
        return {}

    def set_device_rng_state(self, state: dict[str, Any]) -> None:
        """Restore what `device_rng_state` returned."""

    def save_checkpoint(self, directory: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        """Write model and optimizer into `directory` in this engine's format (every rank calls it).

        The base format: `model.safetensors` and `optimizer.pt`, full state, written by the main process (the
        optimizer's by another process on its machine, when every process holds the full state: `file_writers`).
        """
        write = self.checkpoint_writer(directory, model, opt)
        if write is not None:
            write()

    def prepare_checkpoints(self) -> None:
        """Make, once, what this engine's saves need, so that no save point pays for it (every rank calls it before
        a fit that saves): here, which ranks write the base format's files (`_file_writers`, a gather).

        >>> learn.strategy.prepare_checkpoints()  # the Checkpoint callback's before_fit
        """
        self._file_writers()

    def checkpoint_writer(self, directory: Path, model: nn.Module, opt: torch.optim.Optimizer,
                          copy: bool = False, staging: Staging | None = None) -> Callable[[], None] | None:
        """Take the state `save_checkpoint` writes now (every rank: the collectives of a sharded engine happen
        here) and return what writes it: callable from any thread, with no collective on the training's group.

        `copy`: the state is copied to host memory first, so training may go on while it is written;
        otherwise the writer streams from the model's own memory (one tensor at a time), the loop waiting.
        `staging` (with `copy`): the tensors in `staging.late` (parameters, optimizer state) are copied by the
        writer, first, and `staging.done()` said after; the rest now. The caller waits (`staging.wait()`)
        before anything writes them. An engine whose own `save_checkpoint` has no such split (DeepSpeed's
        engine saves with collectives) writes at once and returns None (`staging.done()` said).

        >>> write = strategy.checkpoint_writer(staged, model, opt, copy=True); threading.Thread(target=write).start()
        """
        if type(self).save_checkpoint is not Strategy.save_checkpoint:
            self.save_checkpoint(directory, model, opt)
            if staging is not None:
                staging.done()
            return None
        (model_writer, opt_writer), gathers = self._file_writers(), not self.state_dicts_are_own()

        def take(state_dict: Callable[[], Any], writer: int) -> Any:  # gathering ones are collectives: every rank
            state = state_dict() if gathers or self.dp_rank == writer else None
            return state if self.dp_rank == writer else None
        model_state = take(lambda: self.model_state_dict(model), model_writer)
        opt_state = take(lambda: self.optimizer_state_dict(model, opt), opt_writer)
        if model_state is None and opt_state is None:
            if staging is not None:
                staging.done()
            return lambda: None
        if copy:
            model_state, opt_state = host_copy((model_state, opt_state),
                                               only=None if staging is None else lambda t: not staging.is_late(t))
        if staging is None:
            staging = Staging()
            staging.done()

        def write() -> None:
            nonlocal model_state, opt_state
            if not staging.finished:
                try:
                    model_state, opt_state = host_copy((model_state, opt_state), only=staging.is_late,
                                                       into=staging.buffers)
                    if staging.buffers is not None:
                        staging.buffers.settle()
                finally:
                    staging.done()
            write_state_files(model_state, opt_state, directory)
        return write

    def _file_writers(self) -> tuple[int, int]:
        """The ranks that write the base format's two files (`state_files.file_writers`); asked of the processes at
        the first save (every rank calls it): the main process writes both where the state dicts are gathered."""
        if self._writers is None:
            parallel = self.state_dicts_are_own() and self.dp_size > 1
            self._writers = file_writers(ops.gather_object(socket.gethostname())) if parallel else (0, 0)
        return self._writers

    def state_dicts_are_own(self) -> bool:
        """Whether every rank holds the full state itself (the base state dicts: nothing to gather)."""
        return all(getattr(type(self), m) is getattr(Strategy, m) for m in ("model_state_dict", "optimizer_state_dict"))

    def reserve_checkpoint_memory(self, buffers: HostBuffers, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        """Allocate ahead, in `buffers`, the host memory an asynchronous save of this rank copies into (its page
        faults cost more than the copy): where `checkpoint_writer` writes the model's or optimizer's own memory
        (one process; under DDP the ranks that write the files, each what it writes); nothing elsewhere."""
        if self.state_dicts_are_own() and all(getattr(type(self), m) is getattr(Strategy, m)
                                               for m in ("checkpoint_writer", "save_checkpoint")):
            model_writer, opt_writer = self._file_writers()
            buffers.reserve(model if self.dp_rank == model_writer else None, opt if self.dp_rank == opt_writer else None)

    def keep_training_state(self, model: nn.Module, opt: torch.optim.Optimizer,
                            directory: Path) -> Callable[[], None]:
        """The model's and optimizer's state kept now, put back by the returned function (`lr_find`'s sweep): a copy
        in memory; an engine that cannot load a copy back keeps it in `directory` (`kept_on_disk`).

        >>> restore = strategy.keep_training_state(model, opt, Path("models/_lr_find")); ...; restore()
        """
        return kept_in_memory(model, opt)

    def load_checkpoint(self, directory: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        """Read what `save_checkpoint` wrote (any world size); both files read and checked before anything is loaded.
        An engine that loads the optimizer state as torch does (by position, `load_optimizer_state_dict` not its
        own) reads it from the mapped file straight into the state tensors the optimizer holds, when it holds some
        (a fresh optimizer has none: a plain read is faster than copying out of the mapping)."""
        in_place = (type(self).load_optimizer_state_dict is Strategy.load_optimizer_state_dict
                    and any(opt.state.values()))
        model_state = load_model_file(directory, self.unwrap(model))
        opt_state = load_optimizer_file(directory, mapped=in_place)
        self.load_model_state_dict(model, model_state)
        if in_place:
            load_optimizer_in_place(opt, opt_state, str(Path(directory) / OPTIMIZER_FILE))
        else:
            self.load_optimizer_state_dict(model, opt, opt_state)


def named_by_position(state: dict, whole: torch.optim.Optimizer, skeleton: nn.Module) -> dict:
    """One process's `opt.state_dict()` (parameters by position) keyed by the model's names; `whole` is the optimizer
    that process had (the same groups over `skeleton`, the whole model)."""
    shape = [len(g["params"]) for g in whole.param_groups]
    saved = [len(g["params"]) for g in state["param_groups"]]
    if saved != shape:
        raise ValueError(f"the optimizer state has parameter groups of {saved} parameters, this model's optimizer "
                         f"{shape}: it was saved for another model or optimizer setup; load with with_opt=False")
    names = {id(p): n for n, p in skeleton.named_parameters()}
    name = dict(zip((i for g in state["param_groups"] for i in g["params"]),
                    (names[id(p)] for g in whole.param_groups for p in g["params"])))
    return {"state": {name[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [name[i] for i in g["params"]]} for g in state["param_groups"]]}


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` on the meta device: the skeleton a sharding engine rebuilds the plain module from.

    Parameters and buffers take no memory; non-persistent buffers (a rotary embedding's `inv_freq`), which no
    state dict carries, keep their values (small), so the rebuilt module computes what the original did.

    >>> skeleton = meta_copy(model); ...; plain = rebuild(skeleton, "cpu"); plain.load_state_dict(full_weights)
    """
    def empty(t: torch.Tensor) -> torch.Tensor:  # a DeepSpeed ZeRO-3 partition knows its whole shape (ds_shape)
        return torch.empty(getattr(t, "ds_shape", t.shape), dtype=t.dtype, device="meta")

    kept = {id(t) for _, t in non_persistent_buffers(model)}
    memo = {id(t): nn.Parameter(empty(t), t.requires_grad) if isinstance(t, nn.Parameter) else
            t.detach().clone() if id(t) in kept else empty(t)
            for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def non_persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every buffer no state dict carries (`register_buffer(..., persistent=False)`)."""
    return [(f"{owner}.{name}" if owner else name, module._buffers[name]) for owner, module in model.named_modules()
            for name in module._non_persistent_buffers_set if module._buffers.get(name) is not None]


def rebuild(skeleton: nn.Module, device: torch.device | str) -> nn.Module:
    """`skeleton` (from `meta_copy`) materialised on `device`: its weights uninitialised (load a state dict next),
    its tied weights still tied, its non-persistent buffers as `meta_copy` kept them."""
    aliases = tied_names(skeleton)  # both read first: to_empty replaces every tensor in place
    buffers = [(name, t) for name, t in non_persistent_buffers(skeleton) if not t.is_meta]
    plain = retie(skeleton.to_empty(device=device), aliases)
    set_buffers(plain, [(name, value.to(device)) for name, value in buffers])
    return plain


def set_buffers(model: nn.Module, buffers: list[tuple[str, torch.Tensor]]) -> None:
    """Register each (name, tensor) of `buffers` in place of the buffer of that name (persistence unchanged)."""
    for name, value in buffers:
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._buffers[attr] = value


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


class SingleDevice(Strategy):
    """Train on one device: CPU, one GPU or MPS (the default strategy)."""


# ---------------------------------------------------------------------- abilities
class OwnsPrecision:
    """An engine that fixes its number format when it wraps the model (FSDP's policy, DeepSpeed's config).

    The MixedPrecision callback passes the precision to `setup`; changing it afterwards is refused.
    """

    def set_precision(self, precision: FullPrecision) -> None:
        if getattr(self, "_precision_fixed", False) and precision.name != self.precision.name:
            raise ValueError(f"{self.name} fixed its precision to {self.precision.name!r} when it wrapped the model; "
                             f"set the precision before distrib_ctx (e.g. learn.to_bf16() first, or "
                             f"`cadence launch --mixed_precision {precision.name}`)")
        if not getattr(self, "_precision_fixed", False):
            self.precision = precision


class OwnsAccumulation:
    """An engine that accumulates gradients itself (DeepSpeed): GradAccum configures it instead of scaling."""

    def configure_accumulation(self, steps: int) -> None:
        raise NotImplementedError


class OwnsClipping:
    """An engine that clips gradients itself (DeepSpeed): GradClip configures it instead of clipping."""

    def configure_clipping(self, max_norm: float, norm_type: float = 2.0) -> None:
        raise NotImplementedError

    def last_grad_norm(self) -> float | None:
        """The global gradient norm before clipping at the last update (None before the first)."""
        raise NotImplementedError

    def clipping_once(self, max_norm: float) -> ContextManager[float]:
        """The update inside clipped at `max_norm` too, the engine's own clipping back afterwards (the Accelerator's
        `clip_grad_norm_` clips its step only); yields the engine's own max norm (0.0: none)."""
        raise NotImplementedError


class OwnsStep:
    """An engine that runs the forward pass, the loss and the backward itself (a pipeline schedule).

    The Learner asks it for the batch's `(pred, loss)` instead of calling the model and the loss; its `backward`
    then has nothing left to do. Both come back the same on every rank (the Recorder and metrics read them).
    """

    def forward_backward(self, model: nn.Module, xb: Any, yb: tuple, loss_func: Callable | None, training: bool
                         ) -> tuple[Any, torch.Tensor | None]:
        raise NotImplementedError


class ConfiguredAtFit:
    """An engine whose config needs facts of the fit (DeepSpeed's "auto" batch sizes and scheduler steps).

    The distributed bridge calls `configure_fit` before the first training batch, once the callbacks'
    `before_fit` (GradAccum, GradClip) have configured the engine.
    """

    def configure_fit(self, micro_batch_size: int | None, total_steps: int) -> None:
        """`micro_batch_size`: the training loader's batch size per process (None when the loader has none)."""
        raise NotImplementedError

