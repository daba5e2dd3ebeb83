"""DeepSpeed's own checkpoint files inside a cadence checkpoint directory, resumable on another number of processes.

`<checkpoint>/deepspeed/` holds what `engine.save_checkpoint` writes (every rank its partition) and
`cadence.json` (world size, ZeRO stage). On the world size that wrote it, the engine loads it as it is. A
ZeRO checkpoint holds the optimizer state (ZeRO-3: the weights too) cut into one partition per process; on
another world size it is converted to DeepSpeed's universal format (`deepspeed.checkpoint.ds_to_universal`:
one file per parameter and state) in a hidden `.<checkpoint>.universal.tmp/` beside it, which the engine
loads through its `load_universal` path and which is removed afterwards. The checkpoint is never changed.

The engine's files go through its checkpoint engine's `save(state, path)`; for DeepSpeed's torch engine (the
default) cadence stands in for it during the save (`_Files`): each file `torch.save`d into an open file and
fsync'd, or, for an asynchronous save, its state copied to host memory at the save point (`HostBuffers.snapshot`)
and written by the returned callable in the background. The bytes are the same either way, and `torch.load`
(resume, DeepSpeed's `zero_to_fp32.py`) reads them as it reads the engine's own.

A load reads every file as data (`safe_load`), whatever the engine's checkpoint engine would do: torch's weights_only
unpickler, only DeepSpeed's own classes added. Before a universal conversion every file of the checkpoint is read so
first, since DeepSpeed's converter unpickles them unchecked. A file naming anything else is refused, named.

>>> save(engine, Path("ckpt/step-00000200"), world_size=2, stage=3, is_main=True)
>>> write = save(engine, staged, world_size=2, stage=3, is_main=True, host=HostBuffers()); write()  # any thread
>>> load(engine, Path("ckpt/step-00000200"), world_size=4, stage=3, is_main=rank() == 0, barrier=wait_for_everyone)
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import shutil
from argparse import Namespace
from pathlib import Path
from typing import Any, Callable

import torch

from ..serialization import host_tagged, save_torch, sibling
from .load_in_place import copied_out, fits, in_place_targets, read_into
from .safe_load import check_deepspeed_files, load_deepspeed_file
from .staging import HostBuffers, HostFile, Staging, storage_key

TAG = "deepspeed"  # the engine's checkpoint lives in <checkpoint dir>/deepspeed/
META = "cadence.json"
PERSISTENT = "cadence_zero3_persistent"  # ZeRO-3: the persistent parameters whole, in each rank's model-states file,
PERSISTENT_MAX_BYTES = 64 * 2**20  # when they are small (DeepSpeed's defaults keep only parameters of < 100k elements
# whole: a 70B Llama's norms are ~3 MB); a persistence threshold raised to keep most of the model whole is gathered
UNIVERSAL = ".universal.tmp"  # ends like a killed save, so the Checkpoint callback's clean-up removes a leftover


def save(engine: Any, directory: Path, world_size: int, stage: int, is_main: bool,
         host: HostBuffers | None = None, staging: Staging | None = None) -> Callable[[], None] | None:
    """The engine's files under `directory/deepspeed/`, every rank its partition (every rank calls it: the engine's
    save may make collectives); then `cadence.json`. `host`: the files are copied into its memory now and written
    by the returned callable (any thread); otherwise written now, and None returned. `staging` (with `host`): the
    tensors it says are late are copied by the returned callable, first, then `staging.done()` is said. An engine
    configured with a checkpoint writer of its own (DeepSpeed's fast, decoupled or DataStates engines) always
    writes now."""
    own = engine.checkpoint_engine
    files = _Files(own, host, staging) if _is_torch_engine(own) else None
    engine.checkpoint_engine = files or own
    try:
        if files is not None and _plain(engine):
            _save_files(engine, str(directory))
        else:
            engine.save_checkpoint(str(directory), tag=TAG, save_latest=False)
    finally:
        engine.checkpoint_engine = own
    if is_main:
        (Path(directory) / TAG / META).write_text(json.dumps({"world_size": world_size, "zero_stage": stage}))
    if files is None or host is None:
        return None
    return files.write


def _plain(engine: Any) -> bool:
    """Whether the engine's save and load are its `_save_files` and `_load_files` steps alone: no MoE layers, no state
    offloaded to NVMe, the engine's methods for each step there."""
    return not engine.has_moe_layers and not engine.zero_nvme_offload_optimizer() and all(
        hasattr(engine, m) for m in ("_create_checkpoint_file", "_save_checkpoint", "_create_zero_checkpoint_files",
                                     "_save_zero_checkpoint", "save_zero_checkpoint", "_load_checkpoint",
                                     "_load_zero_checkpoint", "_optimizer_has_ckpt_event_prologue",
                                     "_optimizer_has_ckpt_event_epilogue"))


def _save_files(engine: Any, directory: str) -> None:
    """`engine.save_checkpoint` with its torch checkpoint engine (whose `create` and `commit` only log), less what
    cadence's save does itself: a barrier before (rank 0 made the directory; every rank makes it here) and after
    (cadence commits once every rank says its files are written), and the check that the tag is the same on every
    rank (a constant here): 2 barriers and 2 all-reduces fewer at the save point, each a wait for the slowest rank.
    ZeRO-3's prologue stays (every parameter saved partitioned); its epilogue, which gathers the persistent
    parameters again (a collective), is replaced where it can be by putting back what they held (`_persistent`),
    and those whole values go in the rank's model-states file too (`PERSISTENT`, up to `PERSISTENT_MAX_BYTES`), for
    `_load_files`."""
    kept = _persistent(engine)
    if engine._optimizer_has_ckpt_event_prologue():
        engine.optimizer.checkpoint_event_prologue()
    engine._create_checkpoint_file(directory, TAG, False)
    whole = {}
    if kept is not None and sum(d.numel() * d.element_size() for _, d in kept.values()) <= PERSISTENT_MAX_BYTES:
        whole = {PERSISTENT: {name: data.clone() for name, (_, data) in kept.items()}}  # a view's whole storage
        # would be saved with it (one process: views of the flat partition of every parameter)
    engine._save_checkpoint(directory, TAG, client_state=whole)
    if engine.save_zero_checkpoint:
        engine._create_zero_checkpoint_files(directory, TAG)
        engine._save_zero_checkpoint(directory, TAG)
    if kept is not None:
        _put_back(kept.values())
    elif engine._optimizer_has_ckpt_event_epilogue():
        engine.optimizer.checkpoint_event_epilogue()


def _load_files(engine: Any, directory: str) -> None:
    """`engine.load_checkpoint` of what `_save_files` wrote on this world size, its ZeRO-3 epilogue (a gather of the
    persistent parameters from their partitions, one collective each) replaced by their whole values from the rank's
    model-states file: saved when they were the gather of the very partitions this load restores, they are what the
    gather would give. Anywhere else (not ZeRO-3, a checkpoint without them, `_persistent`'s exceptions), the engine's
    own load."""
    persistent = _persistent_parameters(engine)
    if persistent is None or not _plain(engine):
        engine.load_checkpoint(directory, tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=True)
        return
    engine.optimizer.checkpoint_event_prologue()
    load_path, client_state = engine._load_checkpoint(directory, TAG, load_module_strict=True,
                                                      load_optimizer_states=True, load_lr_scheduler_states=True)
    reader = engine.checkpoint_engine
    if (isinstance(reader, _ReadOnce) and _is_torch_engine(reader._engine)
            and not getattr(engine.optimizer, "swap_optimizer", False)
            and hasattr(engine, "_get_zero_ckpt_name")):
        # this rank's own file only: with `elastic_checkpoint` DeepSpeed reads every rank's, all of the same shapes
        reader.in_place = (engine._get_zero_ckpt_name(directory, TAG), engine.optimizer)
    if load_path is not None and not engine._load_zero_checkpoint(directory, TAG, load_optimizer_states=True):
        engine.optimizer._restore_from_bit16_weights()
    whole = (client_state or {}).get(PERSISTENT) or {}
    if all(_fits(whole.get(name), param) for name, param in persistent.items()):
        _put_back((param, whole[name].to(param.ds_tensor.device)) for name, param in persistent.items())
    else:
        engine.optimizer.checkpoint_event_epilogue()


def _fits(saved: Any, param: torch.nn.Parameter) -> bool:
    return (isinstance(saved, torch.Tensor) and saved.dtype == param.dtype
            and tuple(saved.shape) == tuple(param.ds_shape))


def _put_back(whole: Any) -> None:
    """Each ZeRO-3 persistent parameter of `whole` ((parameter, its whole value) pairs) made whole again."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for param, data in whole:
        param.data, param.ds_status = data, ZeroParamStatus.AVAILABLE


def _persistent_parameters(engine: Any) -> dict[str, torch.nn.Parameter] | None:
    """ZeRO-3's persistent parameters (small ones every rank keeps whole) by name; None where only the engine's
    epilogue may make them whole: not ZeRO-3, none, parameters offloaded, hierarchical (hpZ) or quantized
    partitions."""
    persistent = {id(p) for p in getattr(engine.optimizer, "persistent_parameters", None) or ()}
    config = engine._config.zero_config
    offloaded = getattr(config.offload_param, "device", "none") != "none"
    if (engine.zero_optimization_stage() != 3 or not persistent or offloaded or config.zero_hpz_partition_size > 1
            or config.zero_quantized_weights):
        return None
    return {name: p for name, p in engine.module.named_parameters() if id(p) in persistent}


def _persistent(engine: Any) -> dict[str, tuple[torch.nn.Parameter, torch.Tensor]] | None:
    """ZeRO-3's persistent parameters and the memory they hold, by name, before the prologue frees it. The step's
    end gathered them from the partitions and nothing wrote them since, so putting that memory back after the save
    is what the epilogue's gather would give, with no collective. None where the epilogue must run
    (`_persistent_parameters`, or one not gathered)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    persistent = _persistent_parameters(engine)
    if persistent is None or any(p.ds_status != ZeroParamStatus.AVAILABLE or p.ds_active_sub_modules
                                 for p in persistent.values()):
        return None
    return {name: (p, p.data) for name, p in persistent.items()}


def _is_torch_engine(checkpoint_engine: Any) -> bool:
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    return type(checkpoint_engine) is TorchCheckpointEngine


class _Files:
    """DeepSpeed's torch checkpoint engine, its `save` cadence's: into an open file, fsync'd (`host` None), or a host
    copy of each file's state kept until `write` puts it on disk (the late tensors of `staging` copied by `write`).
    Everything else is the engine's."""

    def __init__(self, engine: Any, host: HostBuffers | None, staging: Staging | None = None):
        self._engine, self._host, self._staging = engine, host, staging
        self._pending: list[tuple[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def save(self, state_dict: Any, path: str) -> None:
        if self._host is None:
            return save_torch(state_dict, path, zipfile=self._engine.zipfile_serialization)
        snapshot = self._host.snapshot(state_dict, Path(path).name, late=self._staging)
        if snapshot is None:  # what a snapshot cannot copy (another device's tensors, a subclass): serialized now
            snapshot = self._host.file(Path(path).name)
            with host_tagged():  # as `save_torch` writes
                torch.save(state_dict, snapshot, _use_new_zipfile_serialization=self._engine.zipfile_serialization)
        self._pending.append((path, snapshot))

    def write(self) -> None:
        """The late copies, then every file `save` took, to disk (fsync'd)."""
        if self._staging is not None:
            try:
                self._host.copy_late()
            finally:
                self._staging.done()
        for path, taken in self._pending:
            if isinstance(taken, HostFile):
                taken.write_to(path)
            else:
                save_torch(taken, path, zipfile=self._engine.zipfile_serialization)


def step_written(engine: Any) -> set[int]:
    """The memory of what only the engine's step writes (`saved_step_written`, and ZeRO-3's partitions of the
    weights): an asynchronous save copies it late, the step waiting for that copy."""
    partitions = [p.ds_tensor for p in engine.module.parameters() if getattr(p, "ds_tensor", None) is not None]
    return {storage_key(t) for t in [*saved_step_written(engine), *partitions] if t.numel()}


def saved_step_written(engine: Any) -> list[torch.Tensor]:
    """What only the engine's step writes and its checkpoint holds: the module's weights (not under ZeRO-3: saved
    partitioned, empty), the optimizer's fp32 master copies and its per-parameter state."""
    tensors = [p for p in engine.module.parameters() if getattr(p, "ds_tensor", None) is None]
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition"):
        tensors += [t for t in getattr(engine.optimizer, name, None) or [] if isinstance(t, torch.Tensor)]
    per_param = engine.basic_optimizer.state.values() if engine.basic_optimizer is not None else ()
    tensors += [v for state in per_param if isinstance(state, dict) for v in state.values()
                if isinstance(v, torch.Tensor)]
    return tensors


def is_engine_checkpoint(directory: Path) -> bool:
    return (Path(directory) / TAG).is_dir()


def check(directory: Path, world_size: int, stage: int, nvme: bool = False) -> dict:
    """What `cadence.json` says, refused before anything loads when this run cannot resume it."""
    saved = json.loads((Path(directory) / TAG / META).read_text())
    written = f"a ZeRO-{saved['zero_stage']} checkpoint written by {saved['world_size']} processes"
    if saved["zero_stage"] != stage:
        raise ValueError(f"{directory} holds {written}; this run uses ZeRO-{stage} on {world_size}: resume with "
                         f"zero_stage={saved['zero_stage']}, {_weights_only(directory)}")
    if nvme and saved["world_size"] != world_size and partitioned(directory):
        raise ValueError(f"{directory}: {written} cannot be resumed on {world_size} with state offloaded to NVMe "
                         f"(cadence converts to DeepSpeed's universal format only for state in memory): resume on "
                         f"{saved['world_size']} processes, or with offload_optimizer_device 'cpu' or 'none', "
                         f"{_weights_only(directory)}")
    return saved


def _weights_only(directory: Path) -> str:
    return (f"or start from its weights with a fresh optimizer: `python -m deepspeed.utils.zero_to_fp32 "
            f"{shlex.quote(str(directory))} weights --tag {TAG} --safe_serialization` (DeepSpeed's zero_to_fp32.py, "
            f"as installed) writes weights/model.safetensors, which learn.load or load_state_dict reads")


def partitioned(directory: Path) -> bool:
    """True when the optimizer state is cut per process (ZeRO 1-3, and DeepSpeed's bf16 optimizer at ZeRO-0)."""
    return any((Path(directory) / TAG).glob("*zero_pp_rank_*_optim_states.pt"))


def load(engine: Any, directory: Path, world_size: int, stage: int, is_main: bool, barrier: Callable[[], None],
         nvme: bool = False) -> None:
    """Load what `save` wrote, converting it to the universal format when the world size changed."""
    directory = Path(directory)
    saved = check(directory, world_size, stage, nvme)
    own = engine.checkpoint_engine
    engine.checkpoint_engine = _ReadOnce(own)
    try:
        _load(engine, directory, saved, world_size, stage, is_main, barrier)
    finally:
        engine.checkpoint_engine = own


def _load(engine: Any, directory: Path, saved: dict, world_size: int, stage: int, is_main: bool,
          barrier: Callable[[], None]) -> None:
    if saved["world_size"] == world_size or not partitioned(directory):
        _load_files(engine, str(directory))
        return
    universal = sibling(directory, UNIVERSAL)
    try:
        check_deepspeed_files(directory / TAG)  # every rank: a refused file stops each, none waits in the barrier
        if is_main:
            to_universal(directory / TAG, universal / TAG)
        barrier()
        link_optimizer_state(engine.optimizer)  # the universal loader fills each group's state through those views
        engine._config.load_universal_checkpoint = True  # read by engine.load_checkpoint only
        try:
            engine.load_checkpoint(str(universal), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=True)
        finally:
            engine._config.load_universal_checkpoint = False
        if stage == 3:
            _repair_zero3_load(engine.optimizer, universal / TAG / "zero" / "optimizer_state.pt")
        barrier()
    finally:
        if is_main:
            shutil.rmtree(universal, ignore_errors=True)


class _ReadOnce:
    """DeepSpeed's checkpoint engine while it loads: every file read as data (`load_deepspeed_file`), not by the
    engine's own `torch.load` (the torch engine's unpickles anything), and a file asked for twice in a row read
    once: the engine's state-dict loader reads the model-states file to check its model-parallel size and then
    again to load it (for ZeRO-1/2 the whole module's weights, read twice per rank)."""

    def __init__(self, engine: Any):
        self._engine, self._last = engine, None
        self.in_place: tuple[str, Any] | None = None  # ZeRO-3: the rank's optimizer-states file and the engine's
        # optimizer, the file read into its tensors (`_load_files`)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def load(self, path: str, map_location: Any = None) -> Any:
        last, self._last = self._last, None
        if last is not None and last[0] == path:
            return last[1]  # handed out a second time, then let go
        state = None
        if self.in_place is not None and str(path) == self.in_place[0]:
            state = load_zero3_in_place(path, map_location, self.in_place[1])
        if state is None:
            state = load_deepspeed_file(path, map_location)
        self._last = (path, state)
        return state


def load_zero3_in_place(path: str, map_location: Any, optimizer: Any) -> Any | None:
    """A ZeRO-3 optimizer-states file as `load_deepspeed_file` reads it (as data: a file holding anything but what
    DeepSpeed writes is refused, ValueError), but read from the file straight into the engine's own
    tensors (`load_in_place`): its fp32 master partitions into `optimizer.fp32_partitioned_groups_flat`, and each
    optimizer state tensor (Adam's moments) into the live one of its partition. Those stand in the loaded state, so
    the engine's copy of the masters into themselves is a copy onto itself, which torch skips, and the inner
    optimizer's `load_state_dict` keeps its own moments: a resume copies those bytes once, into memory already
    there (masters in GPU memory: one copy from the file's pages to the GPU). Every other tensor is copied out of
    the mapping, so nothing loaded keeps the file mapped. `path` must be the rank's own file (its masters). None
    where that does not hold (torch's legacy format, another layout, dtype or shape, a master neither in host nor in
    CUDA memory, a `map_location` off the CPU): the caller loads as usual.

    >>> state = load_zero3_in_place(optim_file, "cpu", engine.optimizer)
    """
    from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT

    masters = optimizer.fp32_partitioned_groups_flat
    state = load_deepspeed_file(path, map_location, mmap=True)
    zero = state.get(OPTIMIZER_STATE_DICT) if isinstance(state, dict) else None
    saved = zero.get(FP32_FLAT_GROUPS) if isinstance(zero, dict) else None
    if not (isinstance(saved, list) and len(saved) == len(masters)
            and all(fits(s, m) and m.is_contiguous() for s, m in zip(saved, masters))):
        return None
    placement = zero.get("ds_zero_partition_groups")  # DeepSpeed refuses another AutoEP placement: before any write
    if placement is not None and placement != getattr(optimizer, "_zero3_partition_group_metadata", lambda: None)():
        return None
    targets = [(saved, i, master) for i, master in enumerate(masters)]
    inner, live = zero.get(OPTIMIZER_STATE_DICT), getattr(optimizer, "optimizer", None)
    groups = _masters_by_group(optimizer) if live is not None else None
    if isinstance(inner, dict) and groups is not None:
        targets += in_place_targets(inner, live.state, groups)
    state = copied_out(state, keep=[container[key] for container, key, _ in targets])  # all read before any write
    read_into(targets, path)
    return state


def _masters_by_group(optimizer: Any) -> list[list[torch.Tensor]] | None:
    """The fp32 master partitions of each parameter group of the inner optimizer, as its state dict numbers them:
    DeepSpeed puts each sub-group's partition into its group (`_set_fp32_optimizer_param_groups`) around a save and
    a load."""
    masters, group_of = optimizer.fp32_partitioned_groups_flat, getattr(optimizer, "sub_group_to_group_id", None)
    if group_of is None or len(group_of) != len(masters) or any(g["params"] for g in optimizer.optimizer.param_groups):
        return None  # DeepSpeed appends the partitions to its groups: only empty ones number them so
    groups = range(len(optimizer.optimizer.param_groups))
    return [[m for s, m in enumerate(masters) if group_of[s] == g] for g in groups]


def link_optimizer_state(opt: Any) -> None:
    """Point the per-parameter views of ZeRO-1/2 (and the bf16 optimizer) at every group's optimizer state.

    DeepSpeed links them once, right after the first group's first step, when the other groups have no state
    yet: with several parameter groups, reading their state failed ("exp_avg not found in optimizer state fragment").
    """
    if hasattr(opt, "_hp_optimizer_states_linked"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def _repair_zero3_load(optimizer: Any, path: Path) -> None:
    """Undo two slips of DeepSpeed's ZeRO-3 universal loader, which matter with several parameter groups: it gives
    every group the hyper-parameters (lr, weight decay, ...) of group 0, and one `step` tensor to every group's
    state, which Adam then advances once per group and step (the bias correction runs ahead)."""
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT

    saved = load_deepspeed_file(path, "cpu")[OPTIMIZER_STATE_DICT]["param_groups"]
    groups = optimizer.optimizer.param_groups
    assert len(saved) == len(groups), (len(saved), len(groups))
    for group, settings in zip(groups, saved):
        group.update({k: v for k, v in settings.items() if k != "params"})
    for flat in optimizer.fp32_partitioned_groups_flat:
        state = optimizer.optimizer.state[flat]
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def to_universal(source: Path, target: Path) -> None:
    """DeepSpeed's `ds_to_universal` of `source` into `target` (replaced), in this process, its output kept quiet."""
    from deepspeed.checkpoint.ds_to_universal import main

    shutil.rmtree(target.parent, ignore_errors=True)
    args = Namespace(input_folder=str(source), output_folder=str(target), num_extract_workers=1, num_merge_workers=1,
                     keep_temp_folder=False, strict=True, inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        main(args)
