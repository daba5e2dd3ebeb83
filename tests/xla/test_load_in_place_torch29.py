"""A load into a trained optimizer (`accelerator.load_state`, `Strategy.load_checkpoint`'s in-place route) on the
oldest torch the XLA environment gives (2.9: its file reader has no `get_record_size`, which torch 2.10 added):
exact, and still read from the file into the optimizer's own tensors."""

import json

SCRIPT = r'''
import json, sys
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from cadence import Accelerator
from cadence.distributed.load_in_place import file_offsets, load_mapped

torch.manual_seed(0)
x = torch.randn(64, 8)
ds = TensorDataset(x, x.sum(1, keepdim=True))
model = nn.Linear(8, 1)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
acc = Accelerator()
model, opt, dl = acc.prepare(model, opt, DataLoader(ds, batch_size=16))

def train():
    for xb, yb in dl:
        acc.backward(nn.functional.mse_loss(model(xb), yb)); opt.step(); opt.zero_grad()

train()
directory = sys.argv[1]
acc.save_state(directory)
saved_opt = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())}
saved_model = {k: v.clone() for k, v in model.state_dict().items()}
train()  # the live state moves away from the file's
live = [id(t) for s in opt.state.values() for t in s.values()]
acc.load_state(directory)
mapped = load_mapped(directory + "/optimizer.pt")
tensors = [t for s in mapped["state"].values() for t in s.values()]
print(json.dumps({
    "torch": torch.__version__,
    "has_get_record_size": hasattr(torch._C.PyTorchFileReader, "get_record_size"),
    "opt_exact": all(torch.equal(opt.state[p][k], v)
                     for p, s in zip(opt.state, saved_opt.values()) for k, v in s.items()),
    "model_exact": all(torch.equal(v, saved_model[k]) for k, v in model.state_dict().items()),
    "same_tensors": [id(t) for s in opt.state.values() for t in s.values()] == live,
    "offsets_found": len(file_offsets(directory + "/optimizer.pt", tensors)) == len(tensors) > 0,
}))
'''


def test_load_state_into_a_trained_optimizer_on_torch_2_9_is_exact_and_in_place(xla_python, tmp_path):
    from xla_env import run_xla

    script = tmp_path / "load_in_place_torch29.py"
    script.write_text(SCRIPT)
    # an absolute path: run_xla's tests/scripts/<name> is then this file
    proc = run_xla(xla_python, str(script), str(tmp_path / "state"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["torch"].startswith("2.9"), result
    assert result == {**result, "opt_exact": True, "model_exact": True, "same_tensors": True, "offsets_found": True}
