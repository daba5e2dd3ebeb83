"""DeepSpeed ZeRO 0-3 behind the Strategy interface: real DeepSpeed engines on 2 CPU processes over gloo.

Each launch trains several Learners in sequence (tests/scripts/deepspeed_runs.py), so the slow
start of a DeepSpeed launch is paid once; the tests compare the exported full weights.
"""

import contextlib
import importlib
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from cadence import Checkpoint
from cadence.distributed.deepspeed import DeepSpeed, build_config
from tests.distributed.test_engines import assert_weights_close
from tests.helpers import SCRIPTS, run_launch

pytest.importorskip("deepspeed")


def launch(tmp_path, runs, flags=(), timeout=480):
    proc = run_launch("deepspeed_runs.py", str(tmp_path), json.dumps(runs), flags=flags, timeout=timeout)
    results = json.loads((tmp_path / "results.json").read_text())
    weights = {r["name"]: load_file(tmp_path / r["name"] / "model.safetensors") for r in runs
               if not r.get("expect_error")}
    return results, weights, proc


# DeepSpeed's optimizer and scheduler, with the values the Learner knows left to it
CONFIG_OPTIMIZER = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                              "weight_decay": "auto", "torch_adam": True}},
                    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto",
                                                                      "warmup_num_steps": "auto",
                                                                      "total_num_steps": "auto"}}}


@pytest.mark.slow
@pytest.mark.timeout(900)  # one launch, a dozen engines: minutes on a loaded 2-core machine
def test_zero_stages_train_like_ddp_accumulate_clip_bf16_and_refuse_a_bad_batch_size(tmp_path, monkeypatch):
    z = lambda stage, **extra: {"strategy": "deepspeed", "kwargs": {"zero_stage": stage}, **extra}
    runs = [{"name": "ddp", "strategy": "ddp"}, {"name": "z0", **z(0)}, {"name": "z1", **z(1)},
            {"name": "z2", **z(2)}, {"name": "z3", **z(3)},
            {"name": "ddp_big", "strategy": "ddp", "bs": 16}, {"name": "z2_accum", **z(2), "accum": 4},
            {"name": "ddp_clip", "strategy": "ddp", "clip": 0.05}, {"name": "z2_clip", **z(2), "clip": 0.05},
            {"name": "z3_clip", **z(3), "clip": 0.05}, {"name": "z2_bf16", **z(2), "precision": "bf16"},
            {"name": "z3_native", **z(3), "native_ckpt": True},
            {"name": "z2_fp16", **z(2), "precision": "fp16", "expect_error": not torch.ops.mkldnn._is_mkldnn_fp16_supported()},
            {"name": "z2_config_opt", "strategy": "deepspeed", "kwargs": {"zero_stage": 2, "config": CONFIG_OPTIMIZER}},
            {"name": "bad_tbs", "strategy": "deepspeed", "kwargs": {"zero_stage": 2, "config": {"train_batch_size": 7}},
             "expect_error": True}]
    results, w, _ = launch(tmp_path, runs)
    for name in ("z0", "z1", "z2", "z3"):  # fp32, clipping off: the same updates as DDP
        assert results[name]["engine"] == "DeepSpeedEngine" and results[name]["released"] == "Sequential"
        assert_weights_close(w["ddp"], w[name], rtol=1e-4, atol=1e-5)
        assert results[name]["step"] == results["ddp"]["step"] == 24  # 12 batches per rank and epoch, 2 epochs
    # GradAccum(4) with batches of 4 is one step of batch 16: the engine accumulates, GradAccum marks the windows
    assert results["z2_accum"]["step"] == results["ddp_big"]["step"] == 6
    assert_weights_close(w["ddp_big"], w["z2_accum"], rtol=1e-4, atol=1e-5)
    # clipping by the engine (off by default, DeepSpeed's own default is 1.0) matches DDP's clipping
    assert results["ddp_clip"]["valid_loss"] != pytest.approx(results["ddp"]["valid_loss"], rel=1e-3)
    for name in ("z2_clip", "z3_clip"):
        assert_weights_close(w["ddp_clip"], w[name], rtol=1e-4, atol=1e-5)
        assert results[name]["grad_norm"] == pytest.approx(results["ddp_clip"]["grad_norm"], rel=1e-4)  # before clipping
    bf16 = results["z2_bf16"]
    assert bf16["valid_loss"] < 0.5 * bf16["untrained"]
    assert all(t.dtype == torch.float32 for t in w["z2_bf16"].values())  # the fp32 masters are exported
    fp16 = results["z2_fp16"]  # DeepSpeed's CPU accelerator has fp16 only with oneDNN's (AVX512-FP16 / AMX-FP16)
    if "error" in fp16:
        assert "cannot train in fp16 on this machine" in fp16["error"] and "use bf16 on CPU" in fp16["error"]
    else:
        assert fp16["valid_loss"] < 0.5 * fp16["untrained"]
    error = results["bad_tbs"]["error"]
    assert "train_batch_size 7" in error and "micro batch 4" in error and "accumulation 1" in error
    assert "processes 2" in error
    # a config naming its own optimizer and scheduler, "auto" filled: it trains, and the scheduler decayed the lr
    assert results["z2_config_opt"]["valid_loss"] < 0.5 * results["z2_config_opt"]["untrained"]
    assert results["z2_config_opt"]["lr"] < 1e-3 < results["z2"]["lr"] == 1e-2  # decayed over the fit's 24 steps
    # the engine's own checkpoint after epoch 1, loaded by a new Learner: epoch 2 ends where the 2-epoch run did
    assert_weights_close(w["z3"], w["z3_native"], rtol=0, atol=0)
    # the exported weights load into a plain module that predicts what the engine predicted
    monkeypatch.syspath_prepend(str(SCRIPTS))
    script = importlib.import_module("deepspeed_runs")
    for name in ("z2", "z3", "z2_bf16"):
        model, (x, _) = script.make_model(), script.learner({}).dls.valid.dataset.tensors
        model.load_state_dict(w[name])
        engine_preds = torch.load(tmp_path / name / "preds.pt")
        bf16 = name == "z2_bf16"  # the engine predicted with bf16 weights: the fp32 export agrees to bf16's precision
        torch.testing.assert_close(model(x).detach(), engine_preds.float(), **(dict(rtol=0.02, atol=0.05) if bf16 else {}))


