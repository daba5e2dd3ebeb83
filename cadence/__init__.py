"""cadence: a fastai-style Learner whose one event loop trains on one device or many.

>>> from cadence import Learner, DataLoaders, accuracy
>>> learn = Learner(DataLoaders.from_dsets(train_ds, valid_ds, bs=64), model,
...                 loss_func=nn.CrossEntropyLoss(), metrics=accuracy)
>>> learn.fit_one_cycle(3, lr_max=1e-2)
"""

from .version import __version__

from .accelerate import (Accelerator, DistributedDataParallelKwargs, DummyOptim, DummyScheduler, GradScalerKwargs,
                         InitProcessGroupKwargs, PartialState, ProjectConfiguration, find_executable_batch_size,
                         set_seed)
# Accelerate's top-level names (accelerate/__init__.py) that cadence.accelerate implements
from .accelerate import (DataLoaderConfiguration, DDPCommunicationHookType, DeepSpeedPlugin, DistributedType,
                         FullyShardedDataParallelPlugin, GradientAccumulationPlugin, ParallelismConfig, ProfileKwargs,
                         synchronize_rng_states)
from .accelerate import AutocastKwargs
from .accelerate.imports import is_rich_available   # importable as from accelerate; not in __all__ (no API entry)
from .accelerate.skip_batches import skip_first_batches
from .big_modeling import (dispatch_model, infer_auto_device_map, init_empty_weights, init_on_device,
                           load_checkpoint_and_dispatch)
from .big_modeling.offload import cpu_offload, cpu_offload_with_hook, disk_offload, load_checkpoint_in_model
from .callbacks import (Checkpoint, CSVTracker, DistributedTrainer, EarlyStopping, GeneralTracker, GradAccum, GradClip,
                        MixedPrecision, MonitorCallback, ProgressCallback, ReduceLROnPlateau, SaveModel, TensorBoardTracker,
                        TerminateOnNaN, Tracker, WandbTracker)
from .distributed.data import DistributedDL
from .distributed.env import (is_distributed, is_local_main_process, is_main_process, local_rank, rank, setup_distrib,
                              teardown_distrib, world_size)
from .distributed.notebook import debug_launcher, notebook_launcher
from .distributed.ops import (broadcast, gather, gather_for_metrics, get_logger, local_main_process_first,
                              main_print, main_process_first, on_local_main_process, on_main_process,
                              pad_across_processes, rank0_first, reduce, wait_for_everyone)
from .trainer.callback import Callback, Order
from .trainer.data import DataLoaders, to_device
from .trainer.events import (CancelBackwardException, CancelBatchException, CancelEpochException, CancelException,
                             CancelFitException, CancelStepException, CancelTrainException, CancelValidateException,
                             CancelValidException, Event)
from .trainer.load import load_learner
from .trainer.learner import Learner
from .trainer.metrics import (AccumMetric, AvgLoss, AvgMetric, AvgSmoothLoss, Metric, SumMetric, accuracy, error_rate,
                              sum_metric, top_k_accuracy)
from .trainer.metrics_classification import (BalancedAccuracy, Dice, F1Score, MatthewsCorrCoef, Precision, Recall, RocAuc,
                                             RocAucBinary, RocAucMulti, accuracy_multi, skm_to_cadence)
from .trainer.metrics_regression import (PearsonCorrCoef, Perplexity, SpearmanCorrCoef, exp_rmspe, mae, mse, msle,
                                         rmse)
from .trainer.epoch_record import EpochRecord
from .trainer.recorder import Recorder
from .trainer.lr_find import LRFinder, SuggestedLRs, minimum, slide, steep, valley
from .trainer.schedule import (ParamScheduler, SchedCos, SchedExp, SchedLin, SchedNo, SchedPoly, combine_scheds,
                               combined_cos)
from .trainer.transfer import BnFreeze, FitStage
# fastai names
from .callbacks.mixup import CutMix, MixUp
from .callbacks.short_epoch import ShortEpochCallback
from .callbacks.fastai_names import (CSVLogger, EarlyStoppingCallback, GradientAccumulation, GradientClip,
                                     SaveModelCallback, TensorBoardCallback, TerminateOnNaNCallback, WandbCallback)
