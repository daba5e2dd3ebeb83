"""A script that calls `set_seed` and prepares a shuffling loader sees Accelerate 1.15's batches, in its order, on each rank.

Accelerate's rule, written out by hand here: on one process the loader is left alone (each epoch drawn
by the loader itself from torch's RNG); on several, the sampler gets a generator seeded at `prepare`
from torch's RNG (`torch.empty((), dtype=torch.int64).random_()`), and the loader's batches are dealt
to the processes in turn (batch j to rank j % n), the last step completed from the start of the epoch
(`drop_last`: dropped). `use_seedable_sampler=True` seeds each epoch's permutation with the seed given
to `set_seed` plus the epoch. `split_batches` cuts each global batch into n parts.
Where real Accelerate is installed, the same script also runs on it and every rank's batches (and the
next random number after each epoch) must be identical.
"""

import json
import math
import socket
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler

from helpers import REPO, SCRIPTS, cadence_env, run_launch

sys.path.insert(0, str(SCRIPTS))
from accelerate_order import BS, EPOCHS, N, VALID_BS  # noqa: E402  (the launched script's constants)

SCRIPT = SCRIPTS / "accelerate_order.py"
VARIANTS = [(), *(pytest.param(v, marks=pytest.mark.long) for v in [("seedable",), ("drop_last",), ("split_batches",)])]


def _has_accelerate() -> bool:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return False
    return True


def deal(order: list[int], bs: int, world: int, drop_last: bool) -> list[list[list[int]]]:
    """Accelerate's BatchSamplerShard (even_batches): batch j to rank j % world, whole steps completed from the start."""
    step = bs * world
    if drop_last:
        stream = order[:len(order) // step * step]
    else:
        stream = (order * math.ceil(step / len(order) + 1))[:math.ceil(len(order) / step) * step]
    batches = [stream[i:i + bs] for i in range(0, len(stream), bs)]
    return [batches[r::world] for r in range(world)]


def by_hand(world: int, options: tuple[str, ...]) -> list[list[dict]]:
    """Per rank, per epoch: {"train": batches, "valid": batches}."""
    torch.manual_seed(42)                                   # set_seed(42)
    nn.Linear(1, 1)
    drop, split = "drop_last" in options, "split_batches" in options
    if world == 1:
        train = DataLoader(torch.arange(N), batch_size=BS, shuffle=True, drop_last=drop)
        valid = DataLoader(torch.arange(N), batch_size=VALID_BS)
        epochs = []
        for _ in range(EPOCHS):
            epochs.append({"train": [b.tolist() for b in train], "valid": [b.tolist() for b in valid]})
            torch.rand(1)                                   # the script's draw after each epoch
        return [epochs]
    bs, valid_bs = (BS // world, VALID_BS // world) if split else (BS, VALID_BS)
    if "seedable" in options:
        perms = [torch.randperm(N, generator=torch.Generator().manual_seed(42 + e)).tolist() for e in range(EPOCHS)]
    else:
        gen = torch.Generator().manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        perms = [list(RandomSampler(range(N), generator=gen)) for _ in range(EPOCHS)]   # each epoch goes on drawing
    valid = deal(list(range(N)), valid_bs, world, False)
    return [[{"train": deal(perm, bs, world, drop)[r], "valid": valid[r]} for perm in perms] for r in range(world)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(library: str, world: int, options: tuple[str, ...], out) -> list[list[dict]]:
    prefix = out / f"{library}-{world}-{'-'.join(options) or 'default'}"
    if library == "cadence":
        run_launch(SCRIPT, "cadence", str(prefix), *options, nproc=world, timeout=240)
    else:
        launch = ([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(world),
                   "--main_process_port", str(free_port())] if world > 1 else [sys.executable])
        # real Accelerate's 2-process CPU runs now and then die (SIGABRT) or hang at exit in ProcessGroupGloo's
        # destructor (seen with py-spy; the script ends its group, which makes it rare): each rank writes its file
        # as the script's last act, so complete files mean the script ran to its end, whatever the exit
        written = lambda: all((out / f"{prefix.name}.{r}.json").is_file() for r in range(world))  # noqa: E731
        try:
            proc = subprocess.run([*launch, str(SCRIPT), "accelerate", str(prefix), *options], capture_output=True,
                                  text=True, timeout=180, env=cadence_env(), cwd=REPO)
        except subprocess.TimeoutExpired:
            if not written():
                raise
        else:
            assert proc.returncode == 0 or written(), \
                f"real Accelerate exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return [json.loads((out / f"{prefix.name}.{r}.json").read_text())["epochs"] for r in range(world)]


def batches(epochs: list[list[dict]]) -> list[list[dict]]:
    return [[{k: e[k] for k in ("train", "valid")} for e in rank] for rank in epochs]


def test_one_process_sees_the_plain_loaders_batches(tmp_path):
    got = run("cadence", 1, (), tmp_path)
    assert batches(got) == by_hand(1, ())
    if _has_accelerate():
        assert got == run("accelerate", 1, (), tmp_path)        # the later random numbers too


@pytest.mark.skipif(not _has_accelerate(), reason="compares with real Accelerate, a dev dependency")
def test_one_process_with_the_seedable_sampler_draws_as_accelerate_does(tmp_path):
    """Accelerate's seedable sampler orders each epoch from the seed; its loader's iterator still draws its base seed
    from torch's RNG at the first batch: the batches and every later random number (dropout's) are Accelerate's."""
    got = run("cadence", 1, ("seedable",), tmp_path)
    assert got == run("accelerate", 1, ("seedable",), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("options", VARIANTS, ids=lambda o: "-".join(o) or "default")
def test_two_processes_see_accelerates_batches_on_each_rank(tmp_path, options):
    got = run("cadence", 2, options, tmp_path)
    expected = by_hand(2, options)
    assert batches(got) == expected
    assert sorted(i for e in got[0] + got[1] for b in e["train"][:1] for i in b) != list(range(2 * BS))   # shuffled
    if _has_accelerate():
        real = run("accelerate", 2, options, tmp_path)
        assert batches(real) == expected
        assert got == real   # the later random numbers too (seedable: the iterator's base seed from torch's RNG)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_split_batches_keeps_the_loaders_own_sampler_and_workers_as_accelerate_does(tmp_path, world):
    """A WeightedRandomSampler (weight on items 0-4 only) and a worker_init_fn survive `split_batches=True`: the same
    batches on each rank as real Accelerate's, every item one of 0-4 (the loader was once rebuilt without them)."""
    options = ("split_batches", "weighted")
    got = run("cadence", world, options, tmp_path)
    assert {i for rank in got for e in rank for b in e["train"] for i in b} <= set(range(5))
    assert batches(got) == batches(run("accelerate", world, options, tmp_path))
