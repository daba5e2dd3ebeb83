"""Checkpoint(async_save=True): the same checkpoints as a synchronous save, never a visible incomplete one whenever the
processes are killed, a failed background write stops the run naming the checkpoint, preemption waits for the writer.

tests/scripts/async_checkpoint.py trains (GradAccum, dropout, AdamW, one-cycle; 18 optimizer steps, a checkpoint
every 4 steps and every epoch end); its --write-delay makes each save's RNG files late, as a slow disk would,
so that the saves are in flight for most of the run. Real processes, real kills and a real file-size limit.
"""

import io
import json
import random
import re
import signal
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn
from safetensors.torch import load_file

from cadence.callbacks.checkpoint import Checkpoint, read_state
from cadence.callbacks.checkpoint.store import missing_files
from cadence.distributed.deepspeed_checkpoint import PERSISTENT
from helpers import REPO, SCRIPTS, cadence_env, run_launch

pytestmark = pytest.mark.slow
SCRIPT = "async_checkpoint.py"


def run(*args, nproc=1):
    if nproc > 1:
        return run_launch(SCRIPT, *map(str, args), nproc=nproc, timeout=240, check=False)
    return subprocess.run([sys.executable, str(SCRIPTS / SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=240, env=cadence_env(PYTHONPATH=f"{SCRIPTS}:{REPO}"), cwd=REPO)


def finished(proc):
    assert proc.returncode == 0 and "STEPS " in proc.stdout, proc.stdout + proc.stderr  # 18 on 1 process, 9 on 2
    return json.loads(proc.stdout.split("BLOCKED ", 1)[1].splitlines()[0])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """reference(nproc): the final weights of an uninterrupted run with synchronous saves on nproc processes."""
    out, weights = tmp_path_factory.mktemp("ref"), {}

    def get(nproc):
        if nproc not in weights:
            finished(run("--ckpt", out / f"ckpt{nproc}", "--out", out / f"ref{nproc}.st", "--sync", nproc=nproc))
            weights[nproc] = load_file(str(out / f"ref{nproc}.st"))
        return weights[nproc]
    return get


def assert_equal(weights, reference):
    assert weights.keys() == reference.keys()
    for k in reference:
        assert torch.equal(weights[k], reference[k]), k


def visible(root):
    return sorted(p for p in root.glob("step-*"))


def test_async_and_sync_saves_write_the_same_bytes_and_async_ones_leave_the_loop_at_once(tmp_path, reference):
    blocked = {}
    for mode in ("sync", "async"):
        flags = ["--sync"] if mode == "sync" else []
        blocked[mode] = finished(run("--ckpt", tmp_path / mode, "--out", tmp_path / f"{mode}.st", "--write-delay", 0.5,
                                     *flags))
        assert_equal(load_file(str(tmp_path / f"{mode}.st")), reference(1))
    assert_same_checkpoints(tmp_path / "sync", tmp_path / "async")
    assert min(blocked["sync"]) >= 0.5                 # the loop waited for the slow disk at every save
    assert blocked["async"][0] < 0.25                  # the first async save: only the copy to host memory


def assert_same_checkpoints(sync_root, async_root, count=7):
    """Every checkpoint of the two runs: the same files, byte for byte (state.json but for wall-clock times; torch's
    distributed checkpoint `.metadata` but for the save's own id and path, its tensors compared loaded)."""
    names = [d.name for d in visible(sync_root)]
    assert names == [d.name for d in visible(async_root)] and len(names) == count
    for name in names:
        sync, async_ = sync_root / name, async_root / name
        files = sorted(p.relative_to(sync).as_posix() for p in sync.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(async_).as_posix() for p in async_.rglob("*") if p.is_file())
        for f in files:
            if f == "sharded/.metadata":
                assert_same_dcp_checkpoint(sync / "sharded", async_ / "sharded")
            elif f != "state.json":
                assert (sync / f).read_bytes() == (async_ / f).read_bytes(), f"{name}/{f}"
        states = [json.loads((d / "state.json").read_text()) for d in (sync, async_)]
        for s in states:  # the Recorder's epoch times: wall-clock, the one thing two runs cannot share
            for row in s["callbacks"]["recorder"]["values"]:
                row.pop("time", None)
        assert states[0] == states[1], name
    assert (sync_root / "latest").read_text() == (async_root / "latest").read_text() == names[-1]


def assert_same_dcp_checkpoint(sync, async_):
    """Two checkpoints of torch's distributed checkpoint: every tensor and value equal, loaded in this process, and
    the metadata equal but for `storage_meta` (a random save id and the staged path, different for any two saves)."""
    import pickle

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    metadata = [pickle.loads((d / ".metadata").read_bytes()) for d in (sync, async_)]
    for field in ("state_dict_metadata", "planner_data", "storage_data", "version"):
        assert getattr(metadata[0], field) == getattr(metadata[1], field), field
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        loaded = [_load_state_dict_from_keys(checkpoint_id=d) for d in (sync, async_)]
    flat = [dict(_flatten(state)) for state in loaded]
    assert flat[0].keys() == flat[1].keys() and any(isinstance(v, torch.Tensor) for v in flat[0].values())
    for key, value in flat[0].items():
        other = flat[1][key]
        assert (torch.equal(value, other) and value.dtype == other.dtype if isinstance(value, torch.Tensor)
                else value == other), f"{sync}: {key}"


def _flatten(obj, prefix=""):
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _flatten(value, f"{prefix}.{key}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _flatten(value, f"{prefix}.{i}")
    else:
        yield prefix, obj


@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.long), "fsdp"])
def test_async_and_sync_saves_on_two_processes_write_the_same_checkpoints(tmp_path, strategy):
    """DDP (the main process writes the model's file, the other process on its machine the optimizer's, in
    parallel) and FSDP2 (every rank its shards through torch's distributed checkpoint, its async save with torch's
    stager): the same run saved both ways, with the async saves in flight across the next steps (each rank's files
    0.5 s late, the copy of the parameters and optimizer state 0.3 s late), gives the same checkpoints and the same
    final weights. Taking an async save's state makes no collective: no rank waits at the save point for another
    (a rank late to it would hold them all)."""
    for mode in ("sync", "async"):
        flags = ["--sync"] if mode == "sync" else ["--copy-delay", 0.3]
        proc = run("--ckpt", tmp_path / mode, "--out", tmp_path / f"{mode}.st", "--write-delay", 0.5,
                   "--strategy", strategy, *flags, nproc=2)
        finished(proc)
        wrote = set(re.findall(r"WROTE (\w+) (\d)", proc.stdout))
        assert wrote == ({("save_model_file", "0"), ("save_optimizer_file", "1")} if strategy == "ddp" else set())
    assert proc.stdout.count("SAVE_COLLECTIVES 0") == 2, proc.stdout
    assert_equal(load_file(str(tmp_path / "async.st")), load_file(str(tmp_path / "sync.st")))
    assert_same_checkpoints(tmp_path / "sync", tmp_path / "async", count=5)  # steps 3, 4, 6, 8, 9 (epoch ends: 3, 6, 9)


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.long), 3])
def test_deepspeed_async_saves_write_in_the_background_the_files_a_synchronous_save_writes(tmp_path, stage):
    """DeepSpeed ZeRO on 2 processes with a slow disk (each file 0.6 s late): the async save copies the engine's
    files into host memory and writes them in the background, so the loop is held a fraction of the synchronous
    save's time. The copy of what only the engine's step writes (weights, master partitions, optimizer state) is
    made by the writer, here 0.3 s late while the next micro-batches run, and the step waits for it. The
    checkpoints are byte for byte the synchronous ones (a model whose every parameter has an even size: DeepSpeed's
    padding of a partition holds whatever memory it had), the run ends with the same weights, and DeepSpeed's own
    zero_to_fp32.py reads the last checkpoint into those weights. Taking an async save's state makes no collective
    (DeepSpeed's own save makes 2 barriers, 2 all-reduces and, under ZeRO-3, a gather of the persistent parameters)."""
    blocked = {}
    for mode in ("sync", "async"):
        flags = ["--sync"] if mode == "sync" else ["--copy-delay", 0.3]
        proc = run("--ckpt", tmp_path / mode, "--out", tmp_path / f"{mode}.st", "--disk-delay", 0.6,
                   "--strategy", "deepspeed", "--zero-stage", stage, "--classes", 4, *flags, nproc=2)
        blocked[mode] = finished(proc)
    assert proc.stdout.count("SAVE_COLLECTIVES 0") == 2, proc.stdout
    final = load_file(str(tmp_path / "sync.st"))
    assert_equal(load_file(str(tmp_path / "async.st")), final)
    assert_same_checkpoints(tmp_path / "sync", tmp_path / "async", count=5)
    assert min(blocked["sync"]) >= 0.6                 # the loop waited for the slow disk at every save
    assert blocked["async"][0] < min(blocked["sync"]) / 3   # the first async save: into memory, the late copy waited for
    last = visible(tmp_path / "async")[-1]
    subprocess.run([sys.executable, str(last / "zero_to_fp32.py"), str(last), str(tmp_path / "fp32"), "--tag",
                    "deepspeed", "--safe_serialization"], check=True, capture_output=True, timeout=120, cwd=tmp_path)
    assert_equal(load_file(str(tmp_path / "fp32" / "model.safetensors")), final)


