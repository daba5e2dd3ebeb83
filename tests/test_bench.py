"""The benchmark script runs and prints its table (its numbers are read by people, not asserted)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.slow
@pytest.mark.long
def test_overhead_bench_prints_a_row_per_framework():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "overhead.py"), "--smoke"], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    cells = [re.split(r"\s{2,}", line.strip()) for line in out.stdout.splitlines()]
    rows = {c[0]: c[1:] for c in cells}
    assert len(rows["raw loop"]) == 5 and rows["raw loop"][1] == "1.00"  # µs, ratio, µs, ratio, start
    assert len(rows["cadence"]) == 6 and all(v.endswith("s") for v in rows["cadence"][4:])  # + start, import
    assert float(rows["cadence"][0]) > 0 and len(rows["cadence, live bar"]) == 4
    assert float(rows["cadence accel"][0]) > 0 and len(rows["cadence accel"]) == 4   # the Accelerator loop
    assert "after the shared imports" in out.stdout


@pytest.mark.slow
@pytest.mark.long
def test_live_bar_bench_compares_the_bar_with_plain_lines():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "live_bar.py"), "--smoke"], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    live = next(line for line in out.stdout.splitlines() if line.startswith("live bar"))
    assert "ratio" in live and float(live.split()[-2]) > 0  # redraws per second: the bar was drawn



def _bench_table(script, *args) -> list[list[str]]:
    """Run a bench script; return the cells of its markdown table's body rows."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.stdout.splitlines()
            if line.startswith("|")]
    return [r for r in rows[1:] if not r[0].startswith("---")]


@pytest.mark.slow
@pytest.mark.long
def test_checkpoint_bench_measures_saves_resumes_and_memory_per_engine():
    rows = _bench_table("checkpoint.py", "--procs", "2", "--engines", "ddp", "zero3", "--layers", "1", "--width", "512")
    assert [r[:2] for r in rows] == [["ddp", "2"], ["zero3", "2"]]
    for r in rows:
        assert len(r) == 17 and all(float(v) >= 0 for v in r[2:]), r  # every cell measured (a tiny model's times
        # may round to 0)
        assert all(float(v) > 0 for v in r[2:6] + r[13:14]), r  # size, throughputs, their ratio, resume/plain
        assert 0.9 < float(r[14]) and 0.9 < float(r[15]) and 0.9 < float(r[16]), r  # peaks: resident, no-save fit


@pytest.mark.slow
@pytest.mark.long
def test_engine_step_bench_compares_each_engine_with_its_hand_written_loop():
    rows = _bench_table("ddp.py", "--smoke")
    assert [r[0] for r in rows] == ["raw DDP", "cadence DDP", "raw FSDP2", "cadence FSDP2", "raw TP", "cadence TP",
                                    "raw PP", "cadence PP", "raw DeepSpeed", "cadence DeepSpeed"]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)  # ms/step and ratio measured


@pytest.mark.slow
def test_full_shard_and_zero3_hold_half_the_model_state_of_ddp_on_two_processes():
    rows = {r[1]: r for r in _bench_table("memory.py", "--nproc", "2")}
    total = {name: float(r[5]) for name, r in rows.items()}         # params + grads + optimizer state
    assert total["FSDP FULL_SHARD"] <= total["DDP"] / 2 * 1.05   # the target: 1/N of DDP + 5%
    assert total["ZeRO-3 bf16"] <= total["DDP"] / 2 * 1.05
    assert total["TP x FSDP (tp=2, dp=rest)"] <= total["DDP"] / 2 * 1.05   # tensor parallelism: 1/tp + 5%
    assert total["DDP"] > 20                                      # params + grads + Adam state of a 1.6M-param MLP
    assert float(rows["ZeRO-3 bf16"][8]) > 0.4                   # its gradient bucket (one 512x512 layer), shown apart


@pytest.mark.slow
@pytest.mark.long
def test_the_compile_bench_compares_regional_and_whole_model_compilation():
    rows = [r for r in _bench_table("compile_regions.py", "--smoke") if r[0] == "2"]   # --smoke: 2 layers
    assert [(r[1], r[6]) for r in rows] == [("eager", "0"), ("full", "1"), ("regional", "5")]   # mode, graphs
    assert all(float(r[3]) > 0 for r in rows)
