"""Worker entry of `cadence launch --tpu --main_training_function NAME`: `python -m cadence.distributed.xla_main
script.py NAME [script args]` imports the script and calls NAME() (see launch_xla)."""

import sys

from cadence.distributed.launch_xla import call_main_function

if __name__ == "__main__":
    call_main_function(sys.argv[1], sys.argv[2], sys.argv[3:])