def test_zero3_saves_leave_training_as_it_was_with_partitioned_and_persistent_parameters(tmp_path):
    """ZeRO-3 on 2 processes, 8 steps: synchronous and async saves every 2 steps end with the weights of the same
    training with no save, bit for bit, and so does a run resumed from the checkpoint of step 6. A save frees the
    persistent parameters (the biases here) and puts back what they held instead of gathering them again; the
    partitioned weights are released as DeepSpeed's own save releases them; a resume reads the persistent ones whole
    from the rank's own file, with no collective. Over `PERSISTENT_MAX_BYTES` they are not saved whole, and the
    resume gathers them as DeepSpeed's own load does, to the same weights."""
    proc = run_launch("zero3_saving.py", tmp_path, nproc=2, timeout=300)
    unsaved = load_file(str(tmp_path / "none.safetensors"))
    for run in ("sync", "async", "resumed", "capped", "capped-resumed"):
        assert_equal(load_file(str(tmp_path / f"{run}.safetensors")), unsaved)
    for run in ("sync", "async", "capped"):  # saved at 2, 4, 6, 8; the resumed runs, at 8
        assert [d.name for d in visible(tmp_path / f"ckpt-{run}")] == ["step-00000006", "step-00000008"]
    for run in ("resumed", "capped-resumed"):
        assert [d.name for d in visible(tmp_path / f"ckpt-{run}")] == ["step-00000008"]
    model_states = lambda run: [torch.load(f, weights_only=False) for f in sorted(
        (tmp_path / f"ckpt-{run}" / "step-00000006" / "deepspeed").glob("*model_states.pt"))]
    assert [sorted(s[PERSISTENT]) for s in model_states("async")] == [["0.bias", "2.bias"]] * 2
    assert [PERSISTENT in s for s in model_states("capped")] == [False, False]
    assert proc.stdout.count("resumed LOAD COLLECTIVES 0") == 2, proc.stdout  # "capped-resumed" gathers the biases
    assert proc.stdout.count("capped-resumed LOAD COLLECTIVES 2") == 2, proc.stdout


