"""Checkpoints against the disk: throughput, loop held, resume time and memory, per engine and world size.

An MLP of `--width` x `--width` layers (default 5 of 2048: 21M parameters, 84 MB of weights, 252 MB of state
with AdamW's two moments) trains on `cadence launch --cpu` for each engine (DDP, FSDP2, DeepSpeed ZeRO-3) and
number of processes, 12 optimizer steps on every process: with no checkpoint, then with a Checkpoint every 3 steps,
synchronous, then with `async_save=True`.
For each it measures, in the same run:

- write throughput: checkpoint bytes / the time of a synchronous `learn.save_state` (every rank starting together,
  from the start to the checkpoint in place, the slowest rank), against the disk's own sequential write of the same
  number of bytes with fsync (8 MiB blocks, rank 0, into the checkpoint directory), the two alternating, 4 of each,
  the best of each: this shared disk's speed moves between 360 and 2100 MiB/s within a minute, so a probe taken
  at another moment than the saves measures another disk. "sync held" is the loop's own view of the fit's
  synchronous saves: from each rank's stop for the save to the commit, the best save, its slowest rank (on a
  shared CPU, ranks reach the save point tens of ms apart; that wait is in it);
- held: the time the training loop is held per async save (taking the state at the save point, plus the wait
  before the next optimizer step for the copy of the parameters and optimizer state that overlaps its forward and
  backward; the worst save but the fit's last, whose copy the end of the fit waits for with no step to overlap;
  "of it copy wait" is that wait, worst save), against the synchronous save's; "async
  waits" is the longest a save waited for the one before it (saves every 3 steps here, more often than this disk
  writes them);
- resume: `learn.load_state` of the last checkpoint (slowest rank), against plain loads of the files that rank
  reads (safetensors `load_file` with each tensor read once, `torch.load` with its defaults (DeepSpeed's files as its
  engine reads them), or a `torch.load` of each tensor of the rank's .distcp shard file); each 9 times,
  alternating, the best of each, every rank starting together;
- memory: the peak host memory (sampled every 5 ms) over the resident memory before the save, worst rank; and,
  since an async save's peak is sampled while the next steps run (their own transient memory in it), the peak of
  the whole async fit over that of the same fit with no checkpoint (run first), worst rank: what async saving adds.

    .venv/bin/python bench/checkpoint.py                            # 1, 2, 4 processes x ddp, fsdp, zero3
    .venv/bin/python bench/checkpoint.py --procs 1 2 --engines ddp --layers 3
    .venv/bin/python bench/checkpoint.py --batch-size 64      # a longer step for the async copy to overlap
    .venv/bin/python bench/checkpoint.py --procs 4 --engines fsdp --profile /tmp/prof   # where a resume's time goes
    python bench/checkpoint.py --gpu --procs 1 --engines ddp fsdp --layers 4 --width 8192 --batch-size 64  # a GPU

The page cache is warm for the loads (the files were just written). Figures are for the machine it runs on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENGINES = {"ddp": ("ddp", {}), "fsdp": ("fsdp", {}), "zero3": ("deepspeed", {"zero_stage": 3})}
CHUNK = 8 << 20
STEPS = 12  # optimizer steps per fit on every process: 4 saves, 3 of them followed by a step
RESUMES = 9  # resumes and plain loads measured, alternating; the best of each is reported
PAIRS = 4  # disk probes and save_state, alternating; the best of each is reported


# ---------------------------------------------------------------------------- the launched part
def disk_write(path: Path, size: int) -> float:
    """Seconds to write `size` bytes sequentially to `path` and fsync: what the disk itself does."""
    block = os.urandom(CHUNK)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for offset in range(0, size, CHUNK):
            f.write(block[: min(CHUNK, size - offset)])
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def write_pairs(learn, directory: Path, size: int) -> tuple[float | None, list[float]]:
    """(the best of `PAIRS` disk probes of `size` bytes (rank 0; None elsewhere), this rank's seconds for each
    `learn.save_state` between them): probe, save, probe, save..., every rank starting each save together."""
    import shutil

    from cadence.distributed.env import rank

    probes, saves = [], []
    for i in range(PAIRS):
        if rank() == 0:
            probes.append(disk_write(directory.parent / "disk-probe", size))
        learn.strategy.barrier()
        start = time.perf_counter()
        learn.save_state(directory / str(i))
        saves.append(time.perf_counter() - start)
        learn.strategy.barrier()
        if rank() == 0:
            shutil.rmtree(directory)
    return (min(probes) if probes else None), saves


def plain_load(directory: Path, rank: int) -> float:
    """Seconds for plain loads of the files this rank's resume reads."""
    import torch
    from safetensors.torch import load_file

    files = [p for p in sorted(directory.rglob("*")) if p.is_file()]
    sharded = [p for p in files if p.suffix == ".distcp"]
    if sharded:  # torch's distributed checkpoint: this rank's shard file and the metadata
        start = time.perf_counter()
        distcp_load(sharded[0].parent, f"__{rank}_0.distcp")
        return time.perf_counter() - start
    elif any("zero_pp_rank" in p.name for p in files):  # DeepSpeed: this rank's files (ZeRO-3: its model states
        # too), and the one model-states file of ZeRO-1/2; not the other ranks' files, which its engine does not read
        files = [p for p in files if f"zero_pp_rank_{rank}_" in p.name or p.name.startswith("mp_rank_")]
    else:
        files = [p for p in files if p.suffix in (".safetensors", ".pt") and "rng-rank" not in p.name]
    start = time.perf_counter()
    for p in files:
        if p.suffix == ".safetensors":  # load_file maps the file lazily: each tensor read once, as into a model
            for t in load_file(str(p)).values():
                torch.empty_like(t).copy_(t)
        elif p.suffix == ".pt":  # torch's default weights_only=True, as cadence reads; DeepSpeed's files hold other
            deepspeed = "zero_pp_rank" in p.name or p.name.startswith("mp_rank_")  # objects: read as its engine does
            torch.load(p, map_location="cpu", weights_only=not deepspeed)
    return time.perf_counter() - start


