"""fastai's `dl.bs/.shuffle/.n` read without breaking a stream or a custom loader, `n` read when asked, and
`test_dl` of dict items without their labels."""

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from cadence import DataLoaders


class _Stream(IterableDataset):
    def __init__(self, error):
        self.error = error

    def __iter__(self):
        return iter(torch.arange(10.0).view(5, 2))

    def __len__(self):
        raise self.error("a stream has no length")


def test_a_stream_whose_len_raises_builds_and_has_no_n():
    for error in (NotImplementedError, TypeError, RuntimeError):
        dls = DataLoaders(DataLoader(_Stream(error), batch_size=2), device="cpu")
        assert (dls.train.bs, dls.train.shuffle, dls.train.n) == (2, False, None)


class _Growing(Dataset):
    def __init__(self):
        self.items = list(range(4))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return torch.tensor([float(self.items[i])]), torch.tensor(0)


def test_n_follows_a_data_set_that_grows():
    ds = _Growing()
    dls = DataLoaders(DataLoader(ds, batch_size=2), DataLoader(ds, batch_size=2), device="cpu")
    assert (dls.train.n, dls.valid.n) == (4, 4)
    ds.items += [4, 5, 6]
    assert (dls.train.n, dls.valid.n) == (7, 7)


def test_a_users_own_n_is_kept():
    dl = DataLoader(_Growing(), batch_size=2)
    dl.n = 100
    assert DataLoaders(dl, device="cpu").train.n == 100


class _OwnLoader:
    """A custom loader that shuffles by itself and takes attributes: cadence cannot know, so it tags nothing."""

    def __init__(self):
        self.batch_size, self.dataset = 2, _Growing()

    def __iter__(self):
        return iter([(torch.ones(2, 1), torch.zeros(2))])

    def __len__(self):
        return 1


def test_a_custom_loader_gets_no_fastai_attributes():
    dls = DataLoaders(_OwnLoader(), _OwnLoader(), device="cpu")
    for dl in (dls.train, dls.valid):
        assert not any(hasattr(dl, name) for name in ("bs", "shuffle", "n"))
    assert dls.bs == 2                                    # dls.bs still reads its batch size


def test_test_dl_without_labels_drops_the_target_keys_of_dict_items():
    items = [{"input_ids": torch.arange(3), "labels": torch.tensor(1), "score": torch.tensor(0.5)} for _ in range(4)]
    dls = DataLoaders(DataLoader(items, batch_size=2), DataLoader(items, batch_size=2), device="cpu",
                      target_keys=("labels", "score"))
    batch = next(iter(dls.test_dl(items)))
    assert sorted(batch) == ["input_ids"] and batch["input_ids"].shape == (2, 3)
    assert sorted(next(iter(dls.test_dl(items, with_labels=True)))) == ["input_ids", "labels", "score"]
    default = DataLoaders(DataLoader(items, batch_size=2), device="cpu")    # fastai/HF default: "labels"
    assert sorted(next(iter(default.test_dl(items)))) == ["input_ids", "score"]