def test_a_copy_that_spans_the_next_micro_batches_still_holds_the_state_of_its_step(tmp_path):
    """The parameters and optimizer state are copied while the next micro-batches (GradAccum(steps=2)) run their
    forward (BatchNorm's running statistics change there) and backward; the copy, 0.3 s late here, is waited for
    before the step. The checkpoints are the synchronous run's, byte for byte, and the wait counts as held."""
    out = {}
    for mode in ("sync", "async"):
        flags = ["--sync"] if mode == "sync" else ["--copy-delay", 0.3]
        proc = run("--ckpt", tmp_path / mode, "--out", tmp_path / f"{mode}.st", "--batchnorm", *flags)
        out[mode] = finished(proc), json.loads(proc.stdout.split("COPYWAIT ", 1)[1].splitlines()[0])
    assert_equal(load_file(str(tmp_path / "async.st")), load_file(str(tmp_path / "sync.st")))
    assert_same_checkpoints(tmp_path / "sync", tmp_path / "async")
    held, copy_waits = out["async"]
    assert max(copy_waits) >= 0.1                                    # the loop did wait for the late copy ...
    assert all(h >= w for h, w in zip(held, copy_waits, strict=True))  # ... and the wait is counted as held


@pytest.mark.parametrize("nproc", [pytest.param(1, marks=pytest.mark.long), 2])
def test_async_saves_killed_at_any_moment_leave_only_complete_checkpoints_and_resume_exactly(tmp_path, reference,
                                                                                            nproc):
    root, out = tmp_path / "ckpt", tmp_path / "run.st"
    killed_mid_write = 0
    moments = random.Random(nproc).sample(range(10, 60), 4)  # hundredths of a second into each (resumed) fit
    for after in [m / 100 for m in moments]:  # 4 kills, each resumed; together less than the 7 saves' 2.8 s of writes
        proc = run("--ckpt", root, "--out", out, "--write-delay", 0.4, "--kill-after", after, nproc=nproc)
        assert proc.returncode != 0 and "STEPS" not in proc.stdout, proc.stdout + proc.stderr
        assert proc.returncode == -signal.SIGKILL or nproc > 1, proc.stderr
        killed_mid_write += any(p.name.startswith(".step-") for p in root.iterdir())
        for d in visible(root):  # whatever is visible is complete and loads
            assert missing_files(d) == [], d
            read_state(d)
            load_file(str(d / "model.safetensors"))
        if (root / "latest").exists():
            assert (root / (root / "latest").read_text()) in visible(root)
    assert killed_mid_write >= 1  # some kill came while a save was in flight
    finished(run("--ckpt", root, "--out", out, "--write-delay", 0.4, nproc=nproc))
    assert_equal(load_file(str(out)), reference(nproc))


