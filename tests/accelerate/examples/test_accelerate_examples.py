"""Accelerate's own example scripts, imports swapped to cadence, run through `cadence launch` (a slice).

The scripts are Accelerate's, unmodified (upstream/, see README.md); downloads resolve to the offline
stand-ins of standins/build.py, since the network cannot exist here. The whole matrix (every script on
1 process, DDP, FSDP, ZeRO-2/3, bf16, accumulation; the tensor-parallel one on TP) is `make test-examples`; this is the part `make test` runs.
"""

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from matrix import EXAMPLES, prepare, run_one  # noqa: E402
from swap import UPSTREAM, swap  # noqa: E402


@pytest.fixture(scope="module")
def examples_work(tmp_path_factory):
    work = tmp_path_factory.mktemp("accelerate_examples")
    scripts, env = prepare(work)
    return work, scripts, env


def test_the_swap_changes_only_accelerate_imports(tmp_path):
    """Every script keeps its body: the only lines that differ are its `accelerate` imports, now `cadence`."""
    swap(tmp_path)
    for src in UPSTREAM.rglob("*.py"):
        before = src.read_text().splitlines()
        after = (tmp_path / src.relative_to(UPSTREAM)).read_text().splitlines()
        assert len(before) == len(after)
        changed = [(a, b) for a, b in zip(before, after) if a != b]
        assert changed, src.name
        for a, b in changed:
            assert re.match(r"\s*(from|import) accelerate\b", a) and b == a.replace("accelerate", "cadence", 1)
        assert "Licensed under the Apache License, Version 2.0" in src.read_text()[:600], src.name


def case(script: str, engine: str, *marks: pytest.MarkDecorator):
    return pytest.param(script, engine, marks=marks, id=f"{script}-{engine}")


@pytest.mark.slow
@pytest.mark.parametrize("script,engine", [
    case("nlp_example", "1 process", pytest.mark.long),  # tests/accelerate/test_accelerate_example.py: 2 processes
    case("complete_nlp_example", "DDP"),
    case("by_feature/multi_process_metrics", "ZeRO-2"),
    case("torch_native_parallelism/nd_parallel", "TP")])   # from_pretrained(tp_plan="auto"), then prepare
def test_accelerate_example_runs_unchanged(examples_work, script, engine):
    """The script reaches its accuracy floor (from far below chance), counts each eval sample once, resumes."""
    work, scripts, env = examples_work
    example = next(e for e in EXAMPLES if e.script == script)
    passed, why, _ = run_one(example, engine, scripts, env, work / "runs", timeout=300)
    assert passed, why
