"""Regional against whole-model compilation: cold-start time of a tiny Llama with N identical layers.

Each run is a fresh process (dynamo's caches empty) with inductor's on-disk caches switched off
(TORCHINDUCTOR_FORCE_DISABLE_CACHES=1), so every run compiles from scratch. It builds a
transformers `LlamaForCausalLM` from a tiny `LlamaConfig` (hidden 256, 4 heads, `use_cache=False`:
a KV cache would key each layer's graph on its layer index), compiles it with cadence's
`compile_model(model, backend=..., regional=...)` and trains with SGD on one fixed batch:

- **first step**: the first whole step (forward, loss, backward, optimizer step), where dynamo traces
  and the backend compiles the forward and backward graphs, in wall-clock seconds and in CPU seconds
  (this process's and the compiler processes' it waited for: inductor compiles in this process,
  TORCHINDUCTOR_COMPILE_THREADS=1, and runs the C++ compiler as a child). CPU time is the steadier
  measure when other jobs share the machine;
- **first fwd**: the first forward pass alone (CPU seconds);
- **steady**: the median of the next steps, milliseconds (what the compiled code runs at);
- **graphs**: graphs dynamo compiled (regional: the layers share one graph, the other modules one each);
- **max abs diff**: the largest difference between the compiled and the eager model's first logits.

One torch thread (OMP_NUM_THREADS=1), in the eager model and in inductor's code alike: threads waiting on
each other on a shared machine stretched eager steps from tens of milliseconds to seconds.

    .venv/bin/python bench/compile_regions.py                     # 4 and 8 layers, inductor (~8 min on 2 cores)
    .venv/bin/python bench/compile_regions.py --layers 8 --repeats 3
    .venv/bin/python bench/compile_regions.py --smoke             # 2 layers, aot_eager: the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("eager", "full", "regional")


def cpu_seconds() -> float:
    """CPU time of this process and of the children it has waited for (the C++ compiler's runs)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def child(mode: str, layers: int, backend: str, steps: int) -> dict:
    """One run in this process: build, compile as `mode` says, time the first and the following steps."""
    import torch
    from torch._dynamo.utils import counters
    from transformers import LlamaConfig, LlamaForCausalLM

    from cadence.compile import compile_model

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128, use_cache=False)
    model = LlamaForCausalLM(config)
    batch = torch.randint(0, config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(batch).logits
    if mode != "eager":
        compile_model(model, backend=backend, regional=mode == "regional")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    walls, result = [], {}
    for step in range(steps):
        start, cpu = time.perf_counter(), cpu_seconds()
        logits = model(batch).logits
        if step == 0:
            result.update(first_fwd_cpu=cpu_seconds() - cpu, diff=(logits.detach() - expected).abs().max().item())
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        walls.append(time.perf_counter() - start)
        if step == 0:
            result["first_step_cpu"] = cpu_seconds() - cpu
    return {**result, "first_step": walls[0], "steady": statistics.median(walls[1:]),
            "graphs": counters["stats"]["unique_graphs"]}


def run(mode: str, layers: int, backend: str, steps: int) -> dict:
    """`child` in a fresh process, compiling from scratch."""
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--layers", str(layers), "--backend", backend,
                          "--steps", str(steps)], capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8], help="identical decoder layers (default 4 8)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--repeats", type=int, default=1, help="fresh processes per mode; the table shows medians")
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (the first compiles)")
    parser.add_argument("--smoke", action="store_true", help="2 layers, aot_eager, one repeat: check the script runs")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.backend, args.repeats, args.steps = [2], "aot_eager", 1, 3
    if args.child:
        print(json.dumps(child(args.child, args.layers[0], args.backend, args.steps)))
        return 0
    print(f"tiny Llama, backend {args.backend}, median of {args.repeats} fresh process(es) per row\n")
    print("| layers | mode | first step (s) | first step CPU (s) | first fwd CPU (s) | steady (ms) | graphs "
          "| max abs diff |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    summary = []
    for layers in args.layers:
        runs = {mode: [] for mode in MODES}
        for _ in range(args.repeats):
            for mode in MODES:  # interleaved, so a busy spell on the machine falls on every mode
                runs[mode].append(run(mode, layers, args.backend, args.steps))
        med = {mode: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for mode, rs in runs.items()}
        for mode, m in med.items():
            print(f"| {layers} | {mode} | {m['first_step']:.2f} | {m['first_step_cpu']:.2f} | {m['first_fwd_cpu']:.2f} "
                  f"| {m['steady'] * 1e3:.1f} | {m['graphs']:.0f} | {m['diff']:.1e} |", flush=True)
        full, regional = med["full"]["first_step_cpu"], med["regional"]["first_step_cpu"]
        summary.append(f"{layers} layers: the first step compiled in {regional:.1f} s of CPU with regional compilation, "
                       f"{full:.1f} s with whole-model compilation ({full / regional:.2f}x)")
    print("", *summary, sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