def test_fsdp2_async_sharded_checkpoints_resume_exactly_after_kills(tmp_path):
    """FSDP2 writes through torch's distributed checkpoint (its async save on a group of its own), every rank its
    shards: a run killed twice mid-save and resumed ends with the weights of an uninterrupted synchronous one, and
    the resume makes no collective."""
    fsdp = ("--strategy", "fsdp", "--write-delay", 0.3)
    finished(run("--ckpt", tmp_path / "ref", "--out", tmp_path / "ref.st", "--sync", *fsdp, nproc=2))
    root, out = tmp_path / "ckpt", tmp_path / "run.st"
    # saves every 4 steps, each 0.3 s late per rank: killed after step 5 (step-4's save in flight), then, resumed,
    # after step 9 (step-8's in flight); a kill by step, not by time, so a fast machine cannot finish first
    for step in (5, 9):
        proc = run("--ckpt", root, "--out", out, "--kill-at-step", step, *fsdp, nproc=2)
        assert proc.returncode != 0 and "STEPS" not in proc.stdout, proc.stdout + proc.stderr
        for d in visible(root):
            assert missing_files(d) == [] and (d / "sharded" / ".metadata").is_file(), d
    assert visible(root), "no checkpoint was committed before the kills"
    proc = run("--ckpt", root, "--out", out, *fsdp, nproc=2)
    finished(proc)
    assert_equal(load_file(str(out)), load_file(str(tmp_path / "ref.st")))
    # each rank read its own shards without waiting for the other (torch's planning collectives cost more than the
    # reads on a small or busy host)
    assert proc.stdout.count("LOAD_COLLECTIVES 0") == 2, proc.stdout


def test_a_failed_background_write_stops_the_run_naming_the_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    proc = run("--ckpt", root, "--out", tmp_path / "run.st", "--fsize", 3000)  # the optimizer, RNG files are larger
    assert proc.returncode == 1, proc.stdout + proc.stderr
    error, step = proc.stdout.split("ERROR ", 1)[1].split("\nSTEP ")
    assert error.startswith("OSError: ") and f"could not write the checkpoint {root}/step-00000004: " in error, error
    assert 4 < int(step) < 8                           # noticed at a step after the save, before the next save
    assert visible(root) == [] and not (root / "latest").exists()
    assert [p.name for p in root.iterdir() if p.name.startswith(".step-")] == []   # its space is freed


