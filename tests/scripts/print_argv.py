"""Launched on N processes: each rank prints `ARGV <rank> <json of sys.argv[1:]>` (the arguments it was given)."""

import json
import os
import sys

print(f"ARGV {os.environ['RANK']} {json.dumps(sys.argv[1:])}", flush=True)
