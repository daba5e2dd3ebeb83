"""Pipeline parallelism: the model cut into stages over `pp_size` processes, run by a `torch.distributed.pipelining`
schedule (GPipe, 1F1B, Interleaved1F1B, LoopedBFS, ZBVZeroBubble, DualPipeV, ...), inside FSDP2 data parallelism.

>>> with learn.distrib_ctx(strategy="model_parallel", pp_size=2, pp_schedule="1F1B", pp_microbatches=4,
...                        pp_split_points=["3"]):     # an nn.Sequential: stage 1 starts at its child "3"
...     learn.fit(3)

The processes form a (pp, dp, tp) mesh, tp innermost; with tp_size > 1 `parallelize(stage_module, tp_mesh)` slices
each stage's layers. The pipeline engine owns the step (the OwnsStep ability): the forward pass, the loss and the
backward of every micro-batch run inside the schedule, so the Learner asks it for `(pred, loss)` instead of calling
the model. What the rest of cadence sees:
- the batch's loss and predictions (which exist only on the rank holding the last stage, rank 0 under V-shaped
  schedules) are broadcast over the pp group, so every rank's Recorder, metrics, trackers and EarlyStopping see them;
- a batch that the micro-batches do not divide is padded and the padding left out of loss, gradients and `pred`;
  the loss of each micro-batch is weighted by its share of the batch, so gradients equal the whole batch's
  (the schedule's own scaling is off: `schedule.eval()` would divide pending gradients by the micro-batches);
- gradient clipping uses the norm over every stage (each stage's norm per mesh, summed over pp);
- weights tied across stages are refused (ties within a stage are kept);
- checkpoints (sharded) and `learn.save` (full weights and optimizer state) are keyed by the model's own parameter
  names, whatever a `split` function calls them, so they load in one process and on any other mesh.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..tied_weights import tied_names
from . import env
from .fsdp import FSDP
from .model_parallel import ModelParallel, _launcher_sizes, _retie_sliced
from .pipeline_outputs import LastStageOutputs
from .pipeline_state import merged_optimizer_state, merged_weights, renamed_checkpoint, renamed_optimizer_state
from .precision import FullPrecision
from .strategy import MakeOpt, OwnsStep, meta_copy, named_by_position, rebuild

__all__ = ["Pipeline"]

Split = Callable[[nn.Module, int, int], nn.Module]
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")  # rank r holds stages r and 2 * pp - 1 - r


class Pipeline(OwnsStep, ModelParallel):
    """`strategy="model_parallel"` with `pp_size` > 1: stages over pp, TP inside them over `tp_size`, FSDP2 over dp.

    Args:
        pp_size: processes per pipeline (a divisor of the world size); `--parallelism_config_pp_size N` sets it.
        pp_schedule: a `torch.distributed.pipelining` schedule name: "GPipe", "1F1B" (one stage per rank);
            "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV" (several).
        pp_microbatches: micro-batches per batch (default `pp_size`).
        pp_split_points: for an `nn.Sequential`, the names of the children that begin stages 1, 2, ...
        split: else `split(model, stage, num_stages)` -> the module of stage `stage` (its forward takes the
            previous stage's output); `pp_stages` says how many stages there are (default one per rank, two
            for V-shaped schedules).
    """

    def __init__(self, device: torch.device | str | None = None, pp_size: int | None = None,
                 pp_schedule: str | None = None, pp_microbatches: int | None = None,
                 pp_split_points: Sequence[str] | None = None, split: Split | None = None, pp_stages: int | None = None,
                 tp_size: int | None = None, **options: Any):
        launched = _launcher_sizes()
        super().__init__(device, tp_size=launched.get("tp_size", 1) if tp_size is None else tp_size, **options)
        from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

        self.pp_size = int(launched.get("pp_size", 1) if pp_size is None else pp_size)
        name = str(pp_schedule or launched.get("pp_schedule") or "1F1B")
        try:
            self.schedule_class = get_schedule_class(name)
        except ValueError as e:
            raise ValueError(f"pp_schedule={name!r}: {e}") from None
        self.v_shaped = self.schedule_class.__name__.removeprefix("Schedule") in V_SHAPED
        multi = issubclass(self.schedule_class, PipelineScheduleMulti)
        self.num_stages = int(pp_stages or (len(pp_split_points) + 1 if pp_split_points else
                                            self.pp_size * (2 if multi else 1)))
        per_rank = self.num_stages // self.pp_size
        if self.num_stages % self.pp_size or (per_rank > 1) != multi or (self.v_shaped and per_rank != 2):
            need = "2 per rank" if self.v_shaped else "several per rank" if multi else "one per rank"
            raise ValueError(f"pp_schedule={name!r} runs {need}, but {self.num_stages} stages on pp_size={self.pp_size}: "
                             f"give {'2 x' if self.v_shaped else 'k x' if multi else ''} {self.pp_size} stages "
                             f"(pp_split_points has one name fewer than the stages)")
        chosen = next((m for m in (pp_microbatches, launched.get("pp_microbatches")) if m is not None), self.pp_size)
        if isinstance(chosen, bool) or not isinstance(chosen, int) or chosen < 1:
            raise ValueError(f"pp_microbatches={chosen!r}: a whole number >= 1 (micro-batches per batch)")
        self.microbatches = chosen
        if pp_split_points is not None and split is not None:
            raise ValueError("give pp_split_points or split, not both")
        self.split_points, self.split = list(pp_split_points or []), split
        self._schedules: dict[tuple, Any] = {}
        self._outputs = LastStageOutputs()
        self._stages: list[tuple[int, nn.Module]] = []
        self._names: dict[str, str] = {}
        self._pp_process_group = None
        self._warned_padding = False

    # ------------------------------------------------------------------ the mesh
    def _mesh_shape_for(self, world: int) -> tuple[int, ...]:
        if world == 1:  # one process trains the plain model
            return (1, *ModelParallel._mesh_shape_for(self, 1))
        model = self.pp_size * self.tp_size
        if world % model:
            raise ValueError(f"pp_size={self.pp_size} x tp_size={self.tp_size} = {model} does not divide the {world} "
                             f"processes: pp x dp x tp = world, so pp x tp must be one of "
                             f"{[d for d in range(1, world + 1) if world % d == 0]}")
        if self.dp_shard_size is not None and self.dp_shard_size * model * self.dp_replicate_size != world:
            raise ValueError(f"pp_size={self.pp_size} x dp_shard_size={self.dp_shard_size} x tp_size={self.tp_size} = "
                             f"{self.dp_shard_size * model}, not the {world} processes: make dp_shard_size "
                             f"{world // model // self.dp_replicate_size} or leave it out")
        return (self.pp_size, *ModelParallel._mesh_shape_for(self, world // self.pp_size))

    def _mesh_names(self) -> tuple[str, ...]:
        return ("pp", *ModelParallel._mesh_names(self))

    def _pp_group(self):
        if self._pp_process_group is None:  # asked every step: a mesh lookup slices the mesh each time
            self._mesh()
            self._pp_process_group = self.device_mesh.get_group("pp")
        return self._pp_process_group

    def _pp_rank(self) -> int:
        return env.rank() // (env.world_size() // self.pp_size)  # ranks laid out (pp, dp, tp)

    # ------------------------------------------------------------------ cutting the model
    def _cut(self, model: nn.Module) -> list[nn.Module]:
        """Every stage's module (views of `model`'s layers); ties across stages refused."""
        if self.split is not None:
            stages = [self.split(model, s, self.num_stages) for s in range(self.num_stages)]
        elif self.split_points:
            stages = _cut_sequential(model, self.split_points)
        else:
            raise ValueError("pipeline parallelism needs where to cut the model: pp_split_points=[names of the "
                             "nn.Sequential children that begin stages 1, 2, ...] or split=fn(model, stage, num_stages)")
        owner = {}
        for s, stage in enumerate(stages):
            for name, p in stage.named_parameters(remove_duplicate=False):
                first = owner.setdefault(id(p), (s, name))
                if first[0] != s:
                    raise ValueError(f"parameter {first[1]!r} of stage {first[0]} is tied to {name!r} of stage {s}: "
                                     f"weights tied across pipeline stages are not supported (their gradients would "
                                     f"need a sum over stages); cut the model so both uses fall in one stage, or untie them")
        return stages

    def _my_stages(self) -> list[int]:
        r = self._pp_rank()
        if self.v_shaped:
            return [r, 2 * self.pp_size - 1 - r]
        return list(range(r, self.num_stages, self.pp_size))

    def setup(self, model: nn.Module, make_opt: MakeOpt, precision: FullPrecision | None = None
              ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Cut the model, keep this rank's stages, shard each over dp with FSDP2, then build the optimizer."""
        if precision is not None and precision.name == "fp16":
            raise ValueError("fp16 under pipeline parallelism: the schedule runs the backward, so cadence cannot scale "
                             "the loss; use bf16 (learn.to_bf16())")
        if self.tp_size > 1 and self.parallelize is None:
            raise ValueError(f"tp_size={self.tp_size} with pp_size={self.pp_size}: pass parallelize=fn(stage_module, "
                             f"tp_mesh), which slices each pipeline stage's layers (only those the stage holds)")
        stages = self._cut(model)  # refusals first, on one process too
        if not env.is_initialized():
            return FSDP.setup(self, model, make_opt, precision)
        from torch.distributed.fsdp import fully_shard

        skeleton = meta_copy(model)
        model = model.to(self.device)
        self._mesh()
        self._stages = [(s, stages[s]) for s in self._my_stages()]
        if precision is not None and precision.name != "no":  # fixed from here on (`_precision_fixed`)
            for _, stage in self._stages:
                stage.register_forward_hook(_full_precision_between_stages)
        held = self._holder([m for _, m in self._stages])
        if callable(getattr(model, "generate", None)) and not hasattr(held, "generate"):
            held.generate = _generate_refused  # not "'Stage' object has no attribute 'generate'"
        self._names = _model_names(held, model)  # before slicing and sharding replace the tensors
        if self.tp_size > 1:  # each stage sliced over tp, then sharded over dp
            ties = tied_names(model)
            for _, stage in self._stages:
                self.parallelize(stage, self.device_mesh["tp"])
                _retie_sliced(stage, {a: b for a, b in ties.items() if _holds(stage, a) and _holds(stage, b)})
        if precision is not None:
            self.set_precision(precision)
        self._precision_fixed = True
        if self.dp_size > 1:
            from .fsdp import SHARDING_STRATEGIES
            from .precision import fsdp_mixed_precision

            kwargs = dict(mesh=self._mesh(), reshard_after_forward=SHARDING_STRATEGIES[self.sharding],
                          mp_policy=fsdp_mixed_precision(self.precision))
            for _, stage in self._stages:
                for group in self._groups(stage):
                    fully_shard(group, **kwargs)
                fully_shard(stage, **kwargs)
        self._skeleton, self._make_opt = skeleton, make_opt
        return held, make_opt(held)

    def _holder(self, modules: list[nn.Module]) -> nn.Module:
        """One module holding this rank's stages under the model's own parameter names where it can."""
        if len(modules) == 1:
            return modules[0]
        if self.split is None:  # children of one nn.Sequential: their names are the model's
            return nn.Sequential(OrderedDict((n, c) for m in modules for n, c in m.named_children()))
        return nn.ModuleList(modules)

    def release(self, model: nn.Module, opt: torch.optim.Optimizer, make_opt: MakeOpt
                ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The whole plain model on every rank, with the trained weights; a fresh optimizer with the same settings."""
        if not self._stages:
            return model, opt
        weights = self._gathered_state(model, everywhere=True)
        plain = rebuild(self._skeleton, self.device)
        plain.load_state_dict(weights)
        new_opt = make_opt(plain)
        for new, old in zip(new_opt.param_groups, opt.param_groups):
            new.update({k: v for k, v in old.items() if k != "params"})
        return plain, new_opt

    # ------------------------------------------------------------------ one step
    def forward_backward(self, model: nn.Module, xb: Any, yb: tuple, loss_func: Callable | None, training: bool
                         ) -> tuple[Any, torch.Tensor | None]:
        """Run the batch through the schedule: forward, loss (and backward when `training`) of every micro-batch.

        Returns the batch's predictions and loss (detached), the same on every rank of the pipeline.
        """
        if loss_func is None:
            raise ValueError("pipeline parallelism needs a loss_func (the schedule computes the loss on the last stage); "
                             "a model computing its own loss cannot be cut into stages")
        args, kwargs = (xb, {}) if isinstance(xb, tuple) else ((), dict(xb))
        if not self._stages:  # one process: the plain model
            pred = model(*args, **kwargs)
            loss = loss_func(pred, *yb) if yb else None
            if training:
                self.precision.backward(loss)
            return pred, None if loss is None else loss.detach()
        n = _batch_size(args, kwargs)
        if training and not yb:
            raise ValueError("the training batch has no targets for loss_func: yield (inputs, targets) batches")
        per = math.ceil(n / self.microbatches)
        padded = per * self.microbatches
        if n < self.microbatches and not self._warned_padding:
            self._warned_padding = True
            warnings.warn(f"pp_microbatches={self.microbatches} with a batch of {n} rows: {padded - n} of the "
                          f"{self.microbatches} micro-batches are padding, computed and thrown away; use at most "
                          f"{n} micro-batches (or a larger batch)", stacklevel=2)
        if padded > n:  # padding repeats the last sample; the loss leaves its rows out
            take = torch.arange(padded, device=self.device).clamp(max=n - 1)
            args = tuple(_rows(a, take) for a in args)
            kwargs = {k: _rows(v, take) for k, v in kwargs.items()}

        last = self._holds_last_stage()
        if padded == n and len(yb) == 1 and isinstance(yb[0], torch.Tensor) and yb[0].shape[:1] == (n,):
            # the schedule splits the one target tensor as it splits the inputs
            share = 1 / self.microbatches

            def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                return loss_func(out, y) * share
            target = yb[0] if last else None
        else:  # the target is the row index into the batch: any number of targets, padding rows left out
            def loss_fn(out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
                start = int(rows[0])  # a micro-batch is the batch's rows [start, start + per)
                real = max(0, min(n, start + len(rows)) - start)
                if not real:
                    return out.sum() * 0.0
                return loss_func(out[:real], *(y[start:start + real] for y in yb)) * (real / n)
            target = torch.arange(padded, device=self.device) if yb and last else None

        schedule = self._schedule(per, training, loss_fn)
        losses: list[torch.Tensor] = []
        kind = (training, bool(yb), *(tuple(t.shape) for t in (*args, *kwargs.values()) if torch.is_tensor(t)))
        group = self._pp_group()
        src = dist.get_global_rank(group, self._last_rank())
        self._outputs.expect(kind, src, group, self.device)  # the outputs' receive runs alongside the step
        if training:
            out = schedule.step(*args, target=target, losses=losses, **kwargs)
        else:
            out = schedule.eval(*args, target=target, losses=losses, **kwargs)
        loss = torch.stack([l.detach() for l in losses]).sum().float() if last and losses else None
        return self._outputs.share(out[:n].detach() if last else None, loss, kind, src, group, self.device)

    def _schedule(self, per: int, training: bool, loss_fn: Callable):
        """A schedule (and its stages) for micro-batches of `per` samples: stages infer their shapes once."""
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import PipelineScheduleMulti

        key = (per, training)
        if key not in self._schedules:
            group = self._pp_group()
            stages = [PipelineStage(m, s, self.num_stages, self.device, group=group) for s, m in self._stages]
            multi = issubclass(self.schedule_class, PipelineScheduleMulti)
            forward = _Loss()
            schedule = self.schedule_class(stages if multi else stages[0], self.microbatches, loss_fn=forward,
                                           scale_grads=False)
            if self.v_shaped and not training:
                self._forward_only(schedule)
            self._schedules[key] = (schedule, forward)
        schedule, forward = self._schedules[key]
        forward.fn = loss_fn  # this batch's targets and size
        return schedule

    def _forward_only(self, schedule) -> None:
        """Give a V-shaped schedule a forward-only order for evaluation: torch's ZBV and DualPipeV orders run their
        split backward even in `eval()` (AssertionError "can't steal_bwd_input", torch 2.13). Each rank runs its
        stages in order, every micro-batch through the first before the second (V: r, then 2 * pp - 1 - r)."""
        from torch.distributed.pipelining.schedules import (_Action, _add_send_recv, _add_unshard_reshard,
                                                            _ComputationType)

        order = {r: [_Action(s, _ComputationType.FORWARD, mb) for s in (r, 2 * self.pp_size - 1 - r)
                     for mb in range(self.microbatches)] for r in range(self.pp_size)}
        # lowered as torch's `_prepare_schedule_with_comms` does, less its check that every stage runs a backward
        schedule.pipeline_order = order
        schedule.pipeline_order_with_comms = _add_send_recv(
            {r: _add_unshard_reshard(actions) for r, actions in order.items()},
            stage_to_rank=lambda s: schedule.stage_index_to_group_rank[s], num_stages=self.num_stages)

    def _holds_last_stage(self) -> bool:
        return any(s == self.num_stages - 1 for s, _ in self._stages)

    def _last_rank(self) -> int:
        """The pp-group rank of the process holding the last stage (rank 0 under V-shaped schedules)."""
        return 0 if self.v_shaped else self.pp_size - 1

    def backward(self, loss: torch.Tensor | None, **kwargs: Any) -> None:
        """Nothing: the schedule ran the backward inside `forward_backward`."""

    def set_gradient_sync(self, model: nn.Module, enabled: bool) -> None:
        if not enabled and self._stages:
            raise ValueError("GradAccum under pipeline parallelism: the schedule already accumulates over its "
                             "micro-batches; raise pp_microbatches (and the batch size) instead of accumulating")

    def clip_grad_norm(self, model: nn.Module, opt: torch.optim.Optimizer, max_norm: float,
                       norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm over every stage: this stage's norm per mesh, combined, then summed over pp."""
        return self._clip_by_total(model, opt, max_norm, norm_type, self._combine_stages)

    def _combine_stages(self, norm: torch.Tensor, norm_type: float) -> torch.Tensor:
        if not self._stages:
            return norm
        group = self._pp_group()
        if math.isinf(norm_type):
            norm = norm.clone()
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
            return norm
        power = norm.double() ** norm_type
        dist.all_reduce(power, group=group)
        return (power ** (1.0 / norm_type)).to(norm.dtype)

    # ------------------------------------------------------------------ state
    def _gathered_state(self, model: nn.Module, everywhere: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's weights on the CPU: every stage's, merged over pp (on rank 0, or on every rank)."""
        from torch.distributed.tensor import DTensor

        local = {self._names.get(k, k): (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
                 for k, v in model.state_dict().items()}  # full_tensor: a collective over dp and tp
        return merged_weights(local, self._pp_group(), everywhere)  # every pp group: one per dp rank

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full weights of every stage on rank 0 (others get {}); every rank must call it."""
        if not self._stages:
            return ModelParallel.model_state_dict(self, model)
        return self._gathered_state(model)

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load full weights: each stage takes its own names."""
        if not self._stages:
            return ModelParallel.load_model_state_dict(self, model, state, strict)
        mine = {self._names.get(k, k): k for k in model.state_dict()}
        ModelParallel.load_model_state_dict(self, model, {mine[k]: v for k, v in state.items() if k in mine}, strict)

    def state_template(self, model: nn.Module) -> nn.Module:
        """The whole model's skeleton: full weights hold every stage's, under the model's names."""
        return self._skeleton if self._stages else ModelParallel.state_template(self, model)

    def optimizer_state_dict(self, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
        """The whole model's optimizer state on rank 0 (others get {}), keyed by the model's parameter names in its
        order, as FSDP's full state: it loads in one process (`opt.load_state_dict`), under FSDP, on any pipeline."""
        if not self._stages:
            return ModelParallel.optimizer_state_dict(self, model, opt)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))  # over dp and tp
        parts = [None] * self.pp_size
        dist.all_gather_object(parts, renamed_optimizer_state(full, self._names), group=self._pp_group())
        return merged_optimizer_state(parts, self._skeleton) if env.rank() == 0 else {}

    def load_optimizer_state_dict(self, model: nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
        """Load a whole model's optimizer state (keyed by names, or by position as one process's `opt.state_dict()`):
        each stage takes its own parameters' state."""
        if not self._stages:
            return ModelParallel.load_optimizer_state_dict(self, model, opt, state)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if all(isinstance(p, int) for g in state["param_groups"] for p in g["params"]):
            state = named_by_position(state, self._make_opt(self._skeleton), self._skeleton)
        held = renamed_optimizer_state(state, {v: k for k, v in self._names.items()})  # model names -> stage names
        set_optimizer_state_dict(model, opt, held, options=StateDictOptions(full_state_dict=True))

    def _checkpoint_state(self, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
        """ModelParallel's format keyed by the model's own parameter names (a `split` function's stages may name
        them their own way): the checkpoint resumes on any pp x dp x tp mesh, or in one process."""
        return renamed_checkpoint(super()._checkpoint_state(model, opt), self._names)

    def _set_checkpoint_state(self, model: nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
        super()._set_checkpoint_state(model, opt, renamed_checkpoint(state, {v: k for k, v in self._names.items()}))


class _Loss:
    """The schedule's loss function, re-pointed at each batch's (a schedule keeps the one it was built with)."""

    fn: Callable | None = None

    def __call__(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.fn(out, target)


def _cut_sequential(model: nn.Module, points: list[str]) -> list[nn.Module]:
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"pp_split_points cut an nn.Sequential, not {type(model).__name__}: pass "
                         f"split=fn(model, stage, num_stages) returning each stage's module instead")
    names = [n for n, _ in model.named_children()]
    missing = [p for p in points if p not in names]
    if missing:
        raise ValueError(f"pp_split_points {missing} are not children of the model; its children are {names}")
    starts = [0, *(names.index(p) for p in points), len(names)]
    if starts != sorted(set(starts)):
        raise ValueError(f"pp_split_points {points} must be distinct children in the model's order ({names})")
    return [nn.Sequential(OrderedDict((n, model.get_submodule(n)) for n in names[a:b]))
            for a, b in zip(starts, starts[1:])]


def _model_names(held: nn.Module, model: nn.Module) -> dict[str, str]:
    """Each name of `held`'s state that differs from the model's name of the same tensor (a `split` function's
    stage modules may name the layers they hold their own way); tied names matched in order."""
    def names(m: nn.Module) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for name, t in (*m.named_parameters(remove_duplicate=False), *m.named_buffers(remove_duplicate=False)):
            out.setdefault(id(t), []).append(name)
        return out

    in_model = names(model)
    return {mine: theirs for key, ours in names(held).items() for mine, theirs in zip(ours, in_model.get(key, ()))
            if mine != theirs}


def _generate_refused(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("learn.model.generate(...) under pipeline parallelism: inside distrib_ctx each rank holds only "
                       "its pipeline stages, and generation is not a pipeline operation; call learn.model.generate(...) "
                       "after the distrib_ctx block, where learn.model is the whole model again on every rank (or "
                       "learn.save_model(dir) inside it and from_pretrained(dir))")


def _full_precision_between_stages(module: nn.Module, args: Any, out: Any) -> Any:
    """Under autocast (bf16), a stage's output is sent as float32: its receiver allocated its buffers from the shapes
    and dtypes torch inferred outside autocast (gloo: "Received data size doesn't match expected size")."""
    if isinstance(out, torch.Tensor) and out.is_floating_point() and torch.is_autocast_enabled(out.device.type):
        return out.float()
    return out


def _holds(module: nn.Module, name: str) -> bool:
    try:
        module.get_parameter(name)
        return True
    except AttributeError:
        return False


def _batch_size(args: tuple, kwargs: Mapping) -> int:
    first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
    if first is None:
        raise ValueError("pipeline parallelism splits the batch into micro-batches along dim 0 of its tensors; "
                         "the batch has no tensor input")
    return first.shape[0]


def _rows(t: Any, index: torch.Tensor) -> Any:
    return t[index] if isinstance(t, torch.Tensor) else t