def test_sigterm_during_an_async_write_waits_for_it_and_exits_143(tmp_path, reference):
    root, out = tmp_path / "ckpt", tmp_path / "run.st"
    proc = run("--ckpt", root, "--out", out, "--write-delay", 1.0, "--sigterm-in-write", 1)
    assert proc.returncode == 143, proc.stdout + proc.stderr
    names = [d.name for d in visible(root)]
    # the save in flight when SIGTERM came was finished (and is the preemption's checkpoint when the signal was
    # seen at its own step), then the preemption's save, which `latest` names
    assert names[0] == "step-00000004" and all(missing_files(root / n) == [] for n in names)
    assert (root / "latest").read_text() == names[-1]
    assert "SIGTERM received: saved" in proc.stdout
    finished(run("--ckpt", root, "--out", out))
    assert_equal(load_file(str(out)), reference(1))


@pytest.mark.parametrize("kwargs, message", [
    ({"async_save": "yes"}, "async_save must be True or False, got 'yes'"),
    ({"io_timeout": 0}, "io_timeout must be a positive, finite number of seconds, or None for no limit; got 0"),
    ({"io_timeout": float("nan")}, "io_timeout must be a positive, finite .*; got nan"),
    ({"io_timeout": float("inf")}, "io_timeout must be a positive, finite .*; got inf"),
])
def test_bad_arguments_are_refused_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Checkpoint(**kwargs)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_slow_disk_is_named_with_the_time_and_fails_past_io_timeout(dls, tmp_path, monkeypatch, capsys, async_save):
    import time

    import cadence.callbacks.checkpoint.state as state
    import cadence.callbacks.checkpoint.writer as writer
    from fixtures import make_learner

    monkeypatch.setattr(writer, "SLOW_NOTICE_S", 0.5)  # a minute in real runs
    write = state.save_torch
    monkeypatch.setattr(state, "save_torch", lambda obj, path: (time.sleep(3), write(obj, path)))  # a stuck disk
    learn = make_learner(dls, tmp_path, [Checkpoint("ckpt", io_timeout=1.5, async_save=async_save)])
    expected = rf"writing {tmp_path}/ckpt/step-\d+ took more than io_timeout=1.5 s \(\d s; rank\(s\) \[0\] not done\)"
    with pytest.raises(TimeoutError, match=rf"Checkpoint: {expected}: the disk is too slow"):
        learn.fit(1)
    err = capsys.readouterr().err
    assert f"Checkpoint: {tmp_path}/ckpt/step-" in err and "is still being written after 1 s" in err, err
    assert visible(tmp_path / "ckpt") == []


def test_accelerator_async_save_state_holds_the_state_of_its_step_and_is_finished_by_end_training(tmp_path,
                                                                                                   monkeypatch):
    import time

    import cadence.accelerate.checkpointing as checkpointing
    from cadence import Accelerator

    torch.manual_seed(0)
    acc = Accelerator()
    net = torch.nn.Linear(64, 32)
    model, opt = acc.prepare(net, torch.optim.AdamW(net.parameters(), lr=0.1))

    def step():
        acc.backward(model(torch.randn(8, 64)).square().mean())
        opt.step()
        opt.zero_grad()
    step()
    acc.save_state(tmp_path / "sync")
    write = checkpointing.save_torch
    monkeypatch.setattr(checkpointing, "save_torch", lambda obj, path: (time.sleep(0.5), write(obj, path)))  # slow disk
    start = time.perf_counter()
    acc.save_state(tmp_path / "async", async_save=True)
    assert time.perf_counter() - start < 0.4 and not (tmp_path / "async").exists()  # the loop goes on at once
    step()  # training goes on while it is written: the checkpoint keeps the state of its own step
    acc.end_training()
    assert_same_files(tmp_path / "sync", tmp_path / "async")


def assert_same_files(sync, async_):
    """The Accelerator's two `save_state` directories hold the same files, byte for byte (the optimizer's too)."""
    files = sorted(p.name for p in sync.iterdir())
    assert files == sorted(p.name for p in async_.iterdir()) and "optimizer.pt" in files
    for f in files:
        assert (sync / f).read_bytes() == (async_ / f).read_bytes(), f


