"""Accelerate's example scripts x cadence's engines, each run through `cadence launch` as a user would.

Each script is Accelerate's own (upstream/, pinned in NOTICE.md) with only its imports swapped (swap.py),
run offline against the stand-ins of standins/build.py (the network cannot exist here). A run passes
when what the script itself reports holds: accuracy/F1 above a floor (the stand-in model starts far
below chance), every evaluation sample counted once, checkpoints written and resumed, trackers' files.

    python tests/accelerate/examples/matrix.py --status STATUS.md            # every script x engine
    python tests/accelerate/examples/matrix.py --only nlp_example --engines DDP FSDP
    python tests/accelerate/examples/matrix.py --library accelerate          # the same runs on real Accelerate

Real Accelerate's runs go one at a time (`--jobs 1`): two of its 2-process CPU runs side by side hang.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent.parent))
from helpers import cadence_env  # noqa: E402
from standins.build import SPLITS, build  # noqa: E402
from swap import swap  # noqa: E402

ENGINES: dict[str, tuple[int, tuple[str, ...]]] = {
    "1 process": (1, ()),
    "DDP": (2, ()),
    "FSDP": (2, ("--use_fsdp",)),
    "ZeRO-2": (2, ("--use_deepspeed", "--zero_stage", "2")),
    "ZeRO-3": (2, ("--use_deepspeed", "--zero_stage", "3")),
    "bf16": (1, ("--mixed_precision", "bf16")),
    "accumulation": (1, ()),      # --gradient_accumulation_steps 2: the script's own flag, else the launcher's
    "TP": (2, ()),                # tensor parallelism, its size given as the script's own flag (Example.engine_args)
}
EVERY_SCRIPT = tuple(e for e in ENGINES if e != "TP")   # what every script runs on; TP only where its size is the script's flag
FLOOR = 0.75                      # accuracy the MRPC-like examples must reach (chance 0.5; they start near 0.1)
EVAL_SAMPLES = SPLITS["validation"]


@dataclass
class Run:
    stdout: str
    stderr: str
    out: Path                     # the run's own folder (checkpoints, logs)

    @property
    def text(self) -> str:
        return self.stdout + self.stderr


def last_metric(run: Run) -> list[str]:
    """The last `epoch N: {...}` the script printed has accuracy >= FLOOR."""
    found = re.findall(r"^epoch \d+:? ?(\{.*\})$", run.stdout, flags=re.M)
    if not found:
        return ["no 'epoch N: {...}' metric printed"]
    metric = ast.literal_eval(found[-1])
    return [] if metric["accuracy"] >= FLOOR else [f"accuracy {metric['accuracy']:.3f} < {FLOOR} ({metric})"]


def counted_once(*sizes: int) -> Callable[[Run], list[str]]:
    """Every `metric.compute()` saw exactly one of `sizes` samples: gather_for_metrics dropped the padding."""
    def check(run: Run) -> list[str]:
        counts = [int(n) for n in re.findall(r"\[evaluate stand-in\] glue/mrpc over (\d+) samples", run.stderr)]
        if not counts:
            return ["metric.compute() never ran"]
        bad = sorted(set(counts) - set(sizes))
        return [f"metric computed over {bad} samples, expected {list(sizes)}"] if bad else []
    return check


def cv_floor(run: Run) -> list[str]:
    found = re.findall(r"^epoch \d+: ([\d.]+)$", run.stdout, flags=re.M)
    if not found:
        return ["no 'epoch N: <accuracy>' printed"]
    return [] if float(found[-1]) >= 100 * FLOOR else [f"accuracy {found[-1]}% < {100 * FLOOR}%"]


def finite(pattern: str) -> Callable[[Run], list[str]]:
    def check(run: Run) -> list[str]:
        found = re.findall(pattern, run.text)
        if not found:
            return [f"nothing printed matching {pattern!r}"]
        return [] if math.isfinite(float(found[-1])) else [f"{pattern!r}: {found[-1]}"]
    return check


def printed(*needles: str, absent: tuple[str, ...] = ()) -> Callable[[Run], list[str]]:
    def check(run: Run) -> list[str]:
        return ([f"{n!r} not printed" for n in needles if n not in run.stdout] +
                [f"{n!r} printed" for n in absent if n in run.stdout])
    return check


def files(*globs: str) -> Callable[[Run], list[str]]:
    def check(run: Run) -> list[str]:
        return [f"no {g} under the run's folder" for g in globs if not list(run.out.glob(g))]
    return check


NLP = (last_metric, counted_once(EVAL_SAMPLES))


@dataclass
class Example:
    script: str                                   # path under upstream/, without .py
    args: tuple[str, ...] = ()                    # "{out}" / "{pets}" are filled in
    checks: tuple[Callable[[Run], list[str]], ...] = NLP
    resume: tuple[str, ...] | None = None         # a second launch continuing the first one's checkpoint
    resume_checks: tuple[Callable[[Run], list[str]], ...] = ()
    own_accumulation_flag: bool = False
    site: str = "site"                            # which stand-in packages go on PYTHONPATH
    skip: str | None = None
    refused: dict[str, str] = field(default_factory=dict)   # engine -> the clear error expected (as Accelerate)
    engines: tuple[str, ...] = EVERY_SCRIPT
    extra_env: dict[str, str] = field(default_factory=dict)
    engine_args: dict[str, tuple[str, ...]] = field(default_factory=dict)   # engine -> more script flags


EXAMPLES = [
    Example("nlp_example"),
    Example("cv_example", ("--data_dir", "{pets}"), (cv_floor,), site="site_cv"),
    Example("complete_nlp_example", ("--checkpointing_steps", "epoch", "--output_dir", "{out}"),
            (*NLP, files("epoch_0", "epoch_2")),
            resume=("--resume_from_checkpoint", "{out}/epoch_0"),
            resume_checks=(*NLP, printed("Resumed from checkpoint", "epoch 1:", "epoch 2:", absent=("epoch 0:",)))),
    Example("complete_cv_example", ("--data_dir", "{pets}", "--checkpointing_steps", "epoch", "--output_dir", "{out}"),
            (cv_floor, files("epoch_0", "epoch_2")),
            resume=("--data_dir", "{pets}", "--resume_from_checkpoint", "{out}/epoch_1"),
            resume_checks=(cv_floor, printed("Resumed from checkpoint", "epoch 2:", absent=("epoch 1:",))),
            site="site_cv"),
    Example("by_feature/automatic_gradient_accumulation"),
    Example("by_feature/checkpointing", ("--checkpointing_steps", "10", "--output_dir", "{out}"),
            (*NLP, files("step_10")),
            resume=("--resume_from_checkpoint", "{out}/step_10"),
            resume_checks=(*NLP, printed("Resumed from checkpoint", "epoch 0:", "epoch 2:"))),
    Example("by_feature/cross_validation", ("--num_folds", "2"),
            # its test loader (the validation split) is not prepared: each of 2 processes predicts all of it, and the
            # final metric gathers both (Accelerate's gather_for_metrics outside a prepared loader does the same)
            (last_metric, counted_once(SPLITS["train"] // 2, EVAL_SAMPLES, 2 * EVAL_SAMPLES))),
    Example("by_feature/ddp_comm_hook", ("--ddp_comm_hook", "fp16")),
    Example("by_feature/deepspeed_with_config_support",
            ("--model_name_or_path", "HuggingFaceTB/SmolLM-360M", "--dataset_name", "wikitext",
             "--dataset_config_name", "wikitext-2-raw-v1", "--block_size", "32", "--per_device_train_batch_size", "4",
             "--per_device_eval_batch_size", "4", "--num_train_epochs", "2", "--output_dir", "{out}"),
            (finite(r"epoch \d+: perplexity: (\S+)"), files("config.json")), own_accumulation_flag=True),
    Example("by_feature/early_stopping"),
    Example("by_feature/fsdp_with_peak_mem_tracking", ("--model_name_or_path", "bert-base-cased", "--output_dir", "{out}"),
            skip="measures GPU memory: its TorchTracemalloc sets `begin`/`end` only on CUDA/XPU/NPU, so on a CPU-only "
                 "machine it stops with AttributeError: 'TorchTracemalloc' object has no attribute 'end' (the script's own code)"),
    Example("by_feature/gradient_accumulation", own_accumulation_flag=True),
    Example("by_feature/gradient_accumulation_for_autoregressive_models", (),
            (finite(r"eval perplexity: (\S+)"),), own_accumulation_flag=True),
    Example("by_feature/local_sgd", own_accumulation_flag=True,   # Accelerate's LocalSGD also refuses FSDP/DeepSpeed
            refused={e: r"(?i)NotImplementedError: LocalSGD .*(FSDP|DeepSpeed)" for e in ("FSDP", "ZeRO-2", "ZeRO-3")}),
    Example("by_feature/memory"),
    Example("by_feature/multi_process_metrics"),
    Example("by_feature/profiler", (), (*NLP, printed("Self CPU"))),
    Example("by_feature/schedule_free"),
    Example("by_feature/tracking", ("--with_tracking", "--project_dir", "{out}"), (*NLP, files("**/*tfevents*")),
            extra_env={"WANDB_MODE": "offline", "WANDB_DIR": "{out}"}),
    Example("config_yaml_templates/run_me", (),   # prints the state its config gives, as Accelerate words it
            (printed("Accelerator state from the current environment:", "Num processes:", "Mixed precision type:"),)),
    Example("torch_native_parallelism/nd_parallel",
            # 5 steps: from the 6th its PerformanceTracker reads GPU memory statistics (a CPU has none)
            ("--sequence-length", "16", "--num-steps", "5", "--checkpoint-frequency", "2", "--save-dir", "{out}/outputs"),
            (finite(r"Step 4/5, Loss: (\S+)"), printed("Training completed!"),
             files("outputs/NousResearch/Hermes-3-Llama-3.1-8B/*.safetensors")),
            # tp alone: transformers 5.24's from_pretrained(tp_plan="auto") builds its own mesh of tp_size processes
            # (it no longer takes device_mesh=), so on 4 processes tp 2 x dp_shard 2 stops in from_pretrained, on
            # Accelerate too; prepare's side of 2-D with a sliced model: tests/scripts/accelerate_parallelism.py
            engines=("TP",), engine_args={"TP": ("--tp-size", "2")},
            extra_env={"WANDB_MODE": "offline", "WANDB_DIR": "{out}"}),
    Example("by_feature/megatron_lm_gpt_pretraining",
            skip="needs Megatron-LM and GPUs (cadence's model-parallel strategy is the way to tensor parallelism)"),
]


def first_error(text: str) -> str:
    """The first exception line in a failed run's output (`XxxError: ...`), else its last line."""
    for line in text.splitlines():
        if re.match(r"^\s*(\[rank\d+\]:?\s*)?[\w.]*(Error|Exception|Interrupt)\b.*", line) and "Warning" not in line:
            return line.strip()[:240]
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip()[:240] if lines else "(no output)"


