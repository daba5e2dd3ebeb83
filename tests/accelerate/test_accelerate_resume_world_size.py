"""`load_state` on another number of processes than `save_state`: each loader's saved position counts batches of
the saving run's data-parallel processes, so on another layout it is not restored (the rows it gave were wrong: some twice, some never, a `len()` that
disagreed with the batches); each loader starts its epoch from the beginning, as Accelerate's loaders do after
`load_state`, and the main process warns naming both sizes. On the same number the position is restored."""

import json

import pytest

from helpers import run_launch


def load(tmp_path, saved_on, loads_on, shuffle):
    directory = tmp_path / "ckpt"
    run_launch("accelerate_resume_world.py", "save", directory, shuffle, nproc=saved_on, timeout=180)
    out = run_launch("accelerate_resume_world.py", "load", directory, shuffle, nproc=loads_on, timeout=180).stdout
    return [json.loads(line.split(" ", 2)[2]) for line in sorted(out.splitlines()) if line.startswith("RANK ")]


@pytest.mark.slow
@pytest.mark.parametrize("saved_on, loads_on", [(2, 1), pytest.param(1, 2, marks=pytest.mark.long)])
@pytest.mark.parametrize("shuffle", [0, 1])
def test_another_number_of_processes_starts_the_epoch_again_and_says_so(tmp_path, saved_on, loads_on, shuffle):
    ranks = load(tmp_path, saved_on, loads_on, shuffle)
    assert len(ranks) == loads_on
    for epoch in (0, 1):   # the rest of the loaded epoch is a whole epoch, and so is the next
        rows = [r for got in ranks for r in got["rows"][epoch]]
        assert sorted(rows) == list(range(16))   # every row once (16 rows deal evenly to 1 or 2 processes)
        if not shuffle:
            assert ranks[0]["rows"][epoch] == ([0, 1, 4, 5, 8, 9, 12, 13] if loads_on == 2 else list(range(16)))
    assert all(got["len"] == 16 // 2 // loads_on for got in ranks)
    assert [w for w in ranks[0]["warnings"] if "is not restored" in w] == [
        f"{tmp_path / 'ckpt'} was saved with other loader layouts (data-parallel processes x batch size: "
        f"{saved_on} x 2 then, {loads_on} x 2 now): those loaders' position is not restored, so each starts its "
        f"epoch from the beginning, as Accelerate's loaders do after load_state; skip what the saving run had done "
        f"with skip_first_batches(dl, n)"]


@pytest.mark.slow
def test_the_same_number_of_processes_continues_mid_epoch(tmp_path):
    ranks = load(tmp_path, 2, 2, 0)
    # Accelerate deals batch j to rank j % 2; one batch each was done
    assert [got["rows"][0] for got in ranks] == [[4, 5, 8, 9, 12, 13], [6, 7, 10, 11, 14, 15]]
    assert not any("is not restored" in w for got in ranks for w in got["warnings"])
