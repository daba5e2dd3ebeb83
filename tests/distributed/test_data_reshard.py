"""A mid-epoch checkpoint from 2 processes resumed on 1 and on 4: the same global sample order, each id once.

tests/scripts/reshard_resume.py records the ids of every training batch on every rank.
"""

import json

import pytest

from helpers import run_launch

pytestmark = pytest.mark.slow


def steps(out, world_size):
    """{(epoch, iter): ids of that global step, rank by rank}, from the files every rank wrote."""
    rows = {}
    for r in range(world_size):
        for epoch, it, ids in json.loads((out / f"ids-rank{r}.json").read_text()):
            rows.setdefault((epoch, it), []).append(ids)
    assert all(len(v) == world_size for v in rows.values())    # every rank ran every step
    return rows


@pytest.mark.long
def test_two_process_checkpoint_resumes_on_one_and_four_exactly(tmp_path):
    ckpt = tmp_path / "ckpt"
    run_launch("reshard_resume.py", "--ckpt", ckpt, "--out", tmp_path / "ref", nproc=2)
    ref = steps(tmp_path / "ref", 2)
    assert sorted(ref) == [(e, i) for e in range(2) for i in range(5)]   # 100 ids / (2 x 12): 5 steps an epoch
    assert (ckpt / "step-00000007").is_dir()                              # epoch 1 after 2 of its 5 steps
    before = [i for it in (0, 1) for ids in ref[(1, it)] for i in ids]
    for world_size in (1, 4):
        out = tmp_path / f"on{world_size}"
        proc = run_launch("reshard_resume.py", "--ckpt", ckpt, "--out", out, "--resume", "step-00000007",
                          nproc=world_size, timeout=300)
        got = steps(out, world_size)
        assert sorted(got) == [(1, 2), (1, 3), (1, 4)]                 # the rest of epoch 1: still 5 steps
        after = [i for key in sorted(got) for ids in got[key] for i in ids]
        assert sorted(before + after) == list(range(100))              # each remaining id exactly once
        for key in got:                                                # each step: the samples it had on 2
            assert sorted(sum(got[key], [])) == sorted(sum(ref[key], []))
        assert "saved with batch 12 x 2 processes (24 per step)" in proc.stderr
