"""`cadence launch`: run a script on N processes through torch.distributed.run's elastic agent.

Flags (Accelerate's names) override the YAML config; the result reaches the script as
torchrun's variables (RANK, WORLD_SIZE, ...) plus CADENCE_* variables. Each Python worker runs
under `run_worker`, which records an exception in torchrun's error file instead of printing it,
so the launcher prints the first failing rank's traceback exactly once. The flags and the config
they make are in `launch_flags`.

    cadence launch --num_processes 2 --mixed_precision bf16 train.py --epochs 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import runpy
import shutil
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import NoReturn

from cadence.compile import dynamo_env
from cadence.distributed import launch_xla, lifecycle, status
from cadence.distributed.whole_lines import write_whole_lines
from cadence.distributed.config import Config
from cadence.distributed.failure_report import (PREEMPTION_SIGNALS, all_preempted, report_failure, report_preemption,
                                                report_signal)
from cadence.distributed.launch_flags import add_launch_args, add_launch_options, resolve_config  # imported from here too
from cadence.distributed.loopback import gloo_interface_env, loopback_store

_WORKER_CODE = "from cadence.distributed.launch import run_worker; run_worker()"
_DEFAULT_MULTI_NODE_PORT = 29500
LAUNCHER_PID_VAR = "CADENCE_LAUNCHER_PID"


def _torchrun_passthrough(args: argparse.Namespace) -> list[str]:
    """torchrun flags given as Accelerate names them (--log_dir, --tee, --role)."""
    given = {flag: getattr(args, flag, None) for flag in ("log_dir", "tee", "role")}
    return [arg for flag, value in given.items() if value is not None for arg in (f"--{flag}", value)]


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
        **gloo_interface_env(config.num_machines == 1),
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

    program, *arguments = _worker_command(args, launch_xla.main_function_target(args, config))
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
        with lifecycle.kill_survivors_of_failure(status_dir), _own_store(config, agent_args.master_port):
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



def _own_store(config: Config, port: int) -> contextlib.AbstractContextManager:
    """One machine at a loopback address (the default): the rendezvous store listens on 127.0.0.1 only
    (`loopback.py`); several machines, or one given another `--main_process_ip`: torch's own store, on every interface
    (the other machines, or that address, connect to it)."""
    local = config.num_machines == 1 and (config.main_process_ip or "127.0.0.1") in ("127.0.0.1", "localhost")
    return loopback_store(port, config.timeout) if local else contextlib.nullcontext()


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
    write_whole_lines()  # each line a rank prints reaches the terminal whole, never mixed with another rank's
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
