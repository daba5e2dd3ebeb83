"""docs/xla.md's code, whole, on torch_xla's CPU device: `PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python
docs/examples/xla.py` in the XLA environment (`make setup-xla`; on a TPU VM, `PJRT_DEVICE=TPU`). The page shows
the section between the `--8<--` markers; tests/xla/test_xla_docs_example.py runs this file there and checks that
each context trained."""

# --8<-- [start:device]
import torch_xla                     # make the XLA device exist before the first backward of the process
import torch_xla.runtime as xr
xr.use_spmd()                        # with spmd=True below: before any tensor is on the device
torch_xla.device()
# --8<-- [end:device]

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from cadence import Callback, DataLoaders, Learner  # noqa: E402


class ValidLosses(Callback):
    """Keeps each fit's validation losses, one list per fit."""
    def __init__(self):
        self.fits = []

    def after_fit(self):
        self.fits.append([round(v["valid_loss"], 4) for v in self.learn.recorder.values])


torch.manual_seed(0)
x = torch.randn(256, 8)
ds = TensorDataset(x, x[:, :2].sum(1, keepdim=True))   # regress x0 + x1
learn = Learner(DataLoaders.from_dsets(ds, ds, bs=32), nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)),
                loss_func=nn.MSELoss(), lr=1e-2)
learn.remove_cb(learn.progress)
losses = ValidLosses()
learn.add_cb(losses)
# --8<-- [start:contexts]
with learn.distrib_ctx(strategy="xla"):                          # one process, one device
    learn.fit(2)
with learn.distrib_ctx(strategy="xla", spmd=True):               # one process, every device: batch sharded
    learn.fit(2)
with learn.distrib_ctx(strategy="xla", spmd=True, fsdp=True):    # ... and the weights too (FSDPv2)
    learn.fit(2)
with learn.distrib_ctx(strategy="xla", spmd=True, fsdp=True, mesh_shape=(2, 2)):   # ("data", "fsdp") mesh
    learn.fit(2)
# --8<-- [end:contexts]
print(f"devices {xr.global_runtime_device_count()}: valid loss per epoch, per context {losses.fits}")
