"""`cadence launch --tpu` and the torchrun of the XLA environment (torch 2.9, which torch_xla pins).

`--tpu` (Accelerate's flag) sets `distributed_type: XLA`: the script's `distrib_ctx()` (or `Accelerator()`)
then uses the "xla" strategy without naming it. With `--main_training_function main`, as Accelerate's TPU
launcher does, each worker imports the script (its `if __name__ == "__main__"` block does not run) and
calls `main()`. torchrun's options change between torch versions: the agent gets only those the installed
torch knows (`installed_torchrun_options`).

    cadence launch --tpu --num_processes 1 train.py --epochs 3
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator


def add_xla_options(parser: argparse.ArgumentParser) -> None:
    """Add `--tpu`.

    >>> p = argparse.ArgumentParser(); add_xla_options(p)
    >>> p.parse_args(["--tpu"]).tpu
    True
    """
    parser.add_argument("--tpu", action="store_true",
                        help="train on XLA devices (distributed_type XLA: the script's distrib_ctx() uses the xla strategy)")


def xla_changes(args: argparse.Namespace) -> dict:
    """Config changes `--tpu` asks for.

    >>> xla_changes(argparse.Namespace(tpu=True))
    {'distributed_type': 'XLA'}
    """
    return {"distributed_type": "XLA"} if getattr(args, "tpu", False) else {}


def main_function_target(args: argparse.Namespace, config: Any) -> list[str] | None:
    """`-m` target for the worker that calls the config's `main_training_function` (the flag or the config file's
    key) of the script, on XLA only; else None.

    >>> from cadence.distributed.config import Config
    >>> main_function_target(argparse.Namespace(training_script="t.py", training_script_args=["--lr", "1"],
    ...                      module=False, no_python=False), Config(distributed_type="XLA", main_training_function="main"))
    ['-m', 'cadence.distributed.xla_main', 't.py', 'main', '--lr', '1']
    """
    name = config.main_training_function
    if not name or config.distributed_type != "XLA":
        return None
    if args.module or args.no_python:
        raise ValueError(f"--main_training_function {name} imports a script file: drop --module / --no_python")
    script = Path(args.training_script)
    if script.is_file() and name not in _top_level_functions(script):
        raise ValueError(f"--main_training_function {name}: {script} defines no function {name!r}; name the "
                         f"function that trains, or leave the flag out to run the script as __main__")
    return ["-m", "cadence.distributed.xla_main", args.training_script, name, *args.training_script_args]


def _top_level_functions(script: Path) -> set[str]:
    import ast

    tree = ast.parse(script.read_text(), str(script))
    return {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def installed_torchrun_options(argv: list[str]) -> list[str]:
    """`argv` (option-value pairs for torch.distributed.run) without the options the installed torch lacks.

    torch 2.9 (torch_xla's) has no `--shutdown_timeout` or `--signals_to_handle`: its agent then uses its
    own defaults (SIGTERM reaches the workers; no grace period before SIGKILL).

    >>> installed_torchrun_options(["--nnodes", "1", "--no_such_option", "3"])
    ['--nnodes', '1']
    """
    from torch.distributed import run as torchrun

    known = torchrun.get_args_parser()._option_string_actions
    pairs = zip(argv[::2], argv[1::2])
    return [item for option, value in pairs if option in known for item in (option, value)]


def call_main_function(script: str, name: str, script_args: list[str]) -> None:
    """Import `script` (not as __main__) and call its function `name` with no arguments (Accelerate's TPU launcher)."""
    sys.argv = [script, *script_args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    namespace = runpy.run_path(script, run_name=Path(script).stem)
    function = namespace.get(name)
    if not callable(function):
        raise ValueError(f"--main_training_function {name}: {script} defines no function {name!r}; name the "
                         f"function that trains, or leave the flag out to run the script as __main__")
    function()


def notebook_launch(function: Callable, args: tuple, num_processes: int | None, mixed_precision: str) -> Any:
    """`notebook_launcher` on XLA (`$PJRT_DEVICE` set): `function(*args)` with the "xla" strategy as the default.

    One process (`num_processes=1`): run here, on this process's XLA device, and return the result.
    Several (None: every device of the host): one process per device through `xmp.spawn` (fork, so a
    function defined in a notebook works), as torch_xla documents for TPUs; returns None. That path
    needs working XLA collectives (TPUs) and is untested here.

    >>> notebook_launch(lambda: os.environ["CADENCE_STRATEGY"], (), 1, "no")    # doctest: +SKIP
    'xla'
    """
    if num_processes is not None and (isinstance(num_processes, bool) or not isinstance(num_processes, int)
                                      or num_processes < 1):
        raise ValueError(f"num_processes must be a positive int (or None: every XLA device), got {num_processes!r}")
    with _xla_variables(mixed_precision):
        if num_processes == 1:
            return function(*args)
        import torch_xla.distributed.xla_multiprocessing as xmp

        xmp.spawn(_spawned, args=(function, tuple(args), num_processes), start_method="fork")
        return None


@contextmanager
def _xla_variables(mixed_precision: str) -> Iterator[None]:
    """CADENCE_STRATEGY=xla and the precision, as `cadence launch --tpu` sets them, restored afterwards."""
    wanted = {"CADENCE_STRATEGY": "xla", "CADENCE_MIXED_PRECISION": mixed_precision}
    before = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def _spawned(index: int, function: Callable, args: tuple, num_processes: int | None) -> None:
    """One xmp process: torchrun's variables from the XLA runtime (the strategy then joins the "xla" group)."""
    import torch_xla.runtime as xr

    world = xr.world_size()
    if num_processes is not None and num_processes != world:
        raise ValueError(f"notebook_launcher(num_processes={num_processes}) on XLA: xmp.spawn starts one process per "
                         f"device and this host has {world}; pass num_processes=None (every device) or 1")
    os.environ.update(RANK=str(xr.global_ordinal()), LOCAL_RANK=str(xr.local_ordinal()), WORLD_SIZE=str(world))
    function(*args)

