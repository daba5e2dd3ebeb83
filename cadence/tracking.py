"""`accelerate.tracking` under cadence: write your own tracker by subclassing `GeneralTracker` and give it to
`Accelerator(log_with=[...])`; the named ones are `log_with="tensorboard"`, `"wandb"`, `"csv"`.

>>> from cadence.tracking import GeneralTracker, on_main_process
>>> class PrintTracker(GeneralTracker):
...     name, requires_logging_directory = "print", False
...     @on_main_process
...     def log(self, values, step=None, **kwargs): print(step, values)
>>> accelerator = Accelerator(log_with=[PrintTracker()])
"""

from .accelerate.enums import LoggerType
from .callbacks.tracking.base import GeneralTracker
from .callbacks.tracking.tensorboard import TensorBoardTracker
from .callbacks.tracking.wandb import WandbTracker as WandBTracker
from .distributed.ops import on_main_process
from .utils.unavailable import module_getattr

__all__ = ["GeneralTracker", "on_main_process", "LoggerType", "TensorBoardTracker", "WandBTracker"]

_OWN = ("not built into cadence: subclass cadence.tracking.GeneralTracker (name, tracker, log, "
        "store_init_configuration) and pass an instance in Accelerator(log_with=[...])")
_NAMED = "Accelerator(log_with=...) takes the names tensorboard, wandb, csv, 'all', or GeneralTracker instances"
__getattr__ = module_getattr(__name__, {
    **dict.fromkeys(["CometMLTracker", "AimTracker", "MLflowTracker", "ClearMLTracker", "DVCLiveTracker",
                     "SwanLabTracker", "TrackioTracker"], _OWN),
    **dict.fromkeys(["LOGGER_TYPE_TO_CLASS", "filter_trackers", "get_available_trackers", "register_tracker_class"],
                    _NAMED),
}, "accelerate.tracking")
