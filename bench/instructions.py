"""Instructions per training step, cadence's `Learner.fit` against a hand-written loop (callgrind).

Timing on a shared 2-core VM moves by ±5-10% between runs; instruction counts do not. Each
measurement runs the model under valgrind's callgrind and counts only the training epoch: a
tiny C helper issues callgrind's client requests (zero the counters before the epoch, dump
them after), so imports, set-up and interpreter exit are left out. Per-step cost is
(instructions of an N2-batch epoch − those of an N1-batch epoch) / (N2 − N1), which also
cancels the work done once per epoch. Python's garbage collector is collected, then paused,
for the counted epoch on both sides (in steady state it runs a few young-generation passes per
thousand steps, whose timing would otherwise add noise).

    .venv/bin/python bench/instructions.py                            # tiny, 100 and 500 steps: ~6 min on 2 cores
    .venv/bin/python bench/instructions.py --size mlp --steps 20 60   # MLP: ~8 min
    .venv/bin/python bench/instructions.py --runner accelerator       # the loop on cadence.Accelerator instead

Needs valgrind, its headers (valgrind/callgrind.h) and a C compiler.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HELPER_C = """
#include <valgrind/callgrind.h>
void cg_zero(void) { CALLGRIND_ZERO_STATS; }
void cg_dump(void) { CALLGRIND_DUMP_STATS_AT("epoch"); }
"""


def child(mode: str, size: str, n: int, helper: str) -> None:
    """One counted epoch of `n` batches (runs under valgrind), with overhead.py's raw loop or cadence runner."""
    import contextlib
    import io
    from functools import partial

    import torch

    from overhead import cadence_accelerator_loop, cadence_fit, make_batches, make_model, raw_loop

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cg = ctypes.CDLL(helper)
    data = make_batches(size, 5)
    runner = {"raw": raw_loop, "cadence": cadence_fit, "accelerator": cadence_accelerator_loop,
              "cadence-no-progress": partial(cadence_fit, drop=("ProgressCallback",)),
              "cadence-loop-only": partial(cadence_fit, drop=("ProgressCallback", "Recorder"))}[mode]
    run = runner(make_model(size), data)
    with contextlib.redirect_stdout(io.StringIO()):
        run()  # first-step work (lazy imports, optimizer state) stays out of the count
        data[:] = make_batches(size, n)  # both runners read this list when they run
        gc.collect()
        gc.disable()
        cg.cg_zero()
        run()
        cg.cg_dump()


def count(mode: str, size: str, n: int, helper: str, workdir: Path) -> int:
    """Instructions of the counted epoch, from callgrind's dump."""
    out = workdir / f"cg.{mode}.{size}.{n}"
    env = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__,
           "--child", mode, size, str(n), helper]
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=3600)
    dumps = sorted(workdir.glob(f"{out.name}.*"))  # the client-request dump: <out>.1
    for line in dumps[0].read_text().splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"no summary line in {dumps[0]}")


def build_helper(workdir: Path) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if not (cc and shutil.which("valgrind") and Path("/usr/include/valgrind/callgrind.h").exists()):
        sys.exit("needs valgrind, /usr/include/valgrind/callgrind.h and a C compiler (apt install valgrind gcc)")
    src, lib = workdir / "cgctl.c", workdir / "libcgctl.so"
    src.write_text(HELPER_C)
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return str(lib)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=["tiny", "mlp", "both"], default="tiny")
    p.add_argument("--steps", type=int, nargs=2, default=[100, 500], metavar=("N1", "N2"),
                   help="batches of the two counted epochs (default 100 500)")
    p.add_argument("--runner", nargs="+", default=["cadence"],
                   choices=["cadence", "accelerator", "cadence-no-progress", "cadence-loop-only"],
                   help="cadence: Learner.fit; accelerator: overhead.py's hand-written loop on cadence.Accelerator; "
                        "cadence-no-progress / cadence-loop-only: Learner.fit without the progress display / "
                        "without any callback (where the time goes)")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        mode, size, n, helper = args.child
        return child(mode, size, int(n), helper)
    sizes = ["tiny", "mlp"] if args.size == "both" else [args.size]
    n1, n2 = args.steps
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        helper = build_helper(workdir)
        jobs = [(mode, size, n) for size in sizes for mode in ("raw", *args.runner) for n in (n1, n2)]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            counts = dict(zip(jobs, pool.map(lambda job: count(*job, helper, workdir), jobs)))
    print(f"instructions per step (callgrind; epochs of {n1} and {n2} batches; gc paused while counting)")
    print(f"{'':8}{'runner':>20}{'per step':>14}{'extra':>10}{'ratio':>8}")
    for size in sizes:
        per_step = {m: (counts[(m, size, n2)] - counts[(m, size, n1)]) / (n2 - n1) for m in ("raw", *args.runner)}
        for m, cost in per_step.items():
            print(f"{size:8}{m:>20}{cost:>14,.0f}{cost - per_step['raw']:>10,.0f}{cost / per_step['raw']:>8.4f}")


if __name__ == "__main__":
    main()
