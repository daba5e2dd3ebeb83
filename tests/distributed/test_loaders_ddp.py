"""Any sampler, batch sampler or IterableDataset on 2 processes through `cadence launch` (tests/scripts/loaders_ddp.py)."""

import json
from collections import defaultdict

import pytest
import torch

from helpers import run_launch

pytestmark = pytest.mark.slow


def rank_rows(out, kind):
    return [json.loads((out / f"{kind}-rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("kind", ["weighted", "bucket"])
def test_sampler_trains_with_equal_batch_counts_and_resumes_exactly(tmp_path, kind):
    run_launch("loaders_ddp.py", kind, tmp_path, timeout=400)
    results = rank_rows(tmp_path, kind)
    for res in results:                                          # each valid id once, padding dropped
        assert sorted(res["valid_ids"]) == list(range(27)) and res["valid_ids"] == results[0]["valid_ids"]
    per_rank = [res["rows"] for res in results]
    for rows in per_rank:
        runs = defaultdict(list)
        for run, epoch, it, ids in rows:
            runs[run].append((epoch, it, ids))
        assert [(e, i) for e, i, _ in runs["ref"]] == [(e, i) for e in range(3) for i in range(5)]
        assert runs["stop"] + runs["resume"] == runs["ref"]      # the same batches, step by step, after resuming
        assert len(runs["stop"]) == 7
    ref = [[ids for run, e, i, ids in rows if run == "ref"] for rows in per_rank]
    assert len(ref[0]) == len(ref[1]) == 15                      # equal batch counts on both ranks
    epochs = [[i for r in range(2) for ids in ref[r][5 * e:5 * e + 5] for i in ids] for e in range(3)]
    if kind == "weighted":
        assert all(len(ids) == 50 and min(ids) >= 10 for ids in epochs)   # 50 draws (1 padding repeat)
        assert epochs[0] != epochs[1]                                    # a new draw each epoch
    else:
        assert all(sorted(ids) == list(range(60)) for ids in epochs)     # the 10 batches, each once
        assert all(len({i % 17 for i in ids}) <= 2 for r in range(2) for ids in ref[r])  # still bucketed
    a, b = (torch.load(tmp_path / f"{kind}-{run}.pt", weights_only=True) for run in ("ref", "resume"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_iterable_dataset_without_len_trains_and_validates_exactly(tmp_path):
    run_launch("loaders_ddp.py", "stream", tmp_path, timeout=300)
    res = rank_rows(tmp_path, "stream")
    steps = [[(e, i) for _, e, i, _ in r["rows"]] for r in res]
    assert steps[0] == steps[1] == [(e, i) for e in range(2) for i in range(3)]   # 17 items: 9 + 8, batches of 4
    ids = [[ids for _, e, _, ids in r["rows"] if e == 0] for r in res]
    assert ids[0] == [[0, 2, 4, 6], [8, 10, 12, 14], [16]]
    assert ids[1] == [[1, 3, 5, 7], [9, 11, 13, 15], [0]]        # rank 1's last step: padding (its items ended)
    for r in res:
        assert r["pred_ids"] == list(range(9)) and r["n_preds"] == 9   # each valid item once, in the stream's order
        assert r["valid_loss"] == pytest.approx(res[0]["direct_valid_loss"], rel=1e-6)
    assert len(res[0]["recorded_valid"]) == 2 and res[0]["recorded_valid"] == pytest.approx(res[1]["recorded_valid"])


SIZED_STREAM = '''
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from cadence import DataLoaders, Learner

class Numbers(IterableDataset):
    def __init__(self, n): self.n = n
    def __len__(self): return self.n
    def __iter__(self):
        for i in range(self.n): yield torch.tensor([float(i)]), torch.tensor([float(i)])

learn = Learner(DataLoaders(DataLoader(Numbers(11), batch_size=2), DataLoader(Numbers(9), batch_size=2)),
                nn.Linear(1, 1), loss_func=nn.MSELoss())
with learn.distrib_ctx():
    inputs, preds, targs = learn.get_preds(with_input=True)
print("ORDER", inputs[:, 0].long().tolist(), targs[:, 0].long().tolist(), flush=True)
'''


def test_get_preds_of_a_stream_with_a_length_comes_back_in_the_streams_order(tmp_path):
    """Items are dealt to the processes one by one (0, 2, 4 ... to rank 0): gathered rank by rank, they are put
    back in the stream's order, as for a map-style data set."""
    script = tmp_path / "sized_stream.py"
    script.write_text(SIZED_STREAM)
    out = run_launch(script, timeout=180).stdout
    expected = f"ORDER {list(range(9))} {list(range(9))}"
    assert [line for line in out.splitlines() if line.startswith("ORDER")] == [expected, expected], out