def launch_command(library: str, nproc: int, flags: tuple[str, ...], script: Path, args: list[str]) -> list[str]:
    if library == "accelerate":
        # Accelerate takes one of --cpu / --multi_gpu / --use_fsdp / --use_deepspeed; `--cpu --num_processes 2`
        # starts one process, and `--multi_gpu` on a machine without GPUs starts N processes on gloo (MULTI_CPU)
        engine = [f for f in flags if f in ("--use_fsdp", "--use_deepspeed")]
        kind = () if engine else ("--multi_gpu",) if nproc > 1 else ("--cpu",)
        port = ("--main_process_port", str(_free_port())) if nproc > 1 else ()   # runs side by side (--jobs)
        return [sys.executable, "-m", "accelerate.commands.launch", *kind, "--num_processes", str(nproc), *port,
                *flags, str(script), *args]
    return [sys.executable, "-m", "cadence.cli", "launch", "--cpu", "--num_processes", str(nproc), *flags,
            str(script), *args]


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(ex: Example, engine: str, scripts: Path, env: dict[str, str], work: Path, library: str = "cadence",
            timeout: float = 900) -> tuple[bool, str, float]:
    """(passed, what failed or "", seconds) for one example on one engine, both launches if it resumes."""
    nproc, flags = ENGINES[engine]
    out = work / f"{ex.script.replace('/', '__')}__{engine.replace(' ', '_')}"
    out.mkdir(parents=True, exist_ok=True)
    accumulation = ("--gradient_accumulation_steps", "2") if engine == "accumulation" else ()
    fill = {"out": str(out), "pets": str(work.parent / "standins" / "pets")}
    run_env = cadence_env(**env, **{k: v.format(**fill) for k, v in ex.extra_env.items()})
    run_env["PYTHONPATH"] = os.pathsep.join([str(HERE / "standins" / ex.site), run_env["PYTHONPATH"]])
    if library == "accelerate" and nproc > 1 and not flags:
        # without a GPU, Accelerate's `--multi_gpu` processes each train alone (DistributedType.NO, one process)
        # unless told to use the CPU: then they form one MULTI_CPU (gloo) run, the DDP cadence's runs are
        run_env["ACCELERATE_USE_CPU"] = "true"
    start = time.time()
    for args, checks in ((ex.args, ex.checks), (ex.resume, ex.resume_checks)):
        if args is None:
            break
        script_args = ([a.format(**fill) for a in args] + list(ex.engine_args.get(engine, ())) +
                       list(accumulation if ex.own_accumulation_flag else ()))
        cmd = launch_command(library, nproc, flags + (() if ex.own_accumulation_flag else accumulation),
                             scripts / f"{ex.script}.py", script_args)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=run_env, cwd=out)
        except subprocess.TimeoutExpired as e:
            # real Accelerate's 2-process CPU runs now and then hang at exit, in ProcessGroupGloo's destructor
            # (its workers end with the group alive): say whether the script had finished its work by then
            done = Run(_text(e.stdout), _text(e.stderr), out)
            finished = not [p for check in checks for p in check(done)]
            return False, f"timed out after {timeout:.0f} s" + (" (its checks had passed: hung at exit)" if finished
                                                                  else ""), time.time() - start
        (out / "stdout.txt").write_text(proc.stdout)
        (out / "stderr.txt").write_text(proc.stderr)
        if proc.returncode != 0 and engine in ex.refused:
            found = re.search(ex.refused[engine], proc.stderr)
            return bool(found), f"refused: {found[0] if found else first_error(proc.stderr)}", time.time() - start
        if proc.returncode != 0:
            return False, f"exit {proc.returncode}: {first_error(proc.stderr + proc.stdout)}", time.time() - start
        problems = [p for check in checks for p in check(Run(proc.stdout, proc.stderr, out))]
        if problems:
            return False, "; ".join(problems), time.time() - start
    return True, "", time.time() - start