@pytest.mark.parametrize("strategy", [None, "fsdp"])
def test_one_process_async_saves_reserve_their_host_memory_at_the_first_step(dls, tmp_path, monkeypatch, strategy):
    """On one process FSDP shards nothing and writes the plain format from the model's own memory, as a single
    device does: the host memory of the async copy is reserved at the fit's first step, not faulted in by the first
    save's copy (on this host that costs ten times the copy: FSDP's first async save held the loop 60 ms)."""
    from cadence.distributed.staging import HostBuffers
    from fixtures import make_learner

    reserved, reserve = [], HostBuffers.reserve
    monkeypatch.setattr(HostBuffers, "reserve", lambda self, model, opt: (reserved.append(opt is not None),
                                                                          reserve(self, model, opt)))
    ckpt = Checkpoint("ckpt", every_n_steps=2, async_save=True)
    learn = make_learner(dls, tmp_path, [ckpt])
    with learn.distrib_ctx(strategy=strategy):
        learn.fit(1)
    assert reserved == [True] and len(ckpt.saves) >= 2


def saved(obj) -> bytes:
    """What torch.save writes of `obj`."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_a_snapshot_writes_the_states_bytes_with_views_that_have_history_and_python_attributes():
    """DeepSpeed's files hold slices of a master partition with autograd history (made by the snapshot itself, as
    deepcopy refuses them) and partitions carrying a Python attribute (`ds_id`), which torch.save writes: the
    snapshot's file is the state's, byte for byte, and stays so when training changes the state after it."""
    from cadence.distributed.staging import HostBuffers

    master = torch.arange(12, dtype=torch.float32).requires_grad_()
    master.ds_id = "0_11"
    piece = master.narrow(0, 2, 4)
    piece.ds_id = "2_5"
    state = {"flat": [master], "pieces": [piece], "step": torch.tensor(3.0)}
    assert not piece.is_leaf
    snapshot = HostBuffers().snapshot(state, "optim_states.pt")
    expected = saved(state)
    assert saved(snapshot) == expected
    with torch.no_grad():
        master.add_(1)
    assert saved(snapshot) == expected


def test_a_snapshot_copies_only_what_torch_save_writes_and_refuses_what_a_view_would_change():
    """A master's `.grad` (ZeRO-3 with its optimizer offloaded keeps it set) is not copied at the save point, as
    torch.save does not write it; a Parameter keeps its class, its attributes and the part of the storage it views,
    byte for byte; a lazily conjugated tensor, whose conjugation a view of the copy would lose, leaves the file to
    be serialized at once (None)."""
    from cadence.distributed.staging import HostBuffers

    master = torch.zeros(1000, requires_grad=True)
    master.grad = torch.ones(1000)
    whole = torch.arange(10.0)
    param = nn.Parameter(whole[2:6])
    param.ds_id = "2_5"
    state = {"flat": [master], "whole": whole, "param": param}
    snapshot = HostBuffers().snapshot(state, "optim_states.pt")
    assert saved(snapshot) == saved(state)
    assert snapshot["flat"][0].grad is None and snapshot["flat"][0].requires_grad
    assert type(snapshot["param"]) is nn.Parameter and snapshot["param"].ds_id == "2_5"
    assert snapshot["param"].untyped_storage().data_ptr() == snapshot["whole"].untyped_storage().data_ptr()
    assert HostBuffers().snapshot({"c": torch.randn(3, dtype=torch.cfloat).conj()}, "c.pt") is None


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_async_saves_copy_into_host_memory_reserved_at_the_first_step(dls, tmp_path, monkeypatch, stage):
    """Under DeepSpeed (one process) the weights, master partitions and optimizer state that the writer copies late
    go into host memory allocated and faulted in at the fit's first step, not by the first save's copy; the
    checkpoints hold what a synchronous run's hold (compared loaded: two engines in one process number their
    partitions apart; the bytes are compared in the 2-process test above, each run its own process)."""
    from cadence.distributed.staging import HostBuffers
    from fixtures import make_learner

    reserved, reserve = [], HostBuffers.reserve_storages

    def recording(self, tensors):
        reserve(self, tensors)
        self.ready()
        reserved.append((self, {s.data_ptr() for spare in self._spare.values() for s in spare}))
    monkeypatch.setattr(HostBuffers, "reserve_storages", recording)
    for mode in ("sync", "async"):
        learn = make_learner(dls, tmp_path, [Checkpoint(mode, every_n_steps=2, async_save=mode == "async")])
        with learn.distrib_ctx(strategy="deepspeed", zero_stage=stage):
            learn.fit(1)
    (buffers, addresses), = reserved
    taken = {s.data_ptr() for kept in buffers._snapshots.values() for s in kept}
    assert addresses and addresses <= taken                  # every reserved storage was the memory of a late copy
    names = [d.name for d in visible(tmp_path / "sync")]
    assert names == [d.name for d in visible(tmp_path / "async")] and len(names) == 3   # steps 2, 4, the epoch's end
    for name in names:
        files = sorted((tmp_path / "sync" / name / "deepspeed").glob("*.pt"))
        assert len(files) == 2, files                         # the model's and the optimizer's
        for f in files:
            assert_same_contents(torch.load(f, weights_only=False),
                                 torch.load(tmp_path / "async" / name / "deepspeed" / f.name, weights_only=False))


def test_zero3_model_states_file_holds_the_persistent_parameters_not_the_partitions_they_view(dls, tmp_path):
    """ZeRO-3 on one process: a persistent parameter (every one but the 512 x 512 weight, under DeepSpeed's 100k
    elements) views the flat partition of every parameter, and saving that view would save the whole partition: the
    model-states file holds each persistent parameter on its own, and the large weight only in the optimizer's
    file."""
    from fixtures import make_learner

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 3))
    learn = make_learner(dls, tmp_path, [Checkpoint("ckpt", every_n_steps=2)], model=model)
    with learn.distrib_ctx(strategy="deepspeed", zero_stage=3):
        learn.fit(1)
        persistent = {name: p.detach().clone() for name, p in model.named_parameters() if name != "2.weight"}
    last = tmp_path / "ckpt" / (tmp_path / "ckpt" / "latest").read_text() / "deepspeed"
    states, = last.glob("*model_states.pt")
    saved = torch.load(states, weights_only=False)[PERSISTENT]
    assert saved.keys() == persistent.keys() and all(torch.equal(saved[k], persistent[k]) for k in persistent)
    assert states.stat().st_size < 100_000 < 512 * 512 * 4, states.stat().st_size  # the 512 x 512 weight is 1 MiB


def test_the_save_log_line_counts_what_the_engine_wrote_at_the_save_point(dls, tmp_path, capsys):
    """DeepSpeed writes its files at a synchronous save point, before cadence's writer starts: the log line's time
    and throughput are from the loop's stop to the commit, so they cover those files too (it said "in 0.00 s
    (160 GiB/s)")."""
    from fixtures import make_learner

    model = nn.Sequential(nn.Linear(8, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 3))
    learn = make_learner(dls, tmp_path, [Checkpoint("ckpt", every_n_steps=2)], model=model)  # 64 MiB saved
    with learn.distrib_ctx(strategy="deepspeed", zero_stage=1):
        learn.fit(1)
    lines = [line for line in capsys.readouterr().out.splitlines() if " written: " in line]
    assert lines, "no save was logged"
    for line in lines:
        written, held = (float(re.search(rf"{word} ([0-9.]+) s", line).group(1)) for word in (r"B in", "held"))
        assert written >= held >= 0.01, line