from .trainer.callback import before_batch_cb
from .trainer.data import to_detach
from .trainer.metrics import ValueMetric
from .trainer.recorder import SmoothLoss
from .trainer.losses import (BaseLoss, BCEWithLogitsLossFlat, CrossEntropyLossFlat, LabelSmoothingCrossEntropy,
                             LabelSmoothingCrossEntropyFlat, MSELossFlat)
from .trainer.metrics_classification import FBeta
from .trainer.metrics_regression import R2Score

__all__ = [
    "__version__", "Learner", "load_learner", "DataLoaders", "to_device", "Callback", "Order", "Event", "Recorder", "ProgressCallback",
    "CancelException", "CancelFitException", "CancelEpochException", "CancelTrainException", "CancelValidateException",
    "CancelValidException", "CancelBatchException", "CancelBackwardException", "CancelStepException",
    "Metric", "SumMetric", "AccumMetric", "AvgMetric", "AvgLoss", "AvgSmoothLoss", "sum_metric",
    "accuracy", "error_rate", "top_k_accuracy", "rmse", "mse", "mae", "msle", "exp_rmspe", "Perplexity",
    "PearsonCorrCoef", "SpearmanCorrCoef", "accuracy_multi", "F1Score", "Precision", "Recall", "RocAuc", "RocAucBinary",
    "RocAucMulti", "MatthewsCorrCoef", "BalancedAccuracy", "Dice", "skm_to_cadence",
    "ParamScheduler", "LRFinder", "SuggestedLRs", "SchedLin", "SchedCos", "SchedNo", "SchedExp", "SchedPoly",
    "combine_scheds", "combined_cos", "valley", "slide", "minimum", "steep", "BnFreeze", "FitStage",
    "DistributedTrainer", "DistributedDL", "rank", "world_size", "local_rank", "is_main_process",
    "is_local_main_process", "is_distributed", "setup_distrib", "teardown_distrib", "notebook_launcher",
    "debug_launcher", "broadcast", "gather", "gather_for_metrics", "get_logger", "local_main_process_first",
    "main_print", "main_process_first", "on_local_main_process", "on_main_process", "pad_across_processes",
    "rank0_first", "reduce", "wait_for_everyone",
    "Checkpoint", "CSVTracker", "EarlyStopping", "GeneralTracker", "GradAccum", "GradClip", "MixedPrecision",
    "MonitorCallback", "ReduceLROnPlateau", "SaveModel", "TensorBoardTracker", "TerminateOnNaN", "Tracker", "WandbTracker",
    "Accelerator", "PartialState", "DistributedDataParallelKwargs", "GradScalerKwargs", "InitProcessGroupKwargs",
    "ProjectConfiguration", "DummyOptim", "DummyScheduler", "find_executable_batch_size", "set_seed",
    "DataLoaderConfiguration", "ParallelismConfig", "DDPCommunicationHookType", "DeepSpeedPlugin", "DistributedType",
    "FullyShardedDataParallelPlugin", "GradientAccumulationPlugin", "ProfileKwargs", "synchronize_rng_states",
    "init_empty_weights", "init_on_device", "infer_auto_device_map", "dispatch_model", "load_checkpoint_and_dispatch",
    "AutocastKwargs", "skip_first_batches", "cpu_offload", "disk_offload", "load_checkpoint_in_model",
    "cpu_offload_with_hook",
    # fastai names (issue 21)
    "CutMix", "MixUp", "ShortEpochCallback", "SaveModelCallback", "EarlyStoppingCallback", "GradientAccumulation",
    "GradientClip", "CSVLogger", "TensorBoardCallback", "WandbCallback", "TerminateOnNaNCallback", "before_batch_cb", "to_detach", "ValueMetric", "SmoothLoss", "EpochRecord",
    "BaseLoss", "CrossEntropyLossFlat", "BCEWithLogitsLossFlat", "MSELossFlat", "LabelSmoothingCrossEntropy",
    "LabelSmoothingCrossEntropyFlat", "FBeta", "R2Score",
]

# Accelerate's top-level names cadence has no counterpart for: importing one says what to use instead
from .utils.unavailable import module_getattr as _module_getattr  # noqa: E402

__getattr__ = _module_getattr(__name__, {
    "prepare_pippy": "pipeline-parallel inference is not in cadence; spread a big model over devices with "
                     "load_checkpoint_and_dispatch(model, checkpoint, device_map='auto'), or give each process its "
                     "prompts with PartialState().split_between_processes(prompts)"}, "accelerate")
