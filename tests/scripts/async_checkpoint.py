"""Train as tests/scripts/resume.py does (GradAccum, dropout, AdamW, one-cycle; a checkpoint every 4 optimizer steps
and every epoch end) with `Checkpoint(async_save=...)`; the same command line starts and continues the run.

  async_checkpoint.py --ckpt DIR --out FILE [--sync] [--write-delay S] [--kill-after S] [--kill-at-step N] [--sigterm-in-write N]
                      [--fsize BYTES] [--keep-last N] [--strategy NAME [--zero-stage N]] [--batchnorm] [--copy-delay S]
                      [--classes N] [--disk-delay S] [--device cpu|cuda|default]
--sync: Checkpoint(async_save=False) (the default here is async).
--write-delay: every checkpoint's RNG files are written S seconds late (a slow disk: the write is in flight
  for longer, while training goes on).
--kill-after: every rank SIGKILLs itself S seconds after its training started (a kill at a moment the test picks).
--kill-at-step: every rank SIGKILLs itself right after optimizer step N (with --write-delay, mid-write of the save before).
--sigterm-in-write: the N-th checkpoint's writer sends this process SIGTERM half-way (rank 0, the first run only:
  a marker file in DIR remembers).
--fsize: RLIMIT_FSIZE (SIGXFSZ ignored: a write past it fails as on a full disk), set before the fit.
--batchnorm: a BatchNorm1d after the first layer (running statistics that every forward changes).
--copy-delay: the writer's copy of the parameters and optimizer state (FSDP2: torch's stager's copy of the shards;
  DeepSpeed: the writer's copy of the weights, master partitions and optimizer state in the engine's files)
  starts S seconds late (a slow copy: the next micro-batches' forward and backward run meanwhile, and the loop
  waits for it before the step).
--disk-delay: every file that `torch.save` writes to disk (DeepSpeed's engine files among them, whichever thread
  writes them) and every file serialized in memory first (`HostFile.write_to`) reaches the disk S seconds late;
  a save into memory is not delayed.
--device: where the batches (and so the model) go: cpu (the default), cuda, or cadence's default.
--classes: the number of classes (3; 4 gives every parameter an even size: DeepSpeed pads no partition on 2
  processes, and its padding holds whatever memory it was given).
Every rank prints `LOAD_COLLECTIVES <n>` and `SAVE_COLLECTIVES <n>`: the collectives (torch.distributed calls) its
resume (`load_state`) and its saves' taking of the state (`stage_state`, at the save point) made on the main thread,
and `WROTE save_model_file|save_optimizer_file <rank>` for each base-format file it wrote; under DeepSpeed ZeRO-3,
`MASTERS_IN_PLACE <n>`: the optimizer-states files its resume read straight into the fp32 master partitions, and
`MOMENTS_IN_PLACE <n>`: the optimizer state tensors it read straight into the optimizer's own.
A failed fit prints `ERROR <type>: <message>` and `STEP <n>` and exits 1.
Prints `DEVICE <where the model trained>`, `STEPS <n>`, `BLOCKED <seconds per save, json>` and `COPYWAIT <seconds of it waiting for the copy, json>` at
the end; rank 0 writes the final weights to FILE.
"""

import argparse
import json
import os
import random
import resource
import signal
import threading
import time
from pathlib import Path

import numpy as np
from safetensors.torch import save_file
from torch import nn

import cadence.callbacks.checkpoint.state as state_module
import cadence.distributed.state_files as state_files
import cadence.distributed.strategy as strategy_module
from cadence import Callback, Learner, accuracy
from cadence.callbacks.accumulate import GradAccum
from cadence.callbacks.checkpoint import Checkpoint
from cadence.distributed.env import is_main_process, rank
from resume import data_and_model


def slow_rng_file(delay: float, sigterm_at: int | None, marker: Path):
    """The writer of each rank's RNG file (every engine's checkpoint has one), `delay` seconds late; SIGTERM to this
    process half-way through write `sigterm_at`."""
    write, calls = state_module.save_torch, [0]

    def slow(obj, path):
        calls[0] += 1
        if sigterm_at == calls[0] and not marker.exists():
            marker.write_text("sent")
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(delay)
        write(obj, path)
    state_module.save_torch = slow


