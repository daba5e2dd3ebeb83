"""Run by tests/test_big_modeling.py in a fresh process: load a checkpoint under a memory budget, report peak RSS.

argv: checkpoint, input file, output file, d, n_blocks, cpu budget (bytes). Writes the output tensor
and {"baseline_kib", "peak_kib", "anon_kib", "file_kib", "device_map"} as JSON next to it. Peak RSS is
the kernel's VmHWM, reset (/proc/self/clear_refs) just before the load, so it covers building the
empty model (nothing: its weights are on the meta device), loading and forward. A small model is
loaded, streamed and run first, so the library code a first load runs is mapped before the baseline
(4.8 MiB of mapped files here without it, 0.1 MiB with it); anon_kib and file_kib split the
growth left at the end into private memory and mapped files.
"""

import json
import sys
import tempfile

import torch

from cadence.big_modeling import init_empty_weights, load_checkpoint_and_dispatch
from cadence.serialization import save_weights
from tests.big_models import Net, memory_kib


def load_and_run(checkpoint: str, d: int, n_blocks: int, budget: int, x: torch.Tensor):
    with init_empty_weights():
        model = Net(d=d, n_blocks=n_blocks)
    model = load_checkpoint_and_dispatch(model, checkpoint, max_memory={"cpu": budget}, no_split_module_classes=["Block"])
    with torch.no_grad():
        return model, model(x)


checkpoint, inp, out, d, n_blocks, budget = sys.argv[1:7]
x = torch.load(inp, weights_only=True)
with tempfile.TemporaryDirectory() as warm:          # the code a first load runs, mapped before the baseline
    save_weights(Net(d=64, n_blocks=4).state_dict(), f"{warm}/model.safetensors")
    load_and_run(warm, 64, 4, 40_000, x)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = memory_kib()
model, y = load_and_run(checkpoint, int(d), int(n_blocks), int(budget), x)
torch.save(y, out)
after = memory_kib()
with open(out + ".json", "w") as f:
    json.dump({"baseline_kib": before["VmRSS"], "peak_kib": after["VmHWM"], "device_map": model.hf_device_map,
               "anon_kib": after["RssAnon"] - before["RssAnon"], "file_kib": after["RssFile"] - before["RssFile"]}, f)