def prepare(work: Path, library: str = "cadence") -> tuple[Path, dict[str, str]]:
    """Swapped (or, for `accelerate`, untouched) scripts and the stand-ins' environment, under `work`."""
    env = build(work / "standins")
    scripts = work / f"scripts_{library}"
    swap(scripts, library)
    return scripts, env


def status_table(results: dict[tuple[str, str], tuple[bool, str, float]], engines: list[str], library: str,
                 command: str) -> str:
    rows = sorted({s for s, _ in results}, key=[e.script for e in EXAMPLES].index)
    passed = sum(ok and not why for ok, why, _ in results.values())
    refused = sum(ok and why.startswith("refused") for ok, why, _ in results.values())
    ran = sum(1 for ok, why, _ in results.values() if not why.startswith("skipped"))
    lines = [f"# Accelerate's examples on {library}", "",
             f"`{command}`: {passed} of {ran} runs pass, {refused} refused with Accelerate's error ({sum(t for _, _, t in results.values()) / 60:.0f} min of "
             "runs, summed).", "",
             "| example | " + " | ".join(engines) + " |", "|---|" + "---|" * len(engines)]
    failures = []
    for script in rows:
        cells = []
        for engine in engines:
            if (script, engine) not in results:
                cells.append("")
                continue
            ok, why, _ = results[script, engine]
            cells.append(("refused" if why.startswith("refused") else "pass") if ok else
                         ("skip" if why.startswith("skipped") else "FAIL"))
            line = f"- {script}: {why}" if why.startswith("skipped") else f"- {script} / {engine}: {why}"
            if (not ok or why) and line not in failures:
                failures.append(line)
        lines.append(f"| {script} | " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", "## Failures, refusals and skips", ""] + failures) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="example scripts (e.g. nlp_example by_feature/tracking)")
    parser.add_argument("--engines", nargs="*", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--library", default="cadence", choices=["cadence", "accelerate"])
    parser.add_argument("--work", type=Path, help="folder for stand-ins and runs (default: a new temporary one)")
    parser.add_argument("--status", type=Path, help="write the pass/fail table here (markdown)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time")
    parser.add_argument("--table", action="store_true", help="only write the table of the --work folder's results")
    parser.add_argument("--again", action="store_true",
                        help="run everything again (by default a --work folder's passed runs are kept)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="accelerate_examples_"))
    scripts, env = prepare(work, args.library)
    examples = [e for e in EXAMPLES if not args.only or e.script in args.only]
    command = "python tests/accelerate/examples/matrix.py " + " ".join(sys.argv[1:])
    results = {}
    done_file = work / "results.jsonl"
    if done_file.exists() and not args.again:    # keep earlier passes in this folder, run failures again
        for line in done_file.read_text().splitlines():
            r = json.loads(line)
            keep = [e.script for e in examples if not e.skip]
            if (r["passed"] or args.table) and r["script"] in keep and r["engine"] in args.engines:
                results[r["script"], r["engine"]] = (r["passed"], r["why"], r["seconds"])
    todo = [(ex, engine) for engine in args.engines for ex in examples      # every script on an engine first
            if engine in ex.engines and (ex.script, engine) not in results]
    for ex, engine in todo:
        if ex.skip:
            results[ex.script, engine] = (False, f"skipped: {ex.skip}", 0.0)

    def one(item):
        ex, engine = item
        result = run_one(ex, engine, scripts, env, work / "runs", args.library, args.timeout)
        ok, why, secs = results[ex.script, engine] = result
        with open(done_file, "a") as f:
            f.write(json.dumps({"script": ex.script, "engine": engine, "passed": ok, "why": why, "seconds": secs}) + "\n")
        print(f"{'PASS' if ok else 'FAIL'} {ex.script} [{engine}] {secs:.0f}s {why}", flush=True)
        if args.status:
            args.status.write_text(status_table(results, args.engines, args.library, command))

    if args.table:
        todo = []
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(one, [(ex, engine) for ex, engine in todo if not ex.skip]))
    table = status_table(results, args.engines, args.library, command)
    if args.status:
        args.status.write_text(table)
    print(table)
    sys.exit(0 if all(ok or why.startswith("skipped") for ok, why, _ in results.values()) else 1)


if __name__ == "__main__":
    main()
