"""Runs the ports of Accelerate's test scripts (tests/scripts/accelerate_ports/) on however many processes were launched.

Usage: accelerate_ports.py TMPDIR NAME... (port_test_script, port_test_ops, port_test_metrics, port_test_sync,
port_test_checkpointing: Accelerate's test_script.py etc.; named port_* so that pytest does not collect them).
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
