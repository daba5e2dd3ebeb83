"""fastai's metrics: each equals scikit-learn / scipy / a direct computation over the whole validation set,
on one process and under DDP on 2 (tests/scripts/metrics_ddp.py holds the cases)."""

import sys

import pytest
import torch

from cadence import AccumMetric, F1Score, RocAuc, SpearmanCorrCoef

from helpers import SCRIPTS, run_launch

sys.path.insert(0, str(SCRIPTS))
import metrics_ddp  # noqa: E402


@pytest.mark.parametrize("case", list(metrics_ddp.CASES))
def test_metrics_equal_the_reference_on_one_process(case):
    metrics_ddp.check(case, distributed=False)


@pytest.mark.slow
def test_metrics_equal_the_reference_under_ddp_with_a_padded_shard():
    out = run_launch("metrics_ddp.py").stdout
    for case in metrics_ddp.CASES:
        assert f"CHECK {case} ok" in out, out


@pytest.mark.parametrize("build, hidden, message", [
    (F1Score, "sklearn", "F1Score wraps scikit-learn's f1_score, and scikit-learn is not installed: pip install scikit-learn"),
    (RocAuc, "sklearn", "RocAuc wraps scikit-learn's roc_auc_score, and scikit-learn is not installed"),
    (SpearmanCorrCoef, "scipy", "SpearmanCorrCoef wraps scipy's spearmanr, and scipy is not installed: pip install scipy"),
])
def test_a_missing_library_is_named_when_the_metric_is_built(monkeypatch, build, hidden, message):
    for name in [m for m in sys.modules if m == hidden or m.startswith(hidden + ".")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, hidden, None)
    with pytest.raises(ModuleNotFoundError, match=message):
        build()


def test_accum_metric_options_shape_what_is_kept():
    logits = torch.tensor([[2.0, -1.0], [-3.0, 0.5], [0.1, 0.0]])
    targ = torch.tensor([0, 1, 1])
    pred, _ = AccumMetric(len, dim_argmax=-1).transform(logits, targ)
    assert pred.tolist() == [0, 1, 0]
    pred, _ = AccumMetric(len, activation="binarysoftmax").transform(logits, targ)
    torch.testing.assert_close(pred, torch.softmax(logits, 1)[:, 1])
    pred, t = AccumMetric(len, activation="sigmoid", thresh=0.5, flatten=True).transform(logits, logits > 0)
    assert pred.tolist() == [True, False, False, True, True, True] and t.shape == (6,)
    with pytest.raises(ValueError, match="6 predictions but 3 targets after flattening"):
        AccumMetric(len, flatten=True).transform(logits, targ)


def test_accum_metric_refuses_bad_arguments():
    with pytest.raises(TypeError, match="second argument is the metric's name, got -1; pass dim_argmax="):
        AccumMetric(len, -1)
    with pytest.raises(ValueError, match="activation must be one of"):
        AccumMetric(len, activation="relu")
