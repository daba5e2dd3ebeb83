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
    per_rank = rank_rows(tmp_path, kind)
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
        assert sorted(r["pred_ids"]) == list(range(9)) and r["n_preds"] == 9   # each valid item once
        assert r["valid_loss"] == pytest.approx(res[0]["direct_valid_loss"], rel=1e-6)
    assert len(res[0]["recorded_valid"]) == 2 and res[0]["recorded_valid"] == pytest.approx(res[1]["recorded_valid"])