def test_checkpoint_files_record_device_memory_as_host_memory_as_their_async_copies_do(tmp_path, monkeypatch):
    """torch.save records where each storage lives ("cuda:0"); an async save writes from a host copy ("cpu"). On a
    GPU that made the synchronous and async optimizer files differ (seen on an H200, tests/callbacks/
    test_checkpoint_gpu.py), so a checkpoint file records every storage as host memory, wherever it is (and loads
    on a machine without that GPU). A stand-in tag plays the GPU's here (this machine has none); the tagging is the
    saving thread's alone, and `Accelerator.save` keeps torch's tags."""
    import io
    import threading
    import zipfile

    from cadence.accelerate.saving import save_object
    from cadence.serialization import _HOST_TAGS, host_tagged, save_torch

    registry = torch.serialization._package_registry
    ours, torchs = [e for e in registry if e[0] < 0], [e for e in registry if e[0] >= 0]
    monkeypatch.setattr(torch.serialization, "_package_registry", [*ours, (0, lambda s: "gpu:7", lambda s, l: None),
                                                                   *torchs])
    state = {"exp_avg": torch.ones(3)}

    def tags(path):
        with zipfile.ZipFile(path) as z:
            pickled = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
        return {tag for tag in (b"cpu", b"gpu:7") if tag in pickled}
    save_torch(state, tmp_path / "optimizer.pt")
    save_object(state, tmp_path / "user.pt", safe_serialization=False, is_main_process=True)
    assert tags(tmp_path / "optimizer.pt") == {b"cpu"} and tags(tmp_path / "user.pt") == {b"gpu:7"}
    save_torch(state, tmp_path / "legacy.pt", zipfile=False)  # torch's legacy format (a DeepSpeed setting)
    legacy = (tmp_path / "legacy.pt").read_bytes()
    assert b"cpu" in legacy and b"gpu:7" not in legacy
    other = io.BytesIO()
    with host_tagged():
        thread = threading.Thread(target=torch.save, args=(state, other))
        thread.start()
        thread.join()
    assert tags(other) == {b"gpu:7"} and not _HOST_TAGS.on


