"""Experiment trackers: `Tracker` feeds TensorBoard, W&B, CSV or your own `GeneralTracker` subclass.

tensorboard and wandb are optional: imported only when such a tracker is built.

>>> learn.fit(3, cbs=Tracker(["tensorboard", "csv"], project="digits"))
"""

from .base import GeneralTracker
from .tracker import Tracker
from .csv import CSVTracker
from .tensorboard import TensorBoardTracker
from .wandb import WandbTracker

__all__ = ["Tracker", "GeneralTracker", "TensorBoardTracker", "WandbTracker", "CSVTracker"]
