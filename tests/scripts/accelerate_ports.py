"""Runs the ports of Accelerate's test scripts (tests/scripts/accelerate_ports/) on however many processes were launched.

Usage: accelerate_ports.py TMPDIR NAME... (test_script, test_ops, test_metrics, test_sync, test_checkpointing).
Prints "<NAME> OK" on the main process after each passes.
"""

import importlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "accelerate_ports"))

from cadence import PartialState  # noqa: E402

if __name__ == "__main__":
    tmp, names = Path(sys.argv[1]), sys.argv[2:]
    os.chdir(tmp)
    state = PartialState()
    for name in names:
        sys.argv = [name, str(tmp / name)]
        importlib.import_module(name).main()
        state.wait_for_everyone()
        state.print(f"{name} OK")