def distcp_load(directory: Path, name: str) -> None:
    """A plain `torch.load` of each tensor in torch's shard file `name` (a .distcp file is the `torch.save`s of its
    tensors one after another; .metadata says where each is), after reading .metadata: what a reader of this rank's
    bytes does at the least. (Reading the file as one `bytes` instead costs twice as long here: a fresh 60-120 MiB
    allocation, its pages faulted in every time.)"""
    import io
    import pickle

    import torch

    metadata = pickle.loads((directory / ".metadata").read_bytes())
    spans = sorted((s.offset, s.length) for s in metadata.storage_data.values() if s.relative_path == name)
    with open(directory / name, "rb") as f:
        for offset, length in spans:
            f.seek(offset)
            torch.load(io.BytesIO(f.read(length)), map_location="cpu")


def worker(engine: str, layers: int, width: int, out: Path, profile: Path | None = None, batch_size: int = 4,
           gpu: bool = False) -> None:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from cadence import DataLoaders, Learner
    from cadence.callbacks.checkpoint import Checkpoint
    from cadence.callbacks.checkpoint.memory import PeakMemory
    from cadence.distributed.env import rank, world_size
    from cadence.distributed.ops import gather_object

    torch.manual_seed(0)
    samples = STEPS * batch_size * world_size()  # every process takes STEPS steps, whatever the number of processes
    x, y = torch.randn(samples, width), torch.randn(samples, width)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=batch_size), device=None if gpu else "cpu")
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)])
    name, kwargs = ENGINES[engine]
    root = out.parent / f"ckpt-{out.stem}"
    learn = Learner(dls, model, loss_func=nn.MSELoss(), opt_func=torch.optim.AdamW, lr=1e-4)
    learn.remove_cb(learn.progress)
    result, fit_peak = {}, {}
    with learn.distrib_ctx(strategy=name, **kwargs):
        for mode in ("none", "sync", "async"):
            ckpt = None if mode == "none" else Checkpoint(root / mode, every_n_steps=3, every_epoch=False,
                                                          keep_last=1, async_save=mode == "async")
            meter = PeakMemory().start()
            learn.fit(1, cbs=[ckpt] if ckpt else [])
            fit_peak[mode] = meter.stop()
            if ckpt:
                result[mode] = ckpt.saves
        last = root / "sync" / (root / "sync" / "latest").read_text()
        resume, plain = [], []
        profiler = None
        if profile is not None:
            import cProfile

            profiler = cProfile.Profile()
        for attempt in range(RESUMES):  # alternating, the best of each: single loads of 0.1 s are mostly noise here
            learn.strategy.barrier()  # every rank starts together: no rank's wait for a late one counts as resume
            if profiler is not None and attempt:  # the warm ones, as the best of them is reported
                profiler.enable()
            start = time.perf_counter()
            learn.load_state(last)
            resume.append(time.perf_counter() - start)
            if profiler is not None:
                profiler.disable()
            learn.strategy.barrier()
            plain.append(plain_load(last, rank()))
        resume, plain = min(resume), min(plain)
        if profiler is not None:
            profiler.dump_stats(profile / f"resume-{engine}-{world_size()}-rank{rank()}.prof")
        size = sum(p.stat().st_size for p in last.rglob("*") if p.is_file())
        disk, saved = write_pairs(learn, root / "pairs", size)
        everyone = gather_object({"saves": result, "resume": resume, "plain": plain, "disk": disk, "size": size,
                                  "save_state": saved,
                                  "fit_peak": fit_peak})
    if rank() == 0:
        out.write_text(json.dumps(everyone))


# ---------------------------------------------------------------------------- the driver
def run(engine: str, nproc: int, layers: int, width: int, workdir: Path, profile: str | None,
        batch_size: int, gpu: bool = False) -> dict | str:
    out = workdir / f"{engine}-{nproc}.json"
    cmd = [sys.executable, "-m", "cadence.cli", "launch", *([] if gpu else ["--cpu"]), "--num_processes", str(nproc),
           __file__, "--worker", engine, "--layers", str(layers), "--width", str(width), "--out", str(out),
           "--batch-size", str(batch_size), *(["--profile", profile] if profile else []), *(["--gpu"] if gpu else [])]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, cwd=REPO)
    if proc.returncode != 0:
        print(f"{engine} on {nproc} processes failed; its last output:\n{proc.stderr[-4000:]}", file=sys.stderr)
        return f"failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}"
    return json.loads(out.read_text())


