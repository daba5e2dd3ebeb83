"""`accelerate.launchers` under cadence: run a function on several processes from Python (a notebook, a test).

>>> from cadence.launchers import debug_launcher, notebook_launcher
>>> notebook_launcher(train, args=(0.1,), num_processes=2)     # `train` defined in the notebook
"""

from .distributed.notebook import debug_launcher, notebook_launcher
from .utils.unavailable import REPLACEMENTS, module_getattr

__all__ = ["notebook_launcher", "debug_launcher"]

__getattr__ = module_getattr(__name__, {"PrepareForLaunch": REPLACEMENTS["PrepareForLaunch"]}, "accelerate.launchers")
