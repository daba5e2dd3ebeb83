"""`learn.export()` beside fastai's own `export.pkl` FILE: refused before anything is written,
the file left as it was; a file an earlier cadence hid at the ".old" name is given back or named, never deleted."""

import os
import re

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from cadence import DataLoaders, Learner, load_learner
from cadence.serialization import commit_dir, recover_dir, staging_dir


@pytest.fixture
def learn(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(32, 4)
    dls = DataLoaders.from_dsets(TensorDataset(x, (x[:, 0] > 0).long()), TensorDataset(x, (x[:, 0] > 0).long()),
                                 bs=8, device="cpu")
    return Learner(dls, nn.Linear(4, 2), loss_func=nn.CrossEntropyLoss(), path=tmp_path)


def test_export_over_fastais_export_pkl_file_is_refused_and_the_file_kept(learn, tmp_path):
    (tmp_path / "export.pkl").write_bytes(b"fastai pickle")
    for _ in range(2):                                   # a second try says the same: nothing was left half-done
        with pytest.raises(FileExistsError, match=re.escape(
                f"export: {tmp_path / 'export.pkl'} is a file, not a cadence export (a directory): probably a "
                f"fastai export pickle, left as it is. Pass another name")):
            learn.export()
        assert sorted(os.listdir(tmp_path)) == ["export.pkl"]
        assert (tmp_path / "export.pkl").read_bytes() == b"fastai pickle"
    out = learn.export("cadence_export")                 # another name works
    assert torch.equal(load_learner(out, trust_pickle=True).model.weight, learn.model.weight)
    assert (tmp_path / "export.pkl").read_bytes() == b"fastai pickle"


def test_commit_dir_refuses_a_file_at_the_target(tmp_path):
    (tmp_path / "t").write_bytes(b"mine")
    staged = staging_dir(tmp_path / "t")
    with pytest.raises(FileExistsError, match="is a file, not a directory written by cadence"):
        commit_dir(staged, tmp_path / "t")
    assert (tmp_path / "t").read_bytes() == b"mine" and not (tmp_path / ".t.old").exists()


def test_a_file_hidden_at_old_comes_back_when_its_name_is_free(tmp_path):
    (tmp_path / ".t.old").write_bytes(b"mine")           # what the earlier commit_dir left, the export not moved in
    recover_dir(tmp_path / "t")
    assert sorted(os.listdir(tmp_path)) == ["t"] and (tmp_path / "t").read_bytes() == b"mine"


def test_commit_dir_never_deletes_a_file_at_old(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / ".t.old").write_bytes(b"mine")
    with pytest.raises(FileExistsError, match="is a file, not a directory cadence moved aside"):
        commit_dir(staging_dir(tmp_path / "t"), tmp_path / "t")
    assert (tmp_path / ".t.old").read_bytes() == b"mine" and (tmp_path / "t").is_dir()


def test_a_file_hidden_at_old_beside_an_export_is_named_not_deleted(learn, tmp_path):
    learn.export()                                       # the state the earlier version left: new export in, the
    (tmp_path / ".export.pkl.old").write_bytes(b"mine")  # user's file hidden at ".old"
    with pytest.raises(FileExistsError, match=re.escape(f"export: {tmp_path / '.export.pkl.old'} is a file, not an "
                                                        f"export cadence moved aside")):
        learn.export()
    assert (tmp_path / ".export.pkl.old").read_bytes() == b"mine"
    assert torch.equal(load_learner(tmp_path / "export.pkl", trust_pickle=True).model.weight, learn.model.weight)
    os.rename(tmp_path / ".export.pkl.old", tmp_path / "fastai_export.pkl")
    learn.export()                                       # moved away as told: exports work again
    assert sorted(os.listdir(tmp_path)) == ["export.pkl", "fastai_export.pkl"]
