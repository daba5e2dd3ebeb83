"""`ParallelismConfig.check_processes`: a refusal names a fix that exists (before: tp_size=3 on 2 processes was told
"dp_shard_size=1 for tp_size=3", a product of 3)."""

import pytest

from cadence.utils import ParallelismConfig


@pytest.mark.parametrize("sizes, n, said", [
    ({"tp_size": 3}, 2, r"tp_size=3 does not divide the 2 processes, and tp_size must divide the number of processes: "
                        r"pick tp_size from \[1, 2\]"),
    ({"tp_size": 4, "dp_shard_size": 1}, 6, r"tp_size=4 does not divide the 6 processes.*\[1, 2, 3, 6\]"),
    ({"tp_size": 2, "dp_replicate_size": 3}, 4, r"dp_replicate_size=3 must divide the 2 processes left by tp_size=2: "
                                                r"one of \[1, 2\]"),
    ({"tp_size": 2, "dp_shard_size": 4}, 4, r"= 8, not the 4 processes launched: make dp_shard_size 2"),
])
def test_a_refused_layout_is_told_a_layout_that_exists(sizes, n, said):
    config = ParallelismConfig(**sizes)
    with pytest.raises(ValueError, match=said) as e:
        config.check_processes(n)
    assert "dp_shard_size=1 for tp_size" not in str(e.value)
