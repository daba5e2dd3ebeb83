"""GradAccum on a Hugging Face causal LM fed padded batches of different lengths: a window's step is the big
batch's (the model's loss is a mean over the labels that are not -100, so micro-batches are weighed by their labels,
as transformers' Trainer does), where weighing them by their samples was 20% off."""

import torch
from torch.utils.data import DataLoader

from cadence import DataLoaders, GradAccum, Learner
from cadence.callbacks.label_weights import label_items, shifts_labels
from tests.hf.tiny_models import VOCAB, tiny_model

LENGTHS = [4, 16, 5, 6, 15, 16, 7, 4, 9, 13, 4, 16, 5, 8, 16, 4]  # micro-batches of 4 padded to unequal lengths


def items() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in LENGTHS]


def collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' language-modelling collator, by hand: inputs padded with 0, labels with -100."""
    longest = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    labels = torch.full((len(rows), longest), -100)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)], labels[i, :len(r)], mask[i, :len(r)] = r, r, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def trained(bs: int, cbs=()) -> dict[str, torch.Tensor]:
    dls = DataLoaders(DataLoader(items(), batch_size=bs, collate_fn=collate), device="cpu")
    learn = Learner(dls, tiny_model("gpt2"), loss_func=None, opt_func=torch.optim.SGD, lr=0.5)
    with learn.no_bar():
        learn.fit(1, cbs=list(cbs))
    return {k: v.detach().clone() for k, v in learn.model.state_dict().items()}


def hand_loop_sample_weighted() -> dict[str, torch.Tensor]:
    """What weighing micro-batches by their samples gives: the mean of the two micro-batches' own means."""
    model = tiny_model("gpt2")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    batches = list(DataLoader(items(), batch_size=4, collate_fn=collate))
    for window in (batches[:2], batches[2:]):
        for b in window:
            (model(**b).loss / 2).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def biggest_difference(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_a_window_of_padded_micro_batches_steps_as_the_big_batch():
    start = {k: v.clone() for k, v in tiny_model("gpt2").state_dict().items()}
    big = trained(bs=8)
    accumulated = trained(bs=4, cbs=[GradAccum(steps=2)])
    moved = biggest_difference(big, start)
    assert moved > 0.05                                                   # training moved the weights
    assert biggest_difference(accumulated, big) < 1e-5 * max(1.0, moved)
    assert biggest_difference(hand_loop_sample_weighted(), big) > 0.1 * moved  # the data makes the weighing matter


def test_labels_counted_as_transformers_counts_them():
    batch = collate([torch.tensor([5, 6, 7]), torch.tensor([8])])
    assert label_items(batch, shifted=False) == 4
    assert label_items(batch, shifted=True) == 2                           # each row's first label is no target
    assert label_items({**batch, "shift_labels": torch.tensor([[1, -100]])}, shifted=True) == 1
    assert label_items({"input_ids": batch["input_ids"]}, shifted=True) is None
    assert label_items((batch["input_ids"],), shifted=True) is None
    assert shifts_labels(tiny_model("gpt2")) and shifts_labels(tiny_model("llama"))
    assert not shifts_labels(torch.nn.Linear(2, 2))


def test_a_window_read_ahead_copies_and_pickles_as_its_loader():
    import copy
    import pickle

    from cadence.callbacks.label_weights import WindowAhead

    ahead = WindowAhead([1, 2, 3], ends=[False, True, True], weigh=print)
    assert list(copy.copy(ahead)) == [1, 2, 3]                            # a copy recursed forever
    assert pickle.loads(pickle.dumps(WindowAhead([4, 5], ends=[False, True], weigh=len))).inner == [4, 5]