def slow_late_copy(delay: float):
    """The copy that the checkpoint writer's thread makes (the parameters and optimizer state) starts `delay` s late;
    under FSDP2 the copy of the shards that torch's stager makes in the writer's thread; under DeepSpeed the late copy
    of the engine's files."""
    from torch.distributed.checkpoint.staging import DefaultStager

    from cadence.distributed.staging import HostBuffers

    copy, stage, copy_late = strategy_module.host_copy, DefaultStager._stage, HostBuffers.copy_late

    def slow_copy_late(self):
        time.sleep(delay)
        copy_late(self)
    HostBuffers.copy_late = slow_copy_late

    def slow_stage(self, state_dict, **kwargs):
        time.sleep(delay)
        return stage(self, state_dict, **kwargs)
    DefaultStager._stage = slow_stage

    def slow(state, only=None, into=None):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(delay)
        return copy(state, only, into)
    strategy_module.host_copy = slow


def slow_disk(delay: float):
    """torch.save to a path or an open file, and HostFile.write_to, `delay` seconds late (into memory: not late)."""
    import torch

    from cadence.distributed.staging import HostFile

    save, write_to = torch.save, HostFile.write_to

    def slow_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) or hasattr(f, "fileno"):
            time.sleep(delay)
        return save(obj, f, *args, **kwargs)

    def slow_write_to(self, path):
        time.sleep(delay)
        return write_to(self, path)
    torch.save, HostFile.write_to = slow_save, slow_write_to


class KillAtStep(Callback):
    """SIGKILL this process right after optimizer step `step` (every rank at the same point of training)."""

    def __init__(self, step):
        self.at = step

    def after_step(self):
        if self.learn.step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


class KillAfter(Callback):
    """SIGKILL this process `seconds` after its training starts (after any resume)."""

    def __init__(self, seconds):
        self.seconds = seconds

    def before_fit(self):
        timer = threading.Timer(self.seconds, os.kill, (os.getpid(), signal.SIGKILL))
        timer.daemon = True
        timer.start()


def count_collectives() -> dict[str, int]:
    """Count the torch.distributed collectives this process's main thread calls while the Checkpoint callback's
    `load_state` runs ("load") and while a save takes its state (`stage_state`, "save": the save point, less the
    wait for a save still in flight; the writer threads' collectives on a group of their own are not counted)."""
    import torch.distributed as dist

    import cadence.callbacks.checkpoint.callback as callback_module

    count, counting = {"load": 0, "save": 0}, [None]
    for name in ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "reduce_scatter",
                 "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list", "broadcast",
                 "broadcast_object_list", "barrier", "all_to_all", "monitored_barrier", "new_group"):
        def counted(*args, _call=getattr(dist, name), **kwargs):
            if counting[0] is not None and threading.current_thread() is threading.main_thread():
                count[counting[0]] += 1
            return _call(*args, **kwargs)
        setattr(dist, name, counted)

    def counting_in(what, function):
        def counted(*args, **kwargs):
            counting[0] = what
            try:
                return function(*args, **kwargs)
            finally:
                counting[0] = None
        return counted
    callback_module.load_state = counting_in("load", callback_module.load_state)
    callback_module.stage_state = counting_in("save", callback_module.stage_state)
    return count


def count_in_place() -> list[int]:
    """[optimizer-states files, optimizer state tensors] a ZeRO-3 resume read straight into the engine's own tensors
    (the fp32 master partitions; Adam's moments)."""
    import cadence.distributed.deepspeed_checkpoint as engine_files

    read, load, plan = [0, 0], engine_files.load_zero3_in_place, engine_files.in_place_targets

    def counted(*args, **kwargs):
        state = load(*args, **kwargs)
        read[0] += state is not None
        return state

    def counted_targets(*args, **kwargs):
        targets = plan(*args, **kwargs)
        read[1] += len(targets)
        return targets
    engine_files.load_zero3_in_place, engine_files.in_place_targets = counted, counted_targets
    return read