def test_config_from_options_and_file(tmp_path):
    cfg = build_config(zero_stage=3, offload_optimizer_device="cpu", offload_param_device="cpu",
                       zero3_save_16bit_model=True)
    assert cfg["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                        "offload_param": {"device": "cpu"},
                                        "stage3_gather_16bit_weights_on_model_save": True}
    assert cfg["gradient_clipping"] == "auto"  # filled with 0 unless GradClip: DeepSpeed's own default would clip at 1
    file = tmp_path / "ds.json"
    file.write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 2}))
    from_file = build_config(config_file=str(file), zero_stage=2)  # an option overrides the file
    assert from_file["zero_optimization"]["stage"] == 2 and from_file["gradient_accumulation_steps"] == 2


@pytest.mark.parametrize("options, message", [
    ({"zero_stage": 4}, "zero_stage 4 does not exist"),
    ({"zero_stage": 1, "offload_param_device": "cpu"}, "offload_param_device='cpu' needs zero_stage 3"),
    ({"zero_stage": 0, "offload_optimizer_device": "cpu"}, "needs zero_stage 1 or 2 or 3"),
    ({"zero_stage": 2, "offload_optimizer_device": "disk"}, "offload_optimizer_device 'disk' does not exist"),
    ({"zero_stag": 2}, "unknown DeepSpeed option(s) ['zero_stag']"),
    ({"zero_stage": 2, "zero3_init_flag": True}, "zero3_init_flag needs zero_stage 3"),
    ({"config": "/nonexistent/ds.json"}, "does not exist"),
])
def test_bad_options_are_refused_naming_the_value(options, message):
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        DeepSpeed(device="cpu", **options)
    assert message in str(e.value)


def test_fp16_trains_where_deepspeed_has_it_and_is_refused_naming_bf16_where_not():
    strategy = DeepSpeed(device="cpu", zero_stage=2)
    deepspeed = importlib.import_module("cadence.distributed.deepspeed").import_deepspeed()
    if deepspeed.accelerator.get_accelerator().device_name() == "cpu" and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
        # this CPU has no oneDNN fp16: DeepSpeed's engine would fail with "Type fp16 is not supported on your device"
        with pytest.raises(ValueError, match=r"cannot train in fp16 on this machine .*use bf16 on CPU"):
            strategy._engine_config("fp16", micro_batch=4)  # what setup builds the engine with, before training
    else:
        assert strategy._engine_config("fp16", micro_batch=4)["fp16"] == {"enabled": True}
    assert strategy._engine_config("bf16", micro_batch=4)["bf16"] == {"enabled": True}


