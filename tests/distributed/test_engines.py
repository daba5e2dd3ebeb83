"""DDP and FSDP2 behind one Strategy interface: 2 (and 4) CPU processes over gloo, launched with `cadence launch`.

Each run trains tests/scripts/engines.py's Learner (a Linear, two `Block` layers, a Linear) and writes
its full weights (save_model) and results; the tests compare engines against each other.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import run_launch

BLOCKS = {"transformer_layer_cls_to_wrap": "Block"}


def launch(tmp_path, name, strategy, nproc=2, flags=(), check=True, **opts):
    out = tmp_path / name
    out.mkdir()
    return out, run_launch("engines.py", str(out), strategy, json.dumps(opts), nproc=nproc, flags=flags, timeout=240,
                           check=check)


def train(tmp_path, name, strategy, nproc=2, flags=(), **opts) -> tuple[dict, dict]:
    out, proc = launch(tmp_path, name, strategy, nproc, flags, **opts)
    result = json.loads((out / "result.json").read_text())
    result["stdout"] = proc.stdout
    return load_file(out / "model.safetensors"), result


def assert_weights_close(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=lambda m: f"{k}: {m}", **tol)


@pytest.mark.slow
def test_fsdp_trains_like_ddp_with_one_gradient_reduction_per_accumulation_window(tmp_path):
    opts = dict(epochs=2, accum=4, clip=0.5, count_comms=True)
    ddp_w, ddp = train(tmp_path, "ddp", "ddp", **opts)
    gloo_w, gloo = train(tmp_path, "ddp_gloo", "ddp", strategy_kwargs={"comm_hook": None}, **opts)
    fsdp_w, fsdp = train(tmp_path, "fsdp", "fsdp", strategy_kwargs=BLOCKS, **opts)
    assert_weights_close(ddp_w, fsdp_w, rtol=1e-4, atol=1e-5)
    assert fsdp["valid_loss"] == pytest.approx(ddp["valid_loss"], rel=1e-4)
    assert fsdp["grad_norm"] == pytest.approx(ddp["grad_norm"], rel=1e-4)  # the global norm, over every shard
    # 12 batches per rank and epoch, windows of 4: gradients leave the process only on each window's last batch
    # DDP: one gradient all-reduce (one bucket), through shared memory by default (processes on one machine's
    # CPU) and through gloo with comm_hook=None, bitwise the same average; FSDP: one reduce-scatter per group
    # (two Blocks and the root) and the clipping norm's all-reduce; nothing on the other micro-steps
    assert ddp["comms"] == [{}, {}, {}, {"shared_memory_all_reduce": 1}] * 6
    assert gloo["comms"] == [{}, {}, {}, {"all_reduce": 1}] * 6
    assert ddp_w.keys() == gloo_w.keys() and all(torch.equal(ddp_w[k], gloo_w[k]) for k in ddp_w)
    assert fsdp["comms"] == [{}, {}, {}, {"reduce_scatter": 3, "all_reduce": 1}] * 6
    assert fsdp["model_type"] == "Sequential"  # leaving distrib_ctx gives back the plain module, trained


@pytest.mark.slow
@pytest.mark.long
def test_a_second_fsdp_context_carries_the_adam_state_like_ddp(tmp_path):
    """fit in one distrib_ctx, leave it, fit in another: FSDP2 takes over the plain optimizer's Adam state (keyed by
    position) as DDP does, and both end with the same weights and moments."""
    ddp_w, _ = train(tmp_path, "ddp", "ddp", epochs=1, first_context_epochs=1)
    fsdp_w, _ = train(tmp_path, "fsdp", "fsdp", epochs=1, first_context_epochs=1)
    assert_weights_close(ddp_w, fsdp_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.load(tmp_path / "fsdp" / "exp_avg.pt"), torch.load(tmp_path / "ddp" / "exp_avg.pt"),
                               rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.long
def test_fsdp_bf16_trains_close_to_ddp_bf16(tmp_path):
    ddp_w, ddp = train(tmp_path, "ddp", "ddp", epochs=2, precision="bf16")
    fsdp_w, fsdp = train(tmp_path, "fsdp", "fsdp", epochs=2, precision="bf16", strategy_kwargs=BLOCKS)
    untrained = train(tmp_path, "untrained", "ddp", epochs=0)[1]["valid_loss"]
    assert fsdp["valid_loss"] < 0.8 * untrained
    assert fsdp["valid_loss"] == pytest.approx(ddp["valid_loss"], rel=0.05)
    assert all(t.dtype == torch.float32 for t in fsdp_w.values())  # bf16 compute, fp32 master weights exported


@pytest.mark.slow
def test_sharded_checkpoint_from_2_processes_resumes_on_1_and_4(tmp_path):
    ckpt = tmp_path / "ckpt"
    saved_w, saved = train(tmp_path, "two", "fsdp", epochs=1, save_ckpt=str(ckpt), strategy_kwargs=BLOCKS)
    assert sorted(p.name for p in (ckpt / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    for nproc in (1, 4):
        w, result = train(tmp_path, f"on{nproc}", "fsdp", nproc=nproc, epochs=0, load_ckpt=str(ckpt),
                          strategy_kwargs=BLOCKS)
        assert result["world"] == nproc
        assert_weights_close(saved_w, w, rtol=0, atol=0)
        assert result["valid_loss"] == saved["valid_loss"]
        moments = [torch.load(tmp_path / d / "exp_avg.pt") for d in ("two", f"on{nproc}")]
        assert torch.equal(*moments)  # the optimizer state came back too


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.long), "fsdp"])
def test_sigkill_mid_epoch_then_resume_ends_bitwise_equal(tmp_path, strategy):
    opts = dict(epochs=2, strategy_kwargs=BLOCKS if strategy == "fsdp" else {})
    ref_w, _ = train(tmp_path, "ref", strategy, checkpoint=str(tmp_path / "ref_ckpt"), **opts)
    ckpt = tmp_path / "ckpt"
    _, killed = launch(tmp_path, "killed", strategy, check=False, checkpoint=str(ckpt), kill_at=7, **opts)
    assert killed.returncode != 0 and "rank 1" in killed.stderr
    assert json.loads((ckpt / (ckpt / "latest").read_text() / "state.json").read_text())["step"] == 5  # mid-epoch 0
    resumed_w, _ = train(tmp_path, "resumed", strategy, checkpoint=str(ckpt), resume=True, **opts)
    assert_weights_close(ref_w, resumed_w, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.long
def test_hybrid_shard_2x2_on_4_processes_matches_ddp(tmp_path):
    ddp_w, _ = train(tmp_path, "ddp", "ddp", nproc=4, epochs=1)
    hsdp_w, _ = train(tmp_path, "hsdp", "fsdp", nproc=4, epochs=1,
                      strategy_kwargs={**BLOCKS, "sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 2})
    assert_weights_close(ddp_w, hsdp_w, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_cpu_ram_efficient_loading_builds_on_meta_and_trains_the_same(tmp_path):
    normal_w, _ = train(tmp_path, "normal", "fsdp", epochs=1, strategy_kwargs=BLOCKS)
    lean_w, lean = train(tmp_path, "lean", "fsdp", epochs=1, engine_instance=True,
                         strategy_kwargs={**BLOCKS, "cpu_ram_efficient_loading": True})
    assert "RANK1_META True" in lean["stdout"]  # rank 1 never held the real weights before sharding
    assert_weights_close(normal_w, lean_w, rtol=0, atol=0)


ACCELERATE_FSDP_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: true
  fsdp_forward_prefetch: false
  fsdp_offload_params: false
  fsdp_sharding_strategy: 1
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: Block
  fsdp_use_orig_params: true
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: true
"""


@pytest.mark.slow
def test_accelerate_fsdp_config_launches_an_fsdp_run(tmp_path):
    config = tmp_path / "accelerate_fsdp.yaml"
    config.write_text(ACCELERATE_FSDP_YAML)
    _, result = train(tmp_path, "acc", "launcher", epochs=1, flags=("--config_file", str(config)))
    # FULL_SHARD from Accelerate's number 1; the two Blocks and the root are FSDP groups; bf16 from the config
    assert result["engine"] == {"name": "fsdp", "sharding": "FULL_SHARD", "groups": 3, "precision": "bf16"}
    assert result["valid_loss"] < 1.0


def test_bad_fsdp_flags_are_refused_before_any_worker_starts(tmp_path):
    proc = run_launch("engines.py", str(tmp_path), "launcher", flags=("--use_fsdp", "--fsdp_sharding_strategy", "FULL"),
                      check=False, timeout=60)
    assert proc.returncode != 0
    assert "fsdp_config: FSDP sharding_strategy 'FULL' does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "result.json").exists()