def report_file_writers():
    """Every rank prints `WROTE <file> <rank>` for each base-format file (model.safetensors, optimizer.pt) it writes."""
    for name in ("save_model_file", "save_optimizer_file"):
        def reported(state, directory, _save=getattr(state_files, name), _name=name):
            _save(state, directory)
            print(f"WROTE {_name} {rank()}", flush=True)
        setattr(state_files, name, reported)   # what `write_state_files` calls


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--sync", action="store_true")
    p.add_argument("--write-delay", type=float, default=0.0)
    p.add_argument("--kill-after", type=float)
    p.add_argument("--kill-at-step", type=int)
    p.add_argument("--sigterm-in-write", type=int)
    p.add_argument("--fsize", type=int)
    p.add_argument("--keep-last", type=int)
    p.add_argument("--strategy", help="the engine under `cadence launch` (default: the launcher's, DDP)")
    p.add_argument("--zero-stage", type=int, help="DeepSpeed's ZeRO stage (with --strategy deepspeed)")
    p.add_argument("--batchnorm", action="store_true")
    p.add_argument("--classes", type=int, default=3)
    p.add_argument("--disk-delay", type=float, default=0.0)
    p.add_argument("--copy-delay", type=float, default=0.0)
    p.add_argument("--device", default="cpu", help="'default': cadence's (a GPU where there is one)")
    args = p.parse_args()
    Path(args.ckpt).mkdir(parents=True, exist_ok=True)
    if args.write_delay or args.sigterm_in_write:
        slow_rng_file(args.write_delay, args.sigterm_in_write if rank() == 0 else None,
                            Path(args.ckpt) / "sigterm-sent")

    random.seed(0)  # the checkpoints hold these states: two runs write the same bytes
    np.random.seed(0)
    if args.copy_delay:
        slow_late_copy(args.copy_delay)
    if args.disk_delay:
        slow_disk(args.disk_delay)
    collectives = count_collectives()
    in_place = count_in_place()
    report_file_writers()
    dls, model = data_and_model(classes=args.classes, device=None if args.device == "default" else args.device)
    if args.batchnorm:
        model.insert(1, nn.BatchNorm1d(model[0].out_features))
    ckpt = Checkpoint(args.ckpt, every_n_steps=4, keep_last=args.keep_last, async_save=not args.sync)
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=accuracy, cbs=[GradAccum(steps=2), ckpt])
    learn.remove_cb(learn.progress)
    if args.kill_after is not None:
        learn.add_cb(KillAfter(args.kill_after))
    if args.kill_at_step is not None:
        learn.add_cb(KillAtStep(args.kill_at_step))
    if args.fsize:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize, args.fsize))
    try:
        options = {} if args.zero_stage is None else {"zero_stage": args.zero_stage}
        with learn.distrib_ctx(strategy=args.strategy, **options):
            learn.fit_one_cycle(3, lr_max=1e-2, resume="auto")
            print(f"DEVICE {next(learn.model.parameters()).device}", flush=True)
    except Exception as e:
        print(f"ERROR {type(e).__name__}: {e}\nSTEP {learn.step}", flush=True)
        raise SystemExit(1)
    print(f"LOAD_COLLECTIVES {collectives['load']}", flush=True)
    print(f"SAVE_COLLECTIVES {collectives['save']}", flush=True)
    print(f"MASTERS_IN_PLACE {in_place[0]}", flush=True)
    print(f"MOMENTS_IN_PLACE {in_place[1]}", flush=True)
    if is_main_process():
        save_file({k: v.detach().cpu().contiguous() for k, v in learn.model.state_dict().items()}, args.out)
        print(f"STEPS {learn.step}", flush=True)
        print(f"BLOCKED {json.dumps([save['held_s'] for save in ckpt.saves])}", flush=True)
        print(f"COPYWAIT {json.dumps([save.get('copy_wait_s', 0.0) for save in ckpt.saves])}", flush=True)


if __name__ == "__main__":
    main()
