"""Flags of the launchers `cadence launch` users come from (torchrun, DeepSpeed's `deepspeed`, `accelerate launch`)
that cadence does not take as such: what to pass instead, or why cadence refuses them.

`cadence launch` takes Accelerate's own flag names; this module answers for the rest, so that an
unknown flag gets the right suggestion instead of a look-alike (`--num_gpus` means
`--num_processes`, not `--multi_gpu`).

>>> advice("--num_gpus")
'did you mean --num_processes? (DeepSpeed counts GPUs per machine; --num_processes counts processes over all machines)'
>>> advice("--use_megatron_lm").startswith("not supported: Megatron-LM")
True
>>> advice("--lr") is None
True
"""

from __future__ import annotations

_ON_EACH_MACHINE = ("cadence launch reads no hostfile and starts no remote processes: run the same command on each "
                    "machine with --num_machines N --machine_rank i --main_process_ip <machine 0>")
_MODEL_PARALLEL = ("tensor, sequence and pipeline parallelism are cadence's model_parallel strategy "
                   "(`learn.distrib_ctx(strategy=\"model_parallel\", tp_size=...)`), launched with --num_processes as usual")
_NO_TPU = ("cadence launch starts no jobs on other TPU VMs or pods: run `cadence launch --tpu` on each TPU VM "
           "(bf16 on XLA: --mixed_precision bf16)")

# flag -> (the cadence flag that means the same, a note where the meaning differs)
RENAMED = {
    # torchrun
    "--nproc_per_node": ("--num_processes", "processes in total over all machines"),
    "--nnodes": ("--num_machines", None), "--node_rank": ("--machine_rank", None),
    "--master_addr": ("--main_process_ip", None), "--master_port": ("--main_process_port", None),
    # DeepSpeed's launcher
    "--num_gpus": ("--num_processes", "DeepSpeed counts GPUs per machine; --num_processes counts processes over all "
                                      "machines"),
    "--num_accelerators": ("--num_processes", "processes in total over all machines"),
    "--num_nodes": ("--num_machines", None),
    "--include": ("--gpu_ids", "this machine's GPUs, e.g. --gpu_ids 0,1; DeepSpeed's host:slot syntax is not read"),
    "-i": ("--gpu_ids", "this machine's GPUs, e.g. --gpu_ids 0,1"),
    "--exclude": ("--gpu_ids", "list the GPUs to use rather than those to leave out"),
    "-e": ("--gpu_ids", "list the GPUs to use rather than those to leave out"),
    "--enable_each_rank_log": ("--log_dir", "torchrun writes one log per rank there"),
    "--bind_cores_to_rank": ("--num_cpu_threads_per_process", "cadence sets threads per process, it does not pin cores"),
    "--elastic_training": ("--max_restarts", "with --rdzv_backend c10d: torchrun's elastic agent"),
}

# flag, or prefix ending in "_", -> why cadence refuses it and what to do instead
REFUSED = {
    # DeepSpeed's launcher
    "--hostfile": _ON_EACH_MACHINE, "-H": _ON_EACH_MACHINE, "--launcher": _ON_EACH_MACHINE,
    "--launcher_args": _ON_EACH_MACHINE, "--no_ssh": _ON_EACH_MACHINE, "--ssh_port": _ON_EACH_MACHINE,
    "--autotuning": ("cadence launch does not run DeepSpeed's autotuner: size ZeRO stage and offload with "
                     "`cadence estimate-memory <model>`, then launch with --use_deepspeed --zero_stage N "
                     "(or run `deepspeed --autotuning tune` on its own)"),
    "--no_local_rank": "cadence never passes --local_rank to the script: workers read LOCAL_RANK from the environment",
    # accelerate launch
    "--use_megatron_lm": f"not supported: Megatron-LM is not part of cadence; {_MODEL_PARALLEL}",
    "--megatron_lm_": f"not supported: Megatron-LM is not part of cadence; {_MODEL_PARALLEL}",
    "--parallelism_config_sp_": ("not supported: sequence parallelism in cadence is part of the tensor-parallel plan "
                                 "(SequenceParallel in the parallelize function); use --parallelism_config_tp_size"),
    "--parallelism_config_cp_": "not supported: context parallelism is not in cadence; use --parallelism_config_cp_size 1",
    "--tpu_": _NO_TPU, "--no_tpu_cluster": _NO_TPU, "--vm": _NO_TPU, "--env": _NO_TPU,
    "--downcast_bf16": _NO_TPU,
    "--fp8_": "not supported: fp8 training is not in cadence; use --mixed_precision bf16",
    "--enable_cpu_affinity": ("not supported: cadence launch does not pin CPU affinity; start it under "
                              "`numactl`/`taskset` to pin, and set --num_cpu_threads_per_process"),
    "--deepspeed_hostfile": _ON_EACH_MACHINE, "--deepspeed_inclusion_filter": _ON_EACH_MACHINE,
    "--deepspeed_exclusion_filter": _ON_EACH_MACHINE, "--deepspeed_multinode_launcher": _ON_EACH_MACHINE,
    "--deepspeed_moe_layer_cls_names": "not supported: cadence's DeepSpeed strategy does not mark MoE layers as ZeRO-3 leaves",
    "--mpirun_hostfile": _ON_EACH_MACHINE,
    "--aws_access_key_id": "not supported: cadence launch does not start SageMaker jobs",
    "--aws_secret_access_key": "not supported: cadence launch does not start SageMaker jobs",
}


def advice(flag: str) -> str | None:
    """What to say about `flag` (`--name` or `--name=value`, dashes or underscores), None when nothing is known.

    >>> advice("--num-nodes=2")
    'did you mean --num_machines?'
    """
    name = flag.split("=")[0]
    if name.startswith("--"):
        name = "--" + name[2:].replace("-", "_")
    if name in RENAMED:
        meant, note = RENAMED[name]
        return f"did you mean {meant}?" + (f" ({note})" if note else "")
    return REFUSED.get(name) or next((why for prefix, why in REFUSED.items()
                                      if prefix.endswith("_") and name.startswith(prefix)), None)
