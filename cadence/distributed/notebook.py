"""Run a function on N fresh processes from a notebook: `notebook_launcher` and `debug_launcher`.

Workers start with spawn and receive the function by cloudpickle, with the same variables
`cadence launch` gives a script; rank 0's return value comes back, a worker's exception is
re-raised here with its traceback. Launched from a Jupyter kernel, the workers also get
`CADENCE_NOTEBOOK_OUTPUT=1`: their output lands in a cell, so the progress callback prints plain lines
there (the kernel's `FORCE_COLOR` / `TERM` would otherwise make it draw a terminal's live bar).

>>> notebook_launcher(train, args=(8, 1e-2), num_processes=2)          # doctest: +SKIP
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from cadence.distributed import launch_xla
from cadence.distributed.config import Config
from cadence.distributed.lifecycle import SELF_EXITING_VAR, die_with_parent, exit_now
from cadence.distributed.launch import free_port, is_peer_failure, launch_env, user_traceback
from cadence.distributed.loopback import loopback_store


# read by cadence.callbacks.progress: "1" when the process's output goes to a notebook cell, not a terminal
NOTEBOOK_OUTPUT_VAR = "CADENCE_NOTEBOOK_OUTPUT"


class WorkerError(RuntimeError):
    """A launched worker failed; its message is the worker's traceback (or how the worker died)."""


def notebook_launcher(function, args: tuple = (), num_processes: int | None = None, mixed_precision: str = "no",
                      use_port: int | None = None):
    """Run `function(*args)` on `num_processes` fresh processes (one per GPU, else one); return rank 0's result.

    Workers start with spawn and receive `function` by cloudpickle, so a function defined in a
    notebook cell works. Each gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and the
    CADENCE_* variables `cadence launch` sets. A worker's exception is re-raised here, chained to
    a WorkerError holding the worker's traceback; the other workers are stopped. From a Jupyter
    kernel, the workers print plain progress lines into the cell (no live bar, no terminal codes).

    >>> def train(lr): ...; return "done"
    >>> notebook_launcher(train, (1e-3,), num_processes=2)          # doctest: +SKIP
    'done'
    """
    if os.environ.get("PJRT_DEVICE"):   # the XLA runtime was asked for (a TPU VM, or PJRT_DEVICE=CPU): launch_xla
        return launch_xla.notebook_launch(function, args, num_processes, mixed_precision)
    if num_processes is None:
        import torch
        num_processes = torch.cuda.device_count() or 1
    config = _launcher_config(num_processes, mixed_precision=mixed_precision)
    return _spawn(function, args, config, use_port)


def debug_launcher(function, args: tuple = (), num_processes: int = 2):
    """Run `function(*args)` on `num_processes` CPU processes (gloo), as `notebook_launcher` does.

    >>> debug_launcher(lambda: __import__("os").environ["WORLD_SIZE"])   # doctest: +SKIP
    '2'
    """
    return _spawn(function, args, _launcher_config(num_processes, use_cpu=True), None)


def _launcher_config(num_processes: int, **kwargs) -> Config:
    from cadence.distributed.env import timeout

    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be a positive int, got {num_processes!r}")
    try:
        return Config(num_processes=num_processes, timeout=timeout().total_seconds(), **kwargs)
    except ValueError as e:
        raise ValueError(f"notebook_launcher: {e}") from None


def _spawn(function, args: tuple, config: Config, use_port: int | None):
    """Start one spawn process per rank, wait for all, return rank 0's result; stop every worker on the way out."""
    import multiprocessing

    import cloudpickle

    if not callable(function):
        raise TypeError(f"function must be callable, got {type(function).__name__}")
    payload = cloudpickle.dumps((function, tuple(args)))
    port = str(use_port or free_port())
    env = {k: v for k, v in launch_env(config).items() if v is not None}
    env.update(WORLD_SIZE=str(config.num_processes), LOCAL_WORLD_SIZE=str(config.num_processes),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="True")
    if in_jupyter_kernel():
        env[NOTEBOOK_OUTPUT_VAR] = "1"   # the workers write into the cell: plain lines, whatever FORCE_COLOR says
    ctx = multiprocessing.get_context("spawn")
    procs, conns = [], []
    with loopback_store(int(port), config.timeout, flag="use_port"):   # the workers' store, on 127.0.0.1 only
        try:
            for rank in range(config.num_processes):
                receiver, sender = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_worker_main, args=(rank, payload, env, sender, os.getpid()), daemon=True)
                proc.start()
                sender.close()
                procs.append(proc)
                conns.append(receiver)
            return _collect(procs, conns)
        finally:
            _stop(procs)


def in_jupyter_kernel() -> bool:
    """Whether this process is a Jupyter kernel (its output goes to notebook cells), without importing IPython.

    >>> in_jupyter_kernel()          # in a script or a terminal IPython
    False
    """
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    try:
        shell = get_ipython() if get_ipython is not None else None
    except Exception:
        return False
    return shell is not None and getattr(shell, "kernel", None) is not None


def _worker_main(rank: int, payload: bytes, env: dict[str, str], conn, parent_pid: int) -> NoReturn:
    """Body of one spawned worker: set its variables, run the function, send back the outcome, exit.

    The worker dies with the notebook kernel, and leaves through `exit_now` (never through
    interpreter finalization, where a live gloo group can abort or hang the process).
    """
    die_with_parent(parent_pid)
    import cloudpickle
    import torch

    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0")
    os.environ[SELF_EXITING_VAR] = str(os.getpid())
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    code = 0
    try:
        function, args = cloudpickle.loads(payload)
        result = function(*args)
        conn.send(("ok", cloudpickle.dumps(result) if rank == 0 else None))
    except BaseException as e:
        code = 1
        try:
            pickled = cloudpickle.dumps(e)
        except Exception:
            pickled = None
        conn.send(("error", pickled, user_traceback(e), is_peer_failure(e)))
    finally:
        conn.close()
        exit_now(code)


def _collect(procs: list, conns: list):
    """Wait for every worker's message; raise the first failure, else return rank 0's result.

    A failure caused only by a peer that went away (a broken collective) waits a few seconds
    for the peer's own error, which is the one worth showing.
    """
    import multiprocessing.connection

    import cloudpickle

    pending, result, peer_failure = dict(enumerate(conns)), None, None
    while pending:
        ready = multiprocessing.connection.wait(list(pending.values()), timeout=5 if peer_failure else None)
        if not ready:
            _reraise(*peer_failure)
        for conn in ready:
            rank = conns.index(conn)
            try:
                kind, *data = conn.recv()
            except EOFError:
                procs[rank].join(5)
                raise WorkerError(f"rank {rank} died (exit code {procs[rank].exitcode}) before returning") from None
            del pending[rank]
            if kind == "error" and not data[2]:
                _reraise(rank, *data[:2])
            if kind == "error":
                peer_failure = peer_failure or (rank, *data[:2])
            elif rank == 0:
                result = cloudpickle.loads(data[0])
    if peer_failure:
        _reraise(*peer_failure)
    return result


def _reraise(rank: int, pickled: bytes | None, trace: str):
    import cloudpickle

    remote = WorkerError(f"rank {rank} raised:\n{trace}")
    try:
        error = cloudpickle.loads(pickled) if pickled is not None else None
    except Exception:
        error = None
    if not isinstance(error, BaseException):
        raise remote
    error.add_note(f"(raised on rank {rank}; the worker's traceback is above)")
    raise error from remote


def _stop(procs: list) -> None:
    """Terminate the workers still running, then kill those that ignore it."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