def test_a_saves_time_leaves_out_its_wait_for_the_save_before(tmp_path):
    """An async save that waited 0.5 s for the one before it, then wrote for 0.1 s: the log line's time (and so its
    throughput) is the 0.1 s, while the loop's held time counts the wait."""
    import time

    from cadence.callbacks.checkpoint.writer import BackgroundWrite

    class Files:  # this rank's part, written in 0.1 s
        def write(self):
            time.sleep(0.1)

    class OneProcess:
        is_main, device = False, "cpu"

        def broadcast(self, value):
            return value
    started = time.perf_counter()
    time.sleep(0.5)  # the save before, still being written
    write = BackgroundWrite(Files(), OneProcess(), None, tmp_path / "step-00000004", blocking=False, since=started,
                            waited_s=time.perf_counter() - started).start()
    write.wait()
    assert 0.1 <= write.stats["seconds"] < 0.35 and write.stats["held_s"] >= 0.5, write.stats


def test_host_tagging_survives_a_reload_of_its_module():
    """A reload (Jupyter's autoreload) registers the tagger again: two at one priority made torch's registry sort
    fail, for every later `register_package` of any library; and functions imported before the reload still tag."""
    code = """
import importlib, torch
import cadence.serialization as serialization
from cadence.serialization import host_tagged
importlib.reload(serialization)
torch.serialization.register_package(-272, lambda s: None, lambda s, l: None)  # raised TypeError
torch.serialization.register_package(0, lambda s: "gpu:7", lambda s, l: None)
storage = torch.ones(2).untyped_storage()
for tagged in (host_tagged, serialization.host_tagged):
    with tagged():
        print(torch.serialization.location_tag(storage))
print(torch.serialization.location_tag(storage))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=cadence_env(), cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.split() == ["cpu", "cpu", "gpu:7"], proc.stdout + proc.stderr


def assert_same_contents(a, b):
    """Nested dicts and lists alike, their tensors equal (dtype and all), numbers and strings equal."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same_contents(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_contents(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, (int, float, str, bool, type(None))):
        assert a == b


def test_accelerator_async_save_state_under_deepspeed_writes_the_synchronous_bytes(tmp_path):
    """`save_state(async_save=True)` under ZeRO-3 (2 processes): the engine's files are taken at the call and written
    behind; the step after it does not reach them, and the checkpoint is the synchronous one byte for byte."""
    proc = run_launch("accelerator_async_deepspeed.py", tmp_path, 3, nproc=2, timeout=240)
    files = json.loads(proc.stdout.split("FILES ", 1)[1].splitlines()[0])
    assert sum("zero_pp_rank_" in f and f.endswith("optim_states.pt") for f in files) == 2, files
    assert json.loads(proc.stdout.split("DIFFERENT ", 1)[1].splitlines()[0]) == []
