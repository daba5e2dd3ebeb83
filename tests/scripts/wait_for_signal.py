"""Launched on 2 processes: each rank prints `STARTED <pid>` and waits (no process group).

With `marker <dir>`: on SIGTERM or SIGUSR1 a rank writes `<dir>/rank<N>.<SIGNAME>` and exits
128+signum (a stand-in for fit's preemption handling). With `ignore`: SIGTERM is ignored, so
the launcher has to kill the rank after its grace period.
"""

import os
import signal
import sys
import time
from pathlib import Path


def on_signal(signum, frame):
    Path(sys.argv[2], f"rank{os.environ['RANK']}.{signal.Signals(signum).name}").write_text(str(os.getpid()))
    os._exit(128 + signum)


if sys.argv[1:2] == ["marker"]:
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, on_signal)
elif sys.argv[1:2] == ["ignore"]:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(f"STARTED {os.getpid()}", flush=True)
for _ in range(600):
    time.sleep(1)
