"""docs/xla.md's code (docs/examples/xla.py) run as the page says, in the XLA environment (see conftest.py): one
process on 4 of XLA's virtual CPU devices, through the four contexts the page shows."""

import json
import re

import pytest

from xla_env import REPO, run_xla

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # a torch_xla subprocess (compiles: a minute when loaded)


def test_xla_page_example_trains_in_every_context(xla_python):
    proc = run_xla(xla_python, str(REPO / "docs" / "examples" / "xla.py"), devices=4)
    assert proc.returncode == 0, f"xla.py exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    fits = re.search(r"devices 4: valid loss per epoch, per context (\[.*\])", proc.stdout)
    assert fits, proc.stdout
    fits = json.loads(fits.group(1))   # a list of lists of floats, printed by the script
    assert len(fits) == 4 and all(len(f) == 2 for f in fits), fits
    assert fits[0][1] < 0.5 * fits[0][0], fits                       # one device: it learns
    assert all(f[1] < fits[0][0] for f in fits[1:]), fits             # each later context trains the same model on
    assert fits[-1][1] < 0.05, fits                                   # ... to a small loss: x0 + x1 is learnt
