"""Bad input fails early with a message that says what to change."""

import pytest
import torch
from torch import nn

from cadence import Callback, DataLoaders, Learner


def test_no_loss_function(dls, model):
    """Without loss_func the model must compute its loss; a plain model fails on its first batch, before any step."""
    learn = Learner(dls, model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"loss_func=nn.CrossEntropyLoss\(\)"):
        learn.fit(1)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_metric_not_callable(dls, model):
    with pytest.raises(TypeError, match="metrics must be callables"):
        Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=["accuracy"])


def test_validate_without_validation_set(dsets, model):
    train, _ = dsets
    learn = Learner(DataLoaders(torch.utils.data.DataLoader(train, batch_size=8), device="cpu"), model,
                    loss_func=nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="validation set"):
        learn.validate()
    with pytest.raises(ValueError, match="validation set"):
        learn.get_preds()


def test_model_output_does_not_fit_loss(dls):
    learn = Learner(dls, nn.Linear(8, 5), loss_func=nn.MSELoss())
    before = learn.model.weight.detach().clone()
    with pytest.raises(ValueError, match=r"pred tensor of shape \(16, 5\).*yb \(tensor of shape \(16,\)"):
        learn.fit(1)
    assert torch.equal(before, learn.model.weight)  # failed on the first batch, before any step


def test_loss_that_is_not_scalar(dls, model):
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(reduction="none"))
    with pytest.raises(ValueError, match="scalar tensor"):
        learn.fit(1)


def test_unknown_callback_event_name(dls, model):
    class Typo(Callback):
        def after_bacth(self):
            pass

    with pytest.raises(ValueError, match="after_bacth.*Did you mean 'after_batch'"):
        Learner(dls, model, loss_func=nn.CrossEntropyLoss(), cbs=Typo())
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="unknown event 'before_fitt'"):
        learn("before_fitt")


def test_opt_func_that_returns_no_optimizer(dls, model):
    with pytest.raises(TypeError, match="opt_func must return a torch.optim.Optimizer"):
        Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=lambda params, lr: list(params))


def test_not_a_callback(dls, model):
    with pytest.raises(TypeError, match="Callback"):
        Learner(dls, model, loss_func=nn.CrossEntropyLoss(), cbs=[print])


def test_bad_epochs_and_lr_count(dls, model):
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="n_epoch"):
        learn.fit(0)
    with pytest.raises(ValueError, match="2 learning rates for 1 parameter groups"):
        learn.fit(1, lr=[1e-3, 1e-2])


def test_lr_none_means_the_default(dls, model):
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), lr=None)   # None: opt_func's lr, else 1e-3
    learn.fit(1, lr=None)                                                     # None: the Learner's lr
    assert learn.lr == 1e-3 and learn.opt.param_groups[0]["lr"] == 1e-3 and learn.step > 0


def test_dls_and_model_types(dls, model):
    with pytest.raises(TypeError, match="DataLoaders"):
        Learner([1, 2], model, loss_func=nn.CrossEntropyLoss())
    with pytest.raises(TypeError, match="nn.Module"):
        Learner(dls, lambda x: x, loss_func=nn.CrossEntropyLoss())


@pytest.mark.parametrize("lr, said", [("fast", "got 'fast'"), ("0.01", "the number 0.01, not a string"),
                                      (-0.1, "got -0.1"), (float("nan"), "got nan"),
                                      (slice(1e-4, "1e-2"), "got slice"), ([1e-3, -1.0], r"got \[0.001, -1.0\]")])
def test_bad_learning_rate_is_refused_before_training(dls, model, lr, said):
    with pytest.raises(ValueError, match=rf"learning rate must be a finite number >= 0.*{said}"):
        Learner(dls, model, loss_func=nn.CrossEntropyLoss(), lr=lr)
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss())
    before = [p.detach().clone() for p in learn.model.parameters()]
    with pytest.raises(ValueError, match=rf"learning rate must be.*{said}"):
        learn.fit(1, lr=lr)
    with pytest.raises(ValueError, match=rf"learning rate must be.*{said}"):
        learn.fit_one_cycle(1, lr_max=lr)
    assert all(torch.equal(a, b) for a, b in zip(before, learn.model.parameters())) and learn.step == 0


def test_opt_func_given_as_a_name(dls, model):
    with pytest.raises(TypeError, match=r"got 'adam': pass e.g. opt_func=torch.optim.Adam,"):
        Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func="adam")
    with pytest.raises(TypeError, match=r"got 'rocket': pass e.g. opt_func=torch.optim.AdamW"):
        Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func="rocket")


def test_a_model_with_every_parameter_frozen_is_refused_before_training(dls):
    model = nn.Linear(8, 3).requires_grad_(False)
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match=r"no parameter of the model requires a gradient \(all frozen\)"):
        learn.fit(1)
    assert learn.recorder.values == [] and learn.step == 0