def row(engine: str, nproc: int, ranks: list[dict]) -> str:
    sync = [r["saves"]["sync"] for r in ranks]
    async_ = [r["saves"]["async"] for r in ranks]
    size, disk = ranks[0]["size"], ranks[0]["disk"]
    held_sync = min(max(s["held_s"] for s in saves) for saves in zip(*sync))  # the best save, its slowest rank
    sync_s = min(map(max, zip(*(r["save_state"] for r in ranks))))  # the best save_state, its slowest rank
    # the fit's last save is left out: its copy is waited for by the end of the fit, with no step to overlap
    trained_on = list(zip(*async_))[:-1] or list(zip(*async_))
    held_async = max(map(held, trained_on))  # the copy's wait in
    waited = max(max(s["waited_s"] for s in saves) for saves in zip(*async_))
    copy_wait = max(map(copy_wait_of, trained_on))
    resume, plain = max(r["resume"] for r in ranks), max(r["plain"] for r in ranks)
    fit_peaks = max(r["fit_peak"]["async"] / r["fit_peak"]["none"] for r in ranks)

    def memory(runs):
        return max(s["peak"] / s["resident"] for saves in runs for s in saves if s["peak"] and s["resident"])
    mb = 1 << 20
    return (f"| {engine} | {nproc} | {size / mb:.0f} | {size / mb / sync_s:.0f} | {size / mb / disk:.0f} | "
            f"{disk / sync_s:.2f} | {held_sync:.2f} | {held_async:.3f} | {copy_wait:.3f} | {held_async / held_sync:.3f} | "
            f"{waited:.2f} | "
            f"{resume:.3f} | {plain:.3f} | {resume / plain:.2f} | {memory(sync):.2f} | {memory(async_):.2f} | "
            f"{fit_peaks:.2f} |")


def held(save: tuple[dict, ...]) -> float:
    """One save's (every rank's figures) held seconds less its wait for the save before, slowest rank."""
    return max(s["held_s"] - s["waited_s"] for s in save)


def copy_wait_of(save: tuple[dict, ...]) -> float:
    return max(s["copy_wait_s"] for s in save)


def each_save(engine: str, nproc: int, ranks: list[dict]) -> str:
    """Every save's held seconds (its wait for the save before left out) and copy wait, slowest rank."""
    def saves(mode):
        return ", ".join(f"{held(save):.3f} ({copy_wait_of(save):.3f})"
                         for save in zip(*[r["saves"][mode] for r in ranks]))
    return f"  {engine} {nproc}: each save held s (copy wait s): sync {saves('sync')}; async {saves('async')}"


HEADER = ("| engine | procs | checkpoint MiB | save MiB/s | disk MiB/s | save/disk | sync held s | async held s | "
          "of it copy wait s | async/sync | async waits s | resume s | plain load s | resume/plain | "
          "peak/resident sync | peak/resident async | async fit peak/no-save fit peak |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4, help="samples per process per step: the step that an async "
                                                               "save's copy overlaps")
    p.add_argument("--dir", help="where the checkpoints go (default: a temporary directory on the disk of /tmp)")
    p.add_argument("--profile", help="a directory: each rank's resumes but the first (learn.load_state, the page cache "
                                     "warm) profiled with cProfile into resume-<engine>-<procs>-rank<r>.prof there")
    p.add_argument("--gpu", action="store_true", help="train on the GPUs (one per process), not the CPU")
    p.add_argument("--each-save", action="store_true", help="after each row, every save's held seconds (less its wait "
                                                            "for the save before) and copy wait, slowest rank")
    p.add_argument("--worker", choices=list(ENGINES), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.layers, args.width, Path(args.out), args.profile and Path(args.profile),
                      args.batch_size, args.gpu)
    params = args.layers * (args.width * args.width + args.width)
    print(f"model: {args.layers} x Linear({args.width}, {args.width}): {params / 1e6:.1f}M parameters, "
          f"{params * 4 / 1e6:.0f} MB of weights, {params * 12 / 1e6:.0f} MB with AdamW's state; "
          f"{args.batch_size} samples per process per step")
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for nproc in args.procs:
            for engine in args.engines:
                result = run(engine, nproc, args.layers, args.width, Path(tmp),
                             args.profile and str(Path(args.profile).resolve()), args.batch_size, args.gpu)
                print(row(engine, nproc, result) if isinstance(result, list) else f"| {engine} | {nproc} | {result} |",
                      flush=True)
                if args.each_save and isinstance(result, list):
                    print(each_save(engine, nproc, result), flush=True)
                for leftover in Path(tmp).glob("ckpt-*"):
                    subprocess.run(["rm", "-rf", str(leftover)], check=False)


if __name__ == "__main__":
    main()
