"""docs/training.md's code, whole: `python docs/examples/training.py` (about ten seconds on a CPU, files under the
current directory). The page shows the sections between the `--8<--` markers; tests/test_docs_examples.py runs
this file and checks what the page says."""

import torch
from torch import nn
from torch.utils.data import TensorDataset


def make_ds(n: int) -> TensorDataset:
    """n items of 8 features in 3 well-separated clusters; the class is the cluster."""
    y = torch.randint(0, 3, (n,))
    return TensorDataset(CENTERS[y] + 0.5 * torch.randn(n, 8), y)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        return self.head(self.body(x))


torch.manual_seed(0)
CENTERS = 2 * torch.randn(3, 8)
train_ds, valid_ds, model = make_ds(512), make_ds(256), Net()

# --8<-- [start:loop]
import torch
from torch import nn
from cadence import Learner, DataLoaders, accuracy

dls = DataLoaders.from_dsets(train_ds, valid_ds, bs=64)       # or DataLoaders(train_dl, valid_dl)
learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=accuracy)
learn.lr_find()                                               # suggests a learning rate, plots loss vs lr
learn.fit_one_cycle(3, lr_max=1e-2)
preds, targs = learn.get_preds()
learn.save("stage1"); learn.load("stage1")                    # models/stage1/: model.safetensors + optimizer.pt
# --8<-- [end:loop]
print(f"get_preds: {tuple(preds.shape)} accuracy {(preds.argmax(1) == targs).float().mean():.3f}")

# --8<-- [start:callback]
from cadence import Callback, Order, CancelFitException

class StopAtLoss(Callback):
    order = Order.STOP
    def after_batch(self):
        if self.training and self.loss < 0.05: raise CancelFitException()

learn.fit(10, cbs=StopAtLoss())
# --8<-- [end:callback]
print(f"StopAtLoss: stopped in epoch {learn.epoch} of 10")

# --8<-- [start:features]
from cadence import GradAccum, GradClip, Checkpoint, Tracker, EarlyStopping

learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=accuracy,
                cbs=[GradAccum(steps=4), GradClip(1.0), Checkpoint(every_n_steps=200, keep_last=3),
                     Tracker("csv", project="digits"),   # or ["tensorboard", "wandb", "csv"]
                     EarlyStopping("valid_loss", patience=3)])
learn.to_bf16()                                    # or to_fp16() (GradScaler), to_fp32()
learn.fit_one_cycle(10, 1e-2, resume="auto")       # fresh the first time; after a crash or requeue, continues
                                                   # mid-epoch from the latest checkpoint, bitwise identical
# --8<-- [end:features]
print(f"features: {learn.step} optimizer steps in {learn.epoch + 1} epochs")

# --8<-- [start:fastai]
from cadence import F1Score, RocAuc, valley, slide, minimum, steep, load_learner

learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=[accuracy, F1Score(average="macro"), RocAuc()],
                splitter=lambda m: [m.body.parameters(), m.head.parameters()])   # parameter groups
learn.summary()                                    # layers, output shapes, parameters, frozen groups, callbacks
learn.lr_find(suggest_funcs=(valley, slide, minimum, steep))   # plot if matplotlib is installed
learn.fine_tune(3, base_lr=2e-3)                   # 1 epoch with the body frozen, then all, discriminative rates
learn.freeze_to(-2); learn.fit_flat_cos(2, lr=slice(1e-5, 1e-3)); learn.unfreeze()
learn.fit_sgdr(3, cycle_len=1, lr_max=1e-2)        # warm restarts: 1 + 2 + 4 epochs
learn.recorder.plot_loss(); learn.recorder.plot_sched()
learn.export()                                     # export.pkl/: model.safetensors + the pickled structure
learn = load_learner(learn.path/"export.pkl", trust_pickle=True)  # or (..., model=MyModel()): no unpickling
# --8<-- [end:fastai]
x = valid_ds.tensors[0]
same = torch.equal(learn.model(x), model(x))
print(f"load_learner: predictions equal the trained model's: {same}")