# Accelerate's DeepSpeed example config (its docs' `accelerate config` output for ZeRO-2)
ACCELERATE_DEEPSPEED_YAML = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  gradient_accumulation_steps: 2
  gradient_clipping: 1.0
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: false
  zero3_save_16bit_model: false
  zero_stage: 2
  deepspeed_multinode_launcher: standard
distributed_type: DEEPSPEED
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: true
"""


def _resolved(argv):
    import argparse

    from cadence.distributed.launch import add_launch_args, launch_env, resolve_config

    p = argparse.ArgumentParser()
    add_launch_args(p)
    config = resolve_config(p.parse_args([*argv, "train.py"]))
    return config, launch_env(config)


def test_launcher_flags_and_an_accelerate_config_reach_the_strategy(tmp_path, monkeypatch):
    config, variables = _resolved(["--cpu", "--num_processes", "2", "--use_deepspeed", "--zero_stage", "3",
                                   "--offload_param_device", "cpu", "--zero3_init_flag", "true"])
    assert variables["CADENCE_STRATEGY"] == "deepspeed"
    monkeypatch.setenv("CADENCE_DEEPSPEED_CONFIG", variables["CADENCE_DEEPSPEED_CONFIG"])
    strategy = DeepSpeed(device="cpu")  # what a worker builds from the launcher's variables
    assert strategy.stage == 3 and strategy.zero3_init
    assert strategy.config["zero_optimization"]["offload_param"] == {"device": "cpu"}
    file = tmp_path / "accelerate.yaml"
    file.write_text(ACCELERATE_DEEPSPEED_YAML)
    config, variables = _resolved(["--config_file", str(file)])
    assert variables["CADENCE_STRATEGY"] == "deepspeed"
    assert variables["CADENCE_GRADIENT_ACCUMULATION_STEPS"] == "2"  # the block's accumulation becomes GradAccum(2)
    with pytest.raises(ValueError, match="deepspeed_config: DeepSpeed zero_stage 7 does not exist"):
        _resolved(["--config_file", str(file), "--zero_stage", "7"])  # refused before any worker starts


def resume_launch(tmp_path, out, stages, *extra):
    return run_launch("deepspeed_resume.py", str(tmp_path / "ckpt"), str(out), stages, *extra, timeout=480,
                      check=not extra or extra[0] != "--kill-at")


@pytest.mark.slow
@pytest.mark.timeout(1500)  # four launches
def test_zero2_and_zero3_killed_mid_epoch_resume_bitwise(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    ref.mkdir(), run.mkdir()
    run_launch("deepspeed_resume.py", str(tmp_path / "ref_ckpt"), str(ref), "2,3", timeout=480)
    for stage in (2, 3):  # SIGKILL every rank after step 4, mid-epoch 2, right after its checkpoint
        killed = resume_launch(tmp_path, run, str(stage), "--kill-at", "4")
        assert killed.returncode != 0
        assert (tmp_path / "ckpt" / f"zero{stage}" / "latest").read_text() == "step-00000004"
        state = json.loads((tmp_path / "ckpt" / f"zero{stage}" / "step-00000004" / "state.json").read_text())
        assert not state["epoch_complete"]
    done = resume_launch(tmp_path, run, "2,3", "--resume")
    assert "ZERO2 STEPS 6" in done.stdout and "ZERO3 STEPS 6" in done.stdout
    assert "ZERO2 ENGINE FILES READ [1]" in done.stdout and "ZERO3 ENGINE FILES READ [1]" in done.stdout  # once each
    # no rank waits for another in its resume: ZeRO-3's persistent parameters come whole from the rank's own file,
    # not gathered from every rank's partitions (4 all-gathers here)
    assert done.stdout.count("ZERO2 LOAD COLLECTIVES 0") == done.stdout.count("ZERO3 LOAD COLLECTIVES 0") == 2
    # ZeRO-3's optimizer-states file read straight into the engine's fp32 masters on both ranks (a fresh engine has
    # no moments yet to read into); the bitwise end below says they were read right
    assert done.stdout.count("ZERO3 IN PLACE [1, 0]") == 2, done.stdout
    for stage in (2, 3):
        a, b = load_file(ref / f"zero{stage}.safetensors"), load_file(run / f"zero{stage}.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), stage


@pytest.mark.slow
@pytest.mark.timeout(1000)  # two launches
@pytest.mark.parametrize("nproc", [1, pytest.param(4, marks=pytest.mark.long)])
def test_a_zero_checkpoint_from_two_processes_resumes_mid_epoch_on_another_number_of_processes(tmp_path, nproc):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    run_launch("deepspeed_universal.py", str(ckpt), str(out), "2,3", timeout=480)
    saved = {stage: sorted(p.name for p in (ckpt / f"zero{stage}" / "step-00000003").rglob("*")) for stage in (2, 3)}
    done = run_launch("deepspeed_universal.py", str(ckpt), str(out), "2,3", "--resume", nproc=nproc, timeout=480)
    for stage in (2, 3):
        # DeepSpeed's universal format: every weight and Adam moment as the 2 processes left them, bitwise, and
        # each parameter group's own weight decay (DeepSpeed's ZeRO-3 loader alone gives every group group 0's)
        assert f"ZERO{stage} LOADED True True True" in done.stdout and f"ZERO{stage} STEPS 6" in done.stdout, nproc
        # the rest of the epoch trains on the same global batches: it ends where the 2-process run ended
        assert_weights_close(load_file(out / f"zero{stage}-2.safetensors"),
                             load_file(out / f"zero{stage}-{nproc}.safetensors"), rtol=1e-4, atol=1e-5)
        # the checkpoint is unchanged and the conversion beside it is gone
        assert sorted(p.name for p in (ckpt / f"zero{stage}" / "step-00000003").rglob("*")) == saved[stage]
        assert not list((ckpt / f"zero{stage}").glob(".*"))


def _engine_checkpoint(directory, world_size, stage):
    (directory / "deepspeed").mkdir()
    (directory / "deepspeed" / "cadence.json").write_text(json.dumps({"world_size": world_size, "zero_stage": stage}))
    (directory / "deepspeed" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")


@pytest.mark.parametrize("options, message", [
    ({"zero_stage": 3}, "ZeRO-2 checkpoint written by 4 processes; this run uses ZeRO-3 on 1: resume with zero_stage=2"),
    ({"zero_stage": 2, "offload_optimizer_device": "nvme", "offload_optimizer_nvme_path": "/nvme"},
     "written by 4 processes cannot be resumed on 1 with state offloaded to NVMe"),
])
def test_a_zero_checkpoint_this_run_cannot_resume_is_refused_before_loading(tmp_path, options, message):
    _engine_checkpoint(tmp_path, world_size=4, stage=2)
    with pytest.raises(ValueError) as e:  # no engine: refused before anything would load
        DeepSpeed(device="cpu", **options).load_checkpoint(tmp_path, None, None)
    assert message in str(e.value) and "zero_to_fp32.py" in str(e.value)


@pytest.mark.slow
@pytest.mark.timeout(900)  # + DeepSpeed's CPU Adam, compiled by `make setup-deepspeed` (else here, ~100 s)
def test_accelerate_config_launches_and_offload_and_zero3_init_train(tmp_path):
    """One launch from Accelerate's DEEPSPEED config (ZeRO-2, accumulation 2, clipping 1.0); in it, ZeRO-3 with the
    optimizer and parameters offloaded to the CPU (DeepSpeed's CPU Adam, compiled once and cached in the venv) and
    ZeRO-3 with the model built sharded (zero3_init_flag), each against the config's own run."""
    config = tmp_path / "accelerate.yaml"
    config.write_text(ACCELERATE_DEEPSPEED_YAML)
    offload = {"zero_stage": 3, "offload_optimizer_device": "cpu", "offload_param_device": "cpu"}
    runs = [{"name": "launcher", "strategy": None}, {"name": "offload", "strategy": "deepspeed", "kwargs": offload},
            {"name": "init", "strategy": "deepspeed", "kwargs": {"zero_stage": 3, "zero3_init_flag": True}}]
    results, w, _ = launch(tmp_path, runs, flags=("--config_file", str(config)), timeout=900)
    launched = results["launcher"]
    assert launched["engine"] == "DeepSpeedEngine" and launched["step"] == 12  # 24 batches, GradAccum(2) from the block
    assert launched["valid_loss"] < 0.5 * launched["untrained"]
    assert results["offload"]["step"] == 12
    assert_weights_close(w["launcher"], w["offload"], rtol=1e-3, atol=1e-4)  # CPU Adam steps like torch's AdamW
    # built sharded: no rank ever held the first Linear's 6 x 16 weight, each holds half of it
    assert results["init"]["untrained"] == {"numel": 0, "partition_numel": 6 * 16 // 2}
    assert_weights_close(w["launcher"], w["init"], rtol=1e-4, atol=1e-5)


# a notebook's cells: a DeepSpeed fit launched on 2 processes from the kernel, twice, then the kernel used again
NOTEBOOK_CELLS = ['''
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from cadence import DataLoaders, Learner, notebook_launcher

def train(stage):
    import torch.distributed as dist
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 6, generator=g)
    y = (x @ torch.randn(6, 3, generator=g)).argmax(1)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=8), DataLoader(TensorDataset(x, y), batch_size=8))
    learn = Learner(dls, nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3)), loss_func=nn.CrossEntropyLoss(),
                    opt_func=torch.optim.AdamW, lr=3e-2)
    untrained = learn.validate()["valid_loss"]
    with learn.distrib_ctx(strategy="deepspeed", zero_stage=stage, in_notebook=True):
        learn.fit(3)
        engine, world = type(learn.model).__name__, dist.get_world_size()
    return {"engine": engine, "world": world, "steps": learn.step, "untrained": untrained,
            "trained": learn.validate()["valid_loss"]}
''', 'results = [notebook_launcher(train, args=(stage,), num_processes=2) for stage in (2, 3)]',
    'import json; print("RESULT " + json.dumps(results)); print("KERNEL", sum(range(5)))']


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.long
def test_notebook_launcher_trains_with_deepspeed_on_two_processes_and_the_kernel_stays_usable(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    from tests.notebooks import output_text, outputs, python3_kernel

    kernel_name = python3_kernel(tmp_path, monkeypatch, one_thread=True)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in NOTEBOOK_CELLS])
    nbclient.NotebookClient(nb, timeout=480, kernel_name=kernel_name, resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = outputs(nb, "error")
    assert not errors, "\n".join(f"{e.ename}: {e.evalue}\n" + "\n".join(e.traceback) for e in errors)
    text = "".join(output_text(o) for o in outputs(nb, "stream"))
    results = json.loads(text.split("RESULT ")[1].splitlines()[0])
    for stage, r in zip((2, 3), results):  # rank 0's result, from a DeepSpeed engine on 2 processes
        assert r["engine"] == "DeepSpeedEngine" and r["world"] == 2 and r["steps"] == 18, (stage, r)
        assert r["trained"] < 0.6 * r["untrained"], (stage, r)
    assert "KERNEL 10" in text  # the kernel runs cells after both launches


@pytest.mark.parametrize("zipfile", [False, True])
def test_an_async_engine_file_holds_the_state_of_its_save_point_and_the_synchronous_bytes(tmp_path, zipfile):
    """cadence's stand-in for DeepSpeed's torch checkpoint engine: the states taken for a background write (views of
    one storage, a shared tensor; a file with a tensor that has autograd history is serialized at once instead of
    copied) are written with the values of their save point after training changed them in place: in the bytes a
    synchronous save writes with torch's zip format (DeepSpeed's default); its legacy format names each storage by
    its memory address, so there the values are compared."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from cadence.distributed.deepspeed_checkpoint import _Files
    from cadence.distributed.staging import HostBuffers

    engine = TorchCheckpointEngine()
    engine.zipfile_serialization = zipfile
    flat, w = torch.randn(100), torch.nn.Parameter(torch.randn(4, 3))
    states = {"optim.pt": {"flat": flat, "parts": [flat[:40], flat[40:].view(6, 10)], "again": flat, "step": 3},
              "model.pt": {"w": w, "h": w.sum() * 2, "name": "zero"}}
    files = _Files(engine, HostBuffers())
    for name, state in states.items():
        _Files(engine, None).save(state, str(tmp_path / f"sync-{name}"))
        files.save(state, str(tmp_path / name))
    with torch.no_grad():  # the next optimizer step
        flat.add_(1)
        w.mul_(2)
    files.write()
    for name in states:
        if zipfile:
            assert (tmp_path / name).read_bytes() == (tmp_path / f"sync-{name}").read_bytes(), name
        written, synchronous = (torch.load(tmp_path / f, weights_only=False) for f in (name, f"sync-{name}"))
        assert written.keys() == synchronous.keys()
        for key, value in synchronous.items():
            if key == "parts":
                assert all(torch.equal(a, b) for a, b in zip(written[key], value, strict=True))
                assert written[key][0].untyped_storage().data_ptr() == written["flat"].untyped_storage().data_ptr()
            else:
                assert torch.equal(written[key], value) if isinstance(value, torch.Tensor) else written[key] == value


def test_a_zero3_resume_reads_masters_and_moments_into_place_and_keeps_nothing_of_the_file_mapped(tmp_path):
    """A ZeRO-3 optimizer-states file (laid out as DeepSpeed writes it) read into a trained engine's optimizer: its
    fp32 master partitions go into the engine's own and each moment into the optimizer's own tensor of that partition
    (found by DeepSpeed's numbering: group by group, each group's sub-groups in turn), which stand in the loaded
    state (so the engine copies the masters onto themselves, skipped, and keeps its own moments: one copy of those
    bytes per resume, into memory already there). A step tensor shared by both partitions' states is not written
    into; every other tensor is torch.load's, views of one storage still one storage, in memory of its own: the file
    rewritten afterwards (here zeroed in place) changes nothing loaded. A file it cannot place that way is left to
    the usual load (None)."""
    from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT

    from cadence.distributed.deepspeed_checkpoint import load_zero3_in_place

    torch.manual_seed(0)
    groups, extra = [torch.randn(1000), torch.randn(24)], torch.randn(64)
    moments = [{"exp_avg": torch.randn(24), "step": torch.tensor(6.0)},  # position 0: group 0's partition (sub-group 1)
               {"exp_avg": torch.randn(1000), "step": torch.tensor(6.0), "extra": extra, "part": extra[:8]}]
    state = {OPTIMIZER_STATE_DICT: {"zero_stage": 3, "loss_scaler": {"cur_scale": 1.0},
                                    OPTIMIZER_STATE_DICT: {"state": dict(enumerate(moments)),
                                                           "param_groups": [{"lr": 0.1, "params": [0]},
                                                                            {"lr": 0.2, "params": [1]}]},
                                    FP32_FLAT_GROUPS: groups}, "ds_config": {"train_batch_size": 8}}
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save(state, path)
    expected = torch.load(path, weights_only=False)
    masters = [torch.zeros(1000), torch.zeros(24)]
    step = torch.tensor(1.0)  # one tensor in both partitions' states
    inner = SimpleNamespace(param_groups=[{"params": []}, {"params": []}],
                            state={masters[1]: {"exp_avg": torch.zeros(24), "step": step},
                                   masters[0]: {"exp_avg": torch.zeros(1000), "step": step}})
    engine_optimizer = SimpleNamespace(fp32_partitioned_groups_flat=masters, sub_group_to_group_id={0: 1, 1: 0},
                                       optimizer=inner)
    live = {i: inner.state[m]["exp_avg"] for i, m in enumerate(masters)}
    loaded = load_zero3_in_place(str(path), "cpu", engine_optimizer)
    assert all(a is b for a, b in zip(loaded[OPTIMIZER_STATE_DICT][FP32_FLAT_GROUPS], masters, strict=True))
    assert all(torch.equal(m, g) for m, g in zip(masters, groups))
    saved = loaded[OPTIMIZER_STATE_DICT][OPTIMIZER_STATE_DICT]["state"]
    assert saved[0]["exp_avg"] is live[1] and saved[1]["exp_avg"] is live[0]
    assert saved[0]["step"] is not step and saved[1]["step"] is not step and step == 1  # the shared one left alone
    assert saved[1]["part"].untyped_storage().data_ptr() == saved[1]["extra"].untyped_storage().data_ptr()
    path.write_bytes(bytes(path.stat().st_size))  # the file rewritten in place after the resume
    for position, values in enumerate(moments):
        assert saved[position].keys() == values.keys()
        assert all(torch.equal(saved[position][k], v) for k, v in values.items()), position
    assert loaded["ds_config"] == expected["ds_config"]
    torch.save(state, path)
    inner.param_groups[0]["params"].append(masters[1])  # DeepSpeed's numbering holds for empty groups only
    loaded = load_zero3_in_place(str(path), "cpu", engine_optimizer)
    assert loaded[OPTIMIZER_STATE_DICT][FP32_FLAT_GROUPS][0] is masters[0]  # the masters still read into place
    moments_loaded = loaded[OPTIMIZER_STATE_DICT][OPTIMIZER_STATE_DICT]["state"]
    assert moments_loaded[0]["exp_avg"] is not live[1] and moments_loaded[1]["exp_avg"] is not live[0]
    assert torch.equal(moments_loaded[1]["exp_avg"], moments[1]["exp_avg"])
    inner.param_groups[0]["params"].clear()
    state[OPTIMIZER_STATE_DICT]["ds_zero_partition_groups"] = [{"families": ["expert"]}]  # an AutoEP placement that
    torch.save(state, path)  # this engine does not have: DeepSpeed refuses it, so nothing is written first
    masters[0].zero_()
    engine_optimizer._zero3_partition_group_metadata = lambda: [{"families": ["replicated"]}]
    assert load_zero3_in_place(str(path), "cpu", engine_optimizer) is None and not masters[0].any()
    del state[OPTIMIZER_STATE_DICT]["ds_zero_partition_groups"]
    torch.save(state, path)
    engine_optimizer.fp32_partitioned_groups_flat = [torch.zeros(999), torch.zeros(24)]
    assert load_zero3_in_place(str(path), "cpu", engine_optimizer) is None  # another layout
    engine_optimizer.fp32_partitioned_groups_flat = masters
    torch.save(state, path, _use_new_zipfile_serialization=False)
    assert load_zero3_in_place(str(path), "cpu", engine_optimizer) is None  # torch's legacy format: not mapped


def test_a_zero3_load_state_into_a_trained_optimizer_keeps_its_tensors_and_reads_the_checkpoints_values(dls, tmp_path):
    """`learn.load_state` of a ZeRO-3 checkpoint after more training (one process): AdamW's moments and step are read
    into the tensors the optimizer holds (no second copy of the optimizer state alive during the load), with the
    checkpoint's values, and training on from there gives the weights that training on from that checkpoint in a
    fresh engine gives."""
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT

    from fixtures import make_learner

    ckpt = tmp_path / "ckpt" / "step-00000002"
    learn = make_learner(dls, tmp_path)
    with learn.distrib_ctx(strategy="deepspeed", zero_stage=3):
        learn.fit(1, cbs=[Checkpoint("ckpt", every_n_steps=2)])
        optimizer = learn.strategy.engine.optimizer.optimizer
        before = {id(t) for state in optimizer.state.values() for t in state.values()}
        learn.load_state(ckpt)
        (live,) = optimizer.state.values()
        assert {id(t) for t in live.values()} == before and len(before) == 3, (live, before)
        file, = (ckpt / "deepspeed").rglob("*optim_states.pt")
        saved = torch.load(file, weights_only=False)[OPTIMIZER_STATE_DICT][OPTIMIZER_STATE_DICT]["state"][0]
        assert saved.keys() == live.keys() and all(torch.equal(live[k], v) for k, v in saved.items())
        learn.fit(1)
        reloaded = {k: v.detach().clone() for k, v in learn.strategy.full_state_dict(learn.model).items()}
    fresh = make_learner(dls, tmp_path / "fresh")
    with fresh.distrib_ctx(strategy="deepspeed", zero_stage=3):
        fresh.load_state(ckpt)
        fresh.fit(1)
        expected = fresh.strategy.full_state_dict(fresh.model)
    assert reloaded.keys() == expected.keys() and all(torch.equal(reloaded[k], expected[k]) for k in expected)


def test_only_the_ranks_own_optimizer_file_is_read_into_its_masters(tmp_path):
    """With `elastic_checkpoint` DeepSpeed's load reads every rank's optimizer-states file on every rank, all of the
    same shapes: only the rank's own fills its fp32 masters (another rank's went there last, silently)."""
    from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from cadence.distributed.deepspeed_checkpoint import _ReadOnce

    files = {rank: tmp_path / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in (0, 1)}
    for rank, path in files.items():
        torch.save({OPTIMIZER_STATE_DICT: {FP32_FLAT_GROUPS: [torch.full((8,), float(rank + 1))]}}, path)
    masters = [torch.zeros(8)]
    reader = _ReadOnce(TorchCheckpointEngine())
    reader.in_place = (str(files[0]), SimpleNamespace(fp32_partitioned_groups_flat=masters))
    own, other = (reader.load(str(files[rank]), map_location="cpu") for rank in (0, 1))
    assert own[OPTIMIZER_STATE_DICT][FP32_FLAT_GROUPS][0] is masters[0] and torch.equal(masters[0], torch.ones(8))
    assert torch.equal(other[OPTIMIZER_STATE_DICT][FP32_FLAT_GROUPS][0], torch.full((8,), 2.0))


def test_reset_opt_is_refused_because_the_engine_steps_its_own_optimizer(dls, tmp_path):
    """`fit(reset_opt=True)` under DeepSpeed: the engine steps the optimizer it was built with, so a new `learn.opt`
    would never be stepped (ZeRO-0 in fp32 even hands back the very optimizer it was given); refused, naming the fix."""
    from fixtures import make_learner

    learn = make_learner(dls, tmp_path)
    with learn.distrib_ctx(strategy="deepspeed", zero_stage=0):
        learn.fit(1)
        with pytest.raises(ValueError, match=r"cannot replace the optimizer under deepspeed.*before distrib_ctx"):
            learn.fit(1, reset_opt=True)


@pytest.mark.parametrize("stage", [2, 3])
def test_frozen_weights_leave_a_bf16_engine_exact_at_zero2_and_zero3_warns(dls, tmp_path, stage):
    """DeepSpeed keeps fp32 masters of the trained parameters only: a frozen layer (a LoRA base model) would come back
    rounded to bf16, in the model after distrib_ctx and in save_model. ZeRO-2 keeps their fp32 values; ZeRO-3, which
    must not hold whole parameters, says it rounds them."""
    from safetensors.torch import load_file

    from fixtures import make_learner

    learn = make_learner(dls, tmp_path).to_bf16()
    frozen = learn.model[0].weight
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    assert not torch.equal(before.bfloat16().float(), before)       # bf16 would change it
    with pytest.warns(UserWarning, match="keeps no fp32 copy of the 1 frozen param") if stage == 3 else \
            contextlib.nullcontext():
        with learn.distrib_ctx(strategy="deepspeed", zero_stage=stage):
            learn.fit(1)
            learn.save_model(tmp_path / "export")
    exported = load_file(tmp_path / "export" / "model.safetensors")["0.weight"]
    if stage == 2:
        assert torch.equal(learn.model[0].weight, before) and torch.equal(exported, before)
        assert not torch.equal(learn.model[2].weight, make_learner(dls, tmp_path).model[2].weight)   # it trained
    else:
        assert torch.equal(exported, before.bfloat16().float())


def test_a_config_that_disables_the_learners_precision_is_refused_before_training(dls, tmp_path):
    """`learn.to_bf16()` under a DeepSpeed config saying `"bf16": {"enabled": false}`: DeepSpeed would keep fp32
    weights under bf16 autocast, neither what the config nor the Learner asked for; refused before the first step,
    naming the setting and both ways out. The same config with the Learner in fp32 trains."""
    from fixtures import make_learner

    config = {"bf16": {"enabled": False}, "zero_optimization": {"stage": 2}}
    learn = make_learner(dls, tmp_path).to_bf16()
    before = {k: v.clone() for k, v in learn.model.state_dict().items()}
    with pytest.raises(ValueError, match=r'"bf16": \{"enabled": false\}.*Set "enabled": "auto".*learn.to_fp32'):
        with learn.distrib_ctx(strategy="deepspeed", config=config):
            learn.fit(1)
    assert all(torch.equal(v, learn.model.state_dict()[k]) for k, v in before.items())   # no step was taken
    assert not torch.distributed.is_initialized() and type(learn.strategy).__name__ == "SingleDevice"   # as it was
    learn = make_learner(dls, tmp_path / "fp32")
    with learn.distrib_ctx(strategy="deepspeed", config=config):
        learn.fit(1)
    assert learn.recorder.values


def test_a_model_with_every_parameter_frozen_is_refused_naming_it_before_the_engine_is_built(dls):
    from cadence import Learner

    learn = Learner(dls, torch.nn.Linear(8, 3).requires_grad_(False), loss_func=torch.nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match=r"strategy='deepspeed': no parameter of the model requires a gradient"):
        with learn.distrib_ctx(strategy="deepspeed", zero_stage=2):
            pass
    assert type(learn.strategy).__name__ == "SingleDevice"     # the context left nothing behind
