"""`cadence launch`: run a script on N processes through torch.distributed.run's elastic agent.

Flags (Accelerate's names) override the YAML config; the result reaches the script as
torchrun's variables (RANK, WORLD_SIZE, ...) plus CADENCE_* variables. Each Python worker runs
under `run_worker`, which records an exception in torchrun's error file instead of printing it,
so the launcher prints the first failing rank's traceback exactly once.

    cadence launch --num_processes 2 --mixed_precision bf16 train.py --epochs 3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import runpy
import shutil
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import NoReturn

from cadence.compile import CONFIG_KEYS, check_backend, dynamo_env
from cadence.distributed import config as cfg_mod
from cadence.distributed import lifecycle, status
from cadence.distributed.failure_report import (PREEMPTION_SIGNALS, all_preempted, report_failure, report_preemption,
                                                report_signal)
from cadence.distributed.config import Config
from cadence.distributed import launch_xla

# Config keys that are also `cadence launch` flags (besides --cpu for use_cpu).
LAUNCH_KEYS = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
               "mixed_precision", "gradient_accumulation_steps", "num_cpu_threads_per_process",
               "max_restarts", "monitor_interval", "rdzv_backend", "timeout", "preemption_grace_s", "debug", "gpu_ids")
_WORKER_CODE = "from cadence.distributed.launch import run_worker; run_worker()"
_DEFAULT_MULTI_NODE_PORT = 29500
LAUNCHER_PID_VAR = "CADENCE_LAUNCHER_PID"


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    """Add `cadence launch`'s flags and the positional `training_script [args...]` to `parser`.

    >>> p = argparse.ArgumentParser(); add_launch_args(p)
    >>> p.parse_args(["--cpu", "--num_processes", "2", "train.py", "--lr", "1"]).training_script_args
    ['--lr', '1']
    """
    add_launch_options(parser)
    parser.add_argument("-m", "--module", action="store_true", help="run training_script as a module, like `python -m`")
    parser.add_argument("--no_python", action="store_true", help="run training_script as a program, not with python")
    parser.add_argument("training_script", help="the script (or module, or program) to run on every process")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def add_launch_options(parser: argparse.ArgumentParser) -> None:
    """Add the flags that say how to launch (config file, processes, precision, ...), not what to run.

    >>> p = argparse.ArgumentParser(); add_launch_options(p)
    >>> p.parse_args(["--cpu"]).use_cpu
    True
    """
    parser.add_argument("--config_file", default=None, help="YAML config (default: `cadence config`'s file)")
    parser.add_argument("--cpu", "--use_cpu", dest="use_cpu", action="store_const", const=True, default=None,
                        help="train on CPU even where an accelerator exists")
    parser.add_argument("--multi_gpu", action="store_true", help="DDP over GPUs (accepted for Accelerate users)")
    cfg_mod.add_config_flags(parser, LAUNCH_KEYS)
    parser.add_argument("--rdzv_conf", default="", help="extra rendezvous settings, `key1=v1,key2=v2`")
    add_accelerate_options(parser)
    add_fsdp_options(parser)
    add_dynamo_options(parser)
    add_deepspeed_options(parser)
    add_parallelism_options(parser)
    launch_xla.add_xla_options(parser)


def add_accelerate_options(parser: argparse.ArgumentParser) -> None:
    """`accelerate launch` flags that say how torchrun runs the workers, or that cadence does by default.

    The rest of Accelerate's flags are cadence's own (`--num_processes`, `--use_fsdp`, ...) or refused
    with a reason (`other_launchers`).

    >>> p = argparse.ArgumentParser(); add_accelerate_options(p)
    >>> p.parse_args(["--tee", "3", "--same_network"]).tee
    '3'
    """
    group = parser.add_argument_group("accelerate launch", "Accelerate's flags, for its users")
    group.add_argument("-q", "--quiet", action="store_true",
                       help="accepted: the launcher already shows only the failing rank's traceback, once")
    group.add_argument("--same_network", action="store_true",
                       help="accepted: machines reach machine 0 at --main_process_ip directly (cadence's default)")
    group.add_argument("--main_training_function", default=None,
                       help="with --tpu, each worker imports the script and calls this function (Accelerate's TPU "
                            "launcher); otherwise the script runs as __main__, as accelerate launch does off TPUs")
    group.add_argument("--log_dir", default=None, help="torchrun's log directory (with --tee: the workers' streams)")
    group.add_argument("--tee", default=None, help="torchrun's --tee: copy workers' streams to --log_dir (0-3)")
    group.add_argument("--role", default=None, help="torchrun's worker role name")


def _torchrun_passthrough(args: argparse.Namespace) -> list[str]:
    """torchrun flags given as Accelerate names them (--log_dir, --tee, --role)."""
    given = {flag: getattr(args, flag, None) for flag in ("log_dir", "tee", "role")}
    return [arg for flag, value in given.items() if value is not None for arg in (f"--{flag}", value)]


# `--fsdp_<key>` flags: Accelerate's names; they fill the config's fsdp_config block (the FSDP strategy accepts the
# keys FSDP2 makes moot, such as use_orig_params, and refuses the others; resolve_config refuses --fsdp_version 1)
FSDP_FLAGS = {"sharding_strategy": str, "auto_wrap_policy": str, "transformer_layer_cls_to_wrap": str,
              "min_num_params": int, "offload_params": bool, "state_dict_type": str,
              "activation_checkpointing": bool, "cpu_ram_efficient_loading": bool, "version": int,
              "reshard_after_forward": str, "backward_prefetch": str, "forward_prefetch": bool,
              "use_orig_params": bool, "sync_module_states": bool, "activation_checkpointing_offload": bool}


def add_fsdp_options(parser: argparse.ArgumentParser) -> None:
    """`--use_fsdp` and the `--fsdp_*` flags (see cadence.distributed.fsdp.FSDP for what each does).

    >>> p = argparse.ArgumentParser(); add_fsdp_options(p)
    >>> p.parse_args(["--use_fsdp", "--fsdp_sharding_strategy", "SHARD_GRAD_OP"]).fsdp_sharding_strategy
    'SHARD_GRAD_OP'
    """
    group = parser.add_argument_group("FSDP", "shard the model with FSDP2 (Accelerate's flag names)")
    group.add_argument("--use_fsdp", action="store_true", help="train with the FSDP strategy")
    for key, kind in FSDP_FLAGS.items():
        if kind is bool:
            group.add_argument(f"--fsdp_{key}", type=_yes_no, default=None, metavar="true|false")
        else:
            group.add_argument(f"--fsdp_{key}", type=kind, default=None)


def add_dynamo_options(parser: argparse.ArgumentParser) -> None:
    """`--dynamo_backend` and friends (Accelerate's flags): the config's dynamo_config, read by the Learner.

    >>> p = argparse.ArgumentParser(); add_dynamo_options(p)
    >>> p.parse_args(["--dynamo_backend", "aot_eager"]).dynamo_backend
    'aot_eager'
    """
    group = parser.add_argument_group("torch.compile", "compile the model in every worker (Accelerate's flag names)")
    group.add_argument("--dynamo_backend", default=None, help="torch.compile backend: inductor, aot_eager, eager, ... or no")
    group.add_argument("--dynamo_mode", default=None, help="default, reduce-overhead, max-autotune, ...")
    group.add_argument("--dynamo_use_fullgraph", type=_yes_no, default=None, metavar="true|false")
    group.add_argument("--dynamo_use_dynamic", type=_yes_no, default=None, metavar="true|false")


def _dynamo_changes(args: argparse.Namespace, base: Config) -> dict:
    """Config changes from `--dynamo_*`: the dynamo_config block."""
    given = {k: getattr(args, k) for k in CONFIG_KEYS if getattr(args, k, None) is not None}
    return {"dynamo_config": {**base.dynamo_config, **given}} if given else {}


def _yes_no(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1", "yes")


# DeepSpeed's flags, Accelerate's names; they fill the config's deepspeed_config block (key = flag name)
DEEPSPEED_FLAGS = {"deepspeed_config_file": str, "zero_stage": int, "offload_optimizer_device": str,
                   "offload_param_device": str, "offload_optimizer_nvme_path": str, "offload_param_nvme_path": str,
                   "gradient_clipping": float, "zero3_init_flag": bool, "zero3_save_16bit_model": bool}


def add_deepspeed_options(parser: argparse.ArgumentParser) -> None:
    """`--use_deepspeed` and DeepSpeed's flags (see cadence.distributed.deepspeed.DeepSpeed for what each does).

    >>> p = argparse.ArgumentParser(); add_deepspeed_options(p)
    >>> p.parse_args(["--use_deepspeed", "--zero_stage", "2"]).zero_stage
    2
    """
    group = parser.add_argument_group("DeepSpeed", "ZeRO stages and offload through DeepSpeed (Accelerate's flag names)")
    group.add_argument("--use_deepspeed", action="store_true", help="train with the DeepSpeed strategy")
    for key, kind in DEEPSPEED_FLAGS.items():
        group.add_argument(f"--{key}", type=_yes_no if kind is bool else kind, default=None,
                           metavar="true|false" if kind is bool else None)


# `--parallelism_config_<key>` flags: Accelerate's names; they fill the config's parallelism_config block
PARALLELISM_FLAGS = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size",
                     "pp_size", "pp_microbatches", "pp_schedule")  # the pp keys are cadence's own


def add_parallelism_options(parser: argparse.ArgumentParser) -> None:
    """`--use_parallelism_config` and its sizes (see cadence.distributed.model_parallel.ModelParallel).

    >>> p = argparse.ArgumentParser(); add_parallelism_options(p); p.parse_args(["--parallelism_config_tp_size", "2"])
    Namespace(use_parallelism_config=False, parallelism_config_dp_replicate_size=None, parallelism_config_dp_shard_size=None, parallelism_config_tp_size=2, parallelism_config_cp_size=None, parallelism_config_pp_size=None, parallelism_config_pp_microbatches=None, parallelism_config_pp_schedule=None)
    """
    group = parser.add_argument_group("Model parallel", "tensor and pipeline parallelism inside FSDP2 (Accelerate's "
                                      "flag names; the pp flags are cadence's)")
    group.add_argument("--use_parallelism_config", action="store_true", help="train with the model_parallel strategy")
    for key in PARALLELISM_FLAGS:
        group.add_argument(f"--parallelism_config_{key}", type=str if key == "pp_schedule" else int, default=None)


def _engine_changes(args: argparse.Namespace, base: Config, use: str, distributed_type: str, block: str,
                    flags: dict[str, str]) -> dict:
    """Config changes from `--use_<engine>` and the engine's flags (flag name -> key in the config block)."""
    given = {key: getattr(args, flag) for flag, key in flags.items() if getattr(args, flag, None) is not None}
    if not getattr(args, use, False) and not given:
        return {}
    return {"distributed_type": distributed_type, block: {**getattr(base, block), **given}}


def _fsdp_changes(args: argparse.Namespace, base: Config) -> dict:
    """Config changes from `--use_fsdp` / `--fsdp_*`: distributed_type FSDP and the fsdp_config block."""
    return _engine_changes(args, base, "use_fsdp", "FSDP", "fsdp_config", {f"fsdp_{k}": f"fsdp_{k}" for k in FSDP_FLAGS})


def _deepspeed_changes(args: argparse.Namespace, base: Config) -> dict:
    """Config changes from `--use_deepspeed` and DeepSpeed's flags: distributed_type DEEPSPEED and its block."""
    return _engine_changes(args, base, "use_deepspeed", "DEEPSPEED", "deepspeed_config", {k: k for k in DEEPSPEED_FLAGS})


def _parallelism_changes(args: argparse.Namespace, base: Config) -> dict:
    """Config changes from `--use_parallelism_config` / `--parallelism_config_*`: the parallelism_config block."""
    changes = _engine_changes(args, base, "use_parallelism_config", base.distributed_type, "parallelism_config",
                              {f"parallelism_config_{k}": f"parallelism_config_{k}" for k in PARALLELISM_FLAGS})
    if changes and not changes["parallelism_config"]:
        changes["parallelism_config"] = {"parallelism_config_tp_size": 1}
    return changes


def resolve_config(args: argparse.Namespace) -> Config:
    """The config file (`--config_file` or the default one) with the flags in `args` applied on top.

    >>> resolve_config(argparse.Namespace(config_file=None, num_processes=2, use_cpu=True)).num_processes
    2
    """
    base = cfg_mod.load_config(args.config_file)
    changes = cfg_mod.flag_values(args)
    if getattr(args, "multi_gpu", False) and base.distributed_type == "NO":
        changes["distributed_type"] = "MULTI_GPU"
    changes.update(_fsdp_changes(args, base))
    changes.update(_dynamo_changes(args, base))
    changes.update(_deepspeed_changes(args, base))
    changes.update(_parallelism_changes(args, base))
    changes.update(launch_xla.xla_changes(args))
    try:
        config = Config(**{**base.to_dict(), **changes})
    except ValueError as e:
        raise ValueError(f"cadence launch flags: {e}") from None
    if getattr(args, "fsdp_version", None) not in (None, 2):
        raise ValueError(f"--fsdp_version {args.fsdp_version}: cadence's FSDP strategy is FSDP2 (fully_shard); "
                         f"leave the flag out or pass 2")
    if getattr(args, "main_training_function", None) and config.distributed_type != "XLA":
        print(f"cadence launch: --main_training_function {args.main_training_function} is for Accelerate's TPU "
              f"launcher; the script runs as __main__, as `accelerate launch` does off TPUs", file=sys.stderr)
    config.check_strategy_exists()
    config.check_engine_options()
    if config.dynamo_config:
        check_backend(config.dynamo_config["dynamo_backend"])
    return config


def launch_env(config: Config) -> dict[str, str | None]:
    """Variables the workers get from `config` (None: remove the variable).

    >>> launch_env(Config(num_processes=2, use_cpu=True))["CADENCE_STRATEGY"]
    'ddp'
    """
    per_node = config.num_processes // config.num_machines
    threads = config.num_cpu_threads_per_process or os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // per_node)
    return {
        "CADENCE_MIXED_PRECISION": config.mixed_precision,
        "CADENCE_GRADIENT_ACCUMULATION_STEPS": str(_accumulation_steps(config)),
        "CADENCE_TIMEOUT": str(config.timeout),
        "CADENCE_USE_CPU": "1" if config.use_cpu else "0",
        "CADENCE_STRATEGY": config.strategy,
        "CADENCE_DEBUG": "1" if config.debug else None,
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL" if config.debug else os.environ.get("TORCH_DISTRIBUTED_DEBUG"),
        "CADENCE_FSDP_CONFIG": json.dumps(config.fsdp_config) if config.fsdp_config else None,
        "CADENCE_DEEPSPEED_CONFIG": json.dumps(config.deepspeed_config) if config.deepspeed_config else None,
        "CADENCE_PARALLELISM_CONFIG": json.dumps(config.parallelism_config) if config.parallelism_config else None,
        "OMP_NUM_THREADS": str(threads),
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES") if config.gpu_ids == "all" else config.gpu_ids,
        **dynamo_env(config.dynamo_config),
    }


def _accumulation_steps(config: Config) -> int:
    """The launch's accumulation: the flag or config key, else an Accelerate deepspeed_config block's value."""
    block = config.deepspeed_config.get("gradient_accumulation_steps")
    if config.gradient_accumulation_steps == 1 and block not in (None, "auto"):
        return int(block)
    return config.gradient_accumulation_steps


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    >>> 1024 <= free_port() <= 65535
    True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_args(config: Config, args: argparse.Namespace) -> argparse.Namespace:
    """Arguments for `torch.distributed.run` that run `args.training_script` as `config` says.

    torch's parser abbreviates options, so `train.py --max 3` would read as its `--max-restarts`
    ("ambiguous option"): it parses the agent's flags and the program only, and the script's
    arguments are set afterwards, exactly as given.

    >>> torchrun_args(Config(num_processes=2), ns).nproc_per_node       # doctest: +SKIP
    '2'
    """
    from torch.distributed import run as torchrun

    program, *arguments = _worker_command(args, launch_xla.main_function_target(args, config.distributed_type))
    parsed = torchrun.parse_args([*launch_xla.installed_torchrun_options(_agent_argv(config, args)), "--no_python", program])
    parsed.training_script_args = arguments
    return parsed


def _agent_argv(config: Config, args: argparse.Namespace) -> list[str]:
    """torchrun's flags for the agent: processes, rendezvous, restarts, signals."""
    if args.no_python and args.module:
        raise ValueError("--no_python and --module cannot be combined: pick one")
    single = config.num_machines == 1
    addr = config.main_process_ip or ("127.0.0.1" if single else None)
    if addr is None:
        raise ValueError("--num_machines > 1 needs --main_process_ip (the address of machine 0)")
    port = config.main_process_port or (free_port() if single else _DEFAULT_MULTI_NODE_PORT)
    argv = ["--nnodes", str(config.num_machines), "--nproc_per_node", str(config.num_processes // config.num_machines),
            "--node_rank", str(config.machine_rank), "--master_addr", addr, "--master_port", str(port),
            "--max_restarts", str(config.max_restarts), "--monitor_interval", str(config.monitor_interval),
            "--rdzv_backend", config.rdzv_backend, "--rdzv_conf", args.rdzv_conf,
            "--shutdown_timeout", str(int(config.preemption_grace_s)),
            "--signals_to_handle", ",".join(("SIGINT", "SIGHUP", "SIGQUIT", *PREEMPTION_SIGNALS)),
            *_torchrun_passthrough(args)]
    if config.rdzv_backend != "static":
        argv += ["--rdzv_endpoint", f"{addr}:{port}"]
    return argv


def _worker_command(args: argparse.Namespace, target: list[str] | None = None) -> list[str]:
    """The program each worker runs: the script (or `target`) under `run_worker`, or the program itself (--no_python)."""
    if target:
        return [sys.executable, "-u", "-c", _WORKER_CODE, *target]
    if args.no_python:
        return [args.training_script, *args.training_script_args]
    module = ["-m"] if args.module else []
    return [sys.executable, "-u", "-c", _WORKER_CODE, *module, args.training_script, *args.training_script_args]


def launch(args: argparse.Namespace) -> int:
    """Run `args.training_script` on every process and return the exit code for `cadence launch`.

    Bad flags, config, script or a busy port fail (ValueError) before any process starts. The
    CADENCE_* variables are set in this process's environment, which the agent passes on to the
    workers. When a rank fails, the agent stops the others and the cause is printed once: the
    first failure's traceback, or the rank that stopped responding when the others timed out.
    SIGTERM / SIGUSR1 reach every worker, which get `preemption_grace_s` to checkpoint and exit.

    >>> p = argparse.ArgumentParser(); add_launch_args(p)
    >>> launch(p.parse_args(["--cpu", "--num_processes", "2", "train.py"]))   # doctest: +SKIP
    0
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    config = resolve_config(args)
    check_script(args)
    agent_args = torchrun_args(config, args)
    check_port_free(config, agent_args.master_port)
    status_dir = status.make_status_dir()
    variables = {**launch_env(config), LAUNCHER_PID_VAR: str(os.getpid()), status.STATUS_DIR_VAR: status_dir}
    for name, value in variables.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if not config.debug:
        _quiet_torch_loggers()
    try:
        with lifecycle.kill_survivors_of_failure(status_dir):
            torchrun.run(agent_args)
    except ChildFailedError as e:
        preempted = status.read_preemptions(status_dir)
        if all_preempted(e.failures, preempted):
            return report_preemption(preempted)
        return report_failure(e.failures, status.read_statuses(status_dir), config.timeout)
    except SignalException as e:
        return report_signal(e.sigval)
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)
    return 0



def check_script(args: argparse.Namespace) -> None:
    """ValueError when the training script (or program) to launch does not exist."""
    if args.module:
        return
    script = args.training_script
    if args.no_python and shutil.which(script):
        return
    if not Path(script).is_file():
        raise ValueError(f"training script {script!r} not found (from {os.getcwd()}): check the path, "
                         f"or pass -m for a module")


def check_port_free(config: Config, port: int) -> None:
    """ValueError naming --main_process_port when machine 0 cannot listen on it (before any worker starts)."""
    if config.machine_rank != 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError as e:
            raise ValueError(f"--main_process_port {port} cannot be used on this machine ({e.strerror}): "
                             f"pick another port, or leave --main_process_port out to get a free one") from None


def _quiet_torch_loggers() -> None:
    """Silence the elastic agent's warnings (restarts, SIGTERMs sent): the launcher reports failures itself."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


_PEER_FAILURE_TEXT = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket Timeout",
                      "communicator was aborted", "DistBackendError")


def is_peer_failure(e: BaseException) -> bool:
    """True when `e` (or what caused it) is a collective that failed because another rank went away."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__name__ == "DistBackendError" or any(t in str(e) for t in _PEER_FAILURE_TEXT):
            return True
        e = e.__cause__ or e.__context__
    return False


def run_worker(argv: list[str] | None = None) -> NoReturn:
    """Run a script (or `-m module`) as `__main__` in this worker, then end the process with its exit code.

    On an exception, the traceback goes to torchrun's `TORCHELASTIC_ERROR_FILE` (the launcher
    prints it) or, without one, to stderr, and the exit code is 1. The worker dies with its
    launcher (`die_with_parent`), reports where it is for the failure report (`status`), and
    leaves through `exit_now`, never through interpreter finalization (see `lifecycle`).

    >>> run_worker(["train.py", "--epochs", "1"])          # doctest: +SKIP
    """
    os.environ[lifecycle.SELF_EXITING_VAR] = str(os.getpid())
    if os.environ.get(LAUNCHER_PID_VAR):
        lifecycle.die_with_parent(int(os.environ[LAUNCHER_PID_VAR]))
    if os.environ.get(status.STATUS_DIR_VAR):
        status.start_reporter(os.environ[status.STATUS_DIR_VAR], int(os.environ.get("RANK", "0")))
    code = _run_script(sys.argv[1:] if argv is None else argv)
    status.record_exit(code)
    lifecycle.exit_now(code)


def _run_script(argv: list[str]) -> int:
    """Run the script or module `argv` names as `__main__`; return the exit code it ended with."""
    module = argv[:1] == ["-m"]
    target, *rest = argv[1:] if module else argv
    sys.argv = [target, *rest]
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = str(Path(target).resolve().parent)
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        return lifecycle.exit_code(e)
    except KeyboardInterrupt as e:
        if os.environ.get("CADENCE_DEBUG"):
            _record_exception(e)
        return 130                           # the launcher says it was interrupted; no trace per rank
    except BaseException as e:
        _record_exception(e)
        return 1
    return 0


def user_traceback(e: BaseException) -> str:
    """`e`'s traceback as text, without the launcher's own frames (run_worker, runpy, the notebook worker).

    >>> try: 1 / 0
    ... except ZeroDivisionError as e: print(user_traceback(e).splitlines()[-1])
    ZeroDivisionError: division by zero
    """
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in (__name__, "runpy"):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(e), e, tb))


def _record_exception(e: BaseException) -> None:
    text = user_traceback(e)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        print(text, file=sys.stderr, end="")
        return
    headline = f"{type(e).__name__}: {e}"
    info = {"py_callstack": text, "timestamp": str(int(time.time())), "time_ns": time.time_ns(),
            "peer_failure": is_peer_failure(e)}
    Path(error_file).write_text(json.dumps({"message": {"message": headline, "extraInfo": info}}))
