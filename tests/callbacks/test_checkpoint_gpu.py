"""Async checkpoints of state in GPU memory. The Checkpoint callback's copy to host memory overlaps the next step's
forward and backward (into cadence's host buffers, reserved at the first step); the Accelerator's `save_state`
copies at the call. Either still writes the bytes a synchronous save writes, and training ends with the same
weights: on one device, under FSDP2 on one process (which shards nothing and saves the base format), and under
DeepSpeed ZeRO-1 and ZeRO-3 on one process (the engine's files copied into page-locked host memory, what only its
step writes copied late); and a ZeRO-3 run killed on the GPU resumes, its fp32 masters read from the mapped file
straight into GPU memory, to the uninterrupted run's weights. FSDP2's sharded save on a GPU (torch's stager on a stream of its own, into pinned memory)
needs two GPUs: not run by these.

These need a CUDA GPU, which CI does not have: they are skipped there and run where one is (docs/checkpoints.md
says where and when they last ran). Everything else about async saves is tested on the CPU in
test_checkpoint_async.py, whose helpers these use.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from helpers import REPO, SCRIPTS, cadence_env
from tests.callbacks.test_checkpoint_async import assert_equal, assert_same_checkpoints, assert_same_files, finished

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")


def run_on_gpu(*args, strategy=None):
    """async_checkpoint.py on the GPU: one process, on its own (one device) or under `cadence launch` (`strategy`)."""
    script = [str(SCRIPTS / "async_checkpoint.py"), *map(str, args), "--device", "default"]
    cmd = ([sys.executable, "-m", "cadence.cli", "launch", "--num_processes", "1", *script, "--strategy", strategy]
           if strategy else [sys.executable, *script])
    env = cadence_env(CUDA_VISIBLE_DEVICES="0", CUBLAS_WORKSPACE_CONFIG=":4096:8",  # deterministic cuBLAS
                      PYTHONPATH=f"{SCRIPTS}:{REPO}:{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)


@pytest.mark.parametrize("strategy", [None, "fsdp"])
def test_async_saves_from_gpu_memory_write_the_synchronous_bytes(tmp_path, strategy):
    """The copy to host memory made 0.3 s late, while the next micro-batches run on the GPU: the loop waits for it
    before the optimizer step, so every checkpoint holds its own step's state, byte for byte the synchronous one."""
    for mode in ("sync", "async"):
        flags = ["--sync"] if mode == "sync" else ["--copy-delay", 0.3]
        proc = run_on_gpu("--ckpt", tmp_path / mode, "--out", tmp_path / f"{mode}.st", *flags, strategy=strategy)
        finished(proc)
        assert "cuda" in proc.stdout, proc.stdout  # the script says where the model trained
    assert_equal(load_file(str(tmp_path / "async.st")), load_file(str(tmp_path / "sync.st")))
    assert_same_checkpoints(tmp_path / "sync", tmp_path / "async")


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_async_saves_copy_gpu_state_late_and_write_the_synchronous_bytes(tmp_path, stage):
    """DeepSpeed's engine files hold GPU memory: an async save copies it into page-locked host memory, what only the
    engine's step writes (weights, fp32 master partitions, optimizer state) by the writer's thread, here 0.3 s late
    while the next micro-batches run, the loop waiting for it before the step. Every checkpoint is byte for byte the
    synchronous one and training ends with the same weights. (Serializing the files at the save point instead, as
    cadence did for GPU state, held the loop for all of it and left no late copy to wait for.)"""
    pytest.importorskip("deepspeed")
    for mode in ("sync", "async"):
        flags = ["--sync"] if mode == "sync" else ["--copy-delay", 0.3]
        proc = run_on_gpu("--ckpt", tmp_path / mode, "--out", tmp_path / f"{mode}.st", "--zero-stage", stage,
                          "--classes", 4, *flags, strategy="deepspeed")
        finished(proc)
        assert "DEVICE cuda" in proc.stdout, proc.stdout
    copy_waits = json.loads(proc.stdout.split("COPYWAIT ", 1)[1].splitlines()[0])
    assert max(copy_waits) > 0.2, copy_waits  # the loop waited for the late copy before a step
    assert_equal(load_file(str(tmp_path / "async.st")), load_file(str(tmp_path / "sync.st")))
    assert_same_checkpoints(tmp_path / "sync", tmp_path / "async")


def test_a_zero3_run_killed_on_the_gpu_resumes_into_its_fp32_masters_to_the_same_weights(tmp_path):
    """ZeRO-3 keeps its fp32 master partitions in GPU memory: a run SIGKILLed after step 10 resumes from its
    checkpoint of step 8, the masters read from the mapped optimizer-states file straight into GPU memory, and ends
    with the uninterrupted run's weights, bit for bit."""
    pytest.importorskip("deepspeed")
    flags = ["--zero-stage", 3, "--classes", 4, "--sync"]
    finished(run_on_gpu("--ckpt", tmp_path / "ref", "--out", tmp_path / "ref.st", *flags, strategy="deepspeed"))
    killed = run_on_gpu("--ckpt", tmp_path / "run", "--out", tmp_path / "run.st", *flags, "--kill-at-step", 10,
                        strategy="deepspeed")
    assert killed.returncode != 0 and "STEPS" not in killed.stdout, killed.stdout
    assert (tmp_path / "run" / "latest").read_text() == "step-00000008"
    resumed = run_on_gpu("--ckpt", tmp_path / "run", "--out", tmp_path / "run.st", *flags, strategy="deepspeed")
    finished(resumed)
    assert "MASTERS_IN_PLACE 1" in resumed.stdout, resumed.stdout
    assert_equal(load_file(str(tmp_path / "run.st")), load_file(str(tmp_path / "ref.st")))


def test_accelerator_async_save_state_of_gpu_state_writes_the_synchronous_bytes(tmp_path):
    """`Accelerator.save_state(async_save=True)` copies the GPU's state to host memory at the call and writes it
    behind; the step after it does not reach the copy, and every file is the synchronous save's, byte for byte."""
    from cadence import Accelerator

    torch.manual_seed(0)
    acc = Accelerator()
    net = torch.nn.Linear(64, 32)
    model, opt = acc.prepare(net, torch.optim.AdamW(net.parameters(), lr=0.1))
    assert next(model.parameters()).is_cuda

    def step():
        acc.backward(model(torch.randn(8, 64, device=acc.device)).square().mean())
        opt.step()
        opt.zero_grad()
    step()
    acc.save_state(tmp_path / "sync")
    acc.save_state(tmp_path / "async", async_save=True)
    step()  # training goes on while it is written: the checkpoint keeps the state of its own step
    acc.end_training()
    assert_same_files(tmp_path / "sync", tmp_path / "async")
