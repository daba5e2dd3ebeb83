"""Training features, one callback per module.

>>> from cadence.callbacks import MixedPrecision, GradAccum, GradClip, Checkpoint, Tracker, EarlyStopping
>>> from cadence.callbacks import SaveModelCallback, EarlyStoppingCallback, CSVLogger   # fastai's names
"""

from .accumulate import GradAccum
from .checkpoint import Checkpoint
from .clip import GradClip
from .distributed import DistributedTrainer
from .early_stop import EarlyStopping, MonitorCallback, ReduceLROnPlateau, SaveModel, TerminateOnNaN
from .fastai_names import (CSVLogger, EarlyStoppingCallback, GradientAccumulation, GradientClip, SaveModelCallback,
                           TensorBoardCallback, TerminateOnNaNCallback, WandbCallback)
from .precision import MixedPrecision
from .progress import ProgressCallback
from .tracking import CSVTracker, GeneralTracker, TensorBoardTracker, Tracker, WandbTracker
from . import learner_methods  # noqa: F401  attaches to_fp16, distrib_ctx, save_state, no_bar... to Learner

__all__ = ["GradAccum", "Checkpoint", "GradClip", "DistributedTrainer", "EarlyStopping", "MonitorCallback", "ReduceLROnPlateau", "SaveModel",
           "TerminateOnNaN", "MixedPrecision", "ProgressCallback", "CSVTracker", "GeneralTracker", "TensorBoardTracker",
           "Tracker", "WandbTracker",
           # fastai's names (fastai_names.py)
           "SaveModelCallback", "EarlyStoppingCallback", "GradientAccumulation", "GradientClip", "CSVLogger",
           "TensorBoardCallback", "WandbCallback", "TerminateOnNaNCallback"]
