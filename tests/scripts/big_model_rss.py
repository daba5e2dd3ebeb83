"""Run by tests/test_big_modeling.py in a fresh process: load a checkpoint under a memory budget, report peak RSS.

argv: checkpoint, input file, output file, d, n_blocks, cpu budget (bytes). Writes the output tensor
and {"baseline_kib", "peak_kib", "device_map"} as JSON next to it. Peak RSS is the kernel's VmHWM,
reset (/proc/self/clear_refs) once the empty model is built, so it covers only loading and forward.
"""

import json
import sys

import torch

from cadence.big_modeling import init_empty_weights, load_checkpoint_and_dispatch
from tests.big_models import Net


def vm(field: str) -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))


checkpoint, inp, out, d, n_blocks, budget = sys.argv[1:7]
x = torch.load(inp, weights_only=True)
with init_empty_weights():
    model = Net(d=int(d), n_blocks=int(n_blocks))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
baseline = vm("VmRSS")
model = load_checkpoint_and_dispatch(model, checkpoint, max_memory={"cpu": int(budget)}, no_split_module_classes=["Block"])
with torch.no_grad():
    y = model(x)
torch.save(y, out)
with open(out + ".json", "w") as f:
    json.dump({"baseline_kib": baseline, "peak_kib": vm("VmHWM"), "device_map": model.hf_device_map}, f)
