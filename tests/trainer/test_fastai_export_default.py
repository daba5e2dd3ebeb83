"""fastbook's `learn.export(); load_learner(learn.path/'export.pkl')`."""

import re

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from cadence import DataLoaders, Learner, load_learner


@pytest.fixture
def learn(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(100, 4)
    y = (x[:, 0] > 0).long()
    dls = DataLoaders.from_dsets(TensorDataset(x[:80], y[:80]), TensorDataset(x[80:], y[80:]), bs=16, device="cpu")
    return Learner(dls, nn.Linear(4, 2), loss_func=nn.CrossEntropyLoss(), path=tmp_path)


def test_the_fastbook_idiom_exports_to_export_pkl_and_loads_it(learn, tmp_path):
    out = learn.export()
    assert out == tmp_path / "export.pkl" and out.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export.pkl"]
    assert sorted(p.name for p in out.iterdir()) == ["export.json", "learner.pkl", "model.safetensors"]
    loaded = load_learner(learn.path / "export.pkl", trust_pickle=True)
    x = torch.randn(3, 4)
    assert torch.equal(loaded.model(x), learn.model(x))
    assert learn.export("export.pkl") == out            # the name given explicitly writes the same


def test_an_export_under_the_former_default_name_still_loads(learn, tmp_path):
    learn.export("export")                              # what learn.export() wrote before
    loaded = load_learner(tmp_path / "export", trust_pickle=True)
    assert torch.equal(loaded.model.weight, learn.model.weight)


def test_load_learner_of_a_missing_path_says_it_does_not_exist(tmp_path):
    missing = tmp_path / "export.pkl"
    with pytest.raises(FileNotFoundError) as e:
        load_learner(missing, trust_pickle=True)
    assert str(e.value) == (f"{missing} does not exist: pass the directory learn.export() wrote "
                            f"(learn.path/'export.pkl' by default)")


def test_a_missing_path_names_the_export_under_the_other_name_beside_it(learn, tmp_path):
    learn.export("export")
    with pytest.raises(FileNotFoundError, match=re.escape(
            f"{tmp_path / 'export.pkl'} does not exist: pass the directory learn.export() wrote (learn.path/"
            f"'export.pkl' by default); {tmp_path / 'export'} is an export (learn.export() wrote its default name "
            f"'export' before 'export.pkl', fastai's): load_learner('{tmp_path / 'export'}', ...)")):
        load_learner(tmp_path / "export.pkl", trust_pickle=True)
    (tmp_path / "export").rename(tmp_path / "old")
    learn.export()
    with pytest.raises(FileNotFoundError, match=re.escape(f"load_learner('{tmp_path / 'export.pkl'}', ...)")):
        load_learner(tmp_path / "export", trust_pickle=True)   # an old script's path, the new default written


def test_a_file_such_as_fastais_export_pkl_is_refused_saying_what_cadence_reads(tmp_path):
    (tmp_path / "export.pkl").write_bytes(b"\x80\x04N.")
    with pytest.raises(FileNotFoundError, match=re.escape(
            f"{tmp_path / 'export.pkl'} is a file, not the directory learn.export() writes (model.safetensors, "
            f"learner.pkl, export.json): a file fastai's export wrote cannot be loaded by cadence")):
        load_learner(tmp_path / "export.pkl", trust_pickle=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=re.escape(
            f"no model.safetensors in the directory {tmp_path / 'empty'}: pass the directory learn.export() wrote")):
        load_learner(tmp_path / "empty", trust_pickle=True)


def test_exporting_the_default_beside_an_older_default_export_warns(learn, tmp_path):
    learn.export("export")
    with pytest.warns(UserWarning, match=re.escape(
            f"learn.export() writes {tmp_path / 'export.pkl'} (fastai's name 'export.pkl'; the default was 'export' "
            f"before): {tmp_path / 'export'} is an older export, left as it was.")):
        learn.export()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "export.pkl"]
