"""`cadence` command line: a thin argparse layer over cadence.distributed.launch and .config.

    cadence --version
    cadence env
    cadence config [default|update] [--num_processes 2 --mixed_precision bf16 ...]
    cadence launch --num_processes 2 train.py --epochs 3
    cadence test --cpu --num_processes 2
    cadence estimate-memory 7B --num_processes 8
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

import cadence
from cadence.distributed import config as cfg_mod
from cadence.distributed.environment_report import environment_report
from cadence.distributed import launch as launch_mod
from cadence.distributed import other_launchers


def build_parser() -> argparse.ArgumentParser:
    """The `cadence` parser with its subcommands env, config, launch and test.

    >>> build_parser().parse_args(["config", "default", "--num_processes", "2"]).num_processes
    2
    """
    parser = argparse.ArgumentParser(prog="cadence", description="Launch and configure cadence training runs.",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"cadence {cadence.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="print versions, hardware and the config", allow_abbrev=False)
    env.add_argument("--config_file", default=None)
    config = sub.add_parser("config", help="write the launch config (asks in a terminal; flags answer questions)",
                            allow_abbrev=False)
    config.add_argument("action", nargs="?", choices=("ask", "default", "update"), default="ask",
                        help="ask (default): ask what flags leave open; default: write without asking; "
                             "update: rewrite an old or Accelerate-format file in cadence's format")
    config.add_argument("--config_file", default=None, help="where to write (default: the default config path)")
    cfg_mod.add_config_flags(config)
    launch = sub.add_parser("launch", help="run a script on N processes", allow_abbrev=False)
    launch_mod.add_launch_args(launch)
    test = sub.add_parser("test", help="run a short distributed check with the config", allow_abbrev=False)
    launch_mod.add_launch_options(test)
    for command in (env, config, launch, test):
        _accept_dashes(command)
    estimate = sub.add_parser("estimate-memory", allow_abbrev=False,
                              help="model-state memory per process for DDP, FSDP, ZeRO 1-3, with and without offload")
    estimate.add_argument("model", help="a parameter count (7B, 350M, 1e9), a Hugging Face config (a directory holding "
                                        "config.json, or the file), or module:function returning an nn.Module, "
                                        "importable from the current directory (both built on the meta device: no memory)")
    estimate.add_argument("--num_processes", type=int, nargs="+", default=[8], help="processes in total (several: one table each)")
    estimate.add_argument("--num_machines", type=int, default=1, help="machines (DeepSpeed's CPU estimate is per machine)")
    return parser


def _accept_dashes(parser: argparse.ArgumentParser) -> None:
    """Let `--num-processes` mean `--num_processes`, as Accelerate's launcher does (not listed in --help)."""
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--") and "_" in option:
                parser._option_string_actions.setdefault("--" + option[2:].replace("_", "-"), action)


def estimate_memory(args: argparse.Namespace) -> int:
    """`cadence estimate-memory`: print the model-state table for each process count.

    >>> estimate_memory(build_parser().parse_args(["estimate-memory", "1B"]))     # doctest: +SKIP
    Model states for 1,000,000,000 parameters on 8 processes ...
    0
    """
    from cadence.distributed import estimate

    for n in args.num_processes:
        if n < 1 or n % args.num_machines:
            raise ValueError(f"--num_processes {n} must be a positive multiple of --num_machines {args.num_machines}")
    total, largest = estimate.model_sizes(args.model)
    for n in args.num_processes:
        print(estimate.table(total, n, largest, args.num_machines), end="\n\n")
    return 0


def configure(args: argparse.Namespace) -> int:
    """`cadence config`: write the config file and say where; returns the exit code.

    >>> configure(build_parser().parse_args(["config", "default", "--use_cpu"]))     # doctest: +SKIP
    cadence config written to /home/me/.cache/cadence/default_config.yaml
    0
    """
    given = cfg_mod.flag_values(args)
    if args.action == "default":
        start = cfg_mod.Config()
    else:
        if args.action == "update":          # the file must exist: an explicit path
            start = cfg_mod.load_config(args.config_file or cfg_mod.default_config_path())
        else:
            start = cfg_mod.load_config(_existing(args.config_file))
    ask = input if args.action == "ask" and sys.stdin.isatty() else None
    config = cfg_mod.questionnaire(start, given, ask)
    config.check_strategy_exists()
    path = cfg_mod.save(config, args.config_file)
    print(f"cadence config written to {path}")
    return 0


def _existing(path: str | None) -> str | None:
    """`path` if the file exists, so `cadence config` starts from its values; else None (the default file)."""
    return path if path is not None and Path(path).expanduser().is_file() else None


def self_test(args: argparse.Namespace) -> int:
    """`cadence test`: launch cadence.distributed.check with the config and report the outcome.

    >>> self_test(build_parser().parse_args(["test", "--cpu", "--num_processes", "2"]))   # doctest: +SKIP
    passed rendezvous: 2 process(es) joined over gloo in 0.1s
    ...
    cadence test: all checks passed
    0
    """
    args.training_script, args.training_script_args, args.module, args.no_python = "cadence.distributed.check", [], True, False
    code = launch_mod.launch(args)
    print("cadence test: all checks passed" if code == 0 else f"cadence test: FAILED (exit code {code}), see above")
    return code


def unknown_flags_message(parser: argparse.ArgumentParser, command: str, unknown: list[str]) -> str:
    """What to say about arguments `cadence <command>` does not know, with the flag probably meant.

    Flags of torchrun, DeepSpeed's and Accelerate's launchers get their mapping or the reason they
    are refused (`other_launchers`); any other flag the closest known one.

    >>> unknown_flags_message(build_parser(), "launch", ["--num_nodes", "2"])
    'unknown flag --num_nodes: did you mean --num_machines?'
    """
    sub = next(a for a in parser._subparsers._group_actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    known = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    flags = [u.split("=")[0] for u in unknown if u.startswith("-")]
    if not flags:
        return f"unexpected arguments {' '.join(unknown)}: see `cadence {command} --help`"
    parts = []
    for flag in flags:
        known_answer = other_launchers.advice(flag)
        guess = next(iter(difflib.get_close_matches(flag.replace("-", "_").replace("__", "--", 1), known, n=1,
                                                    cutoff=0.6)), None)
        answer = known_answer or (f"did you mean {guess}?" if guess else f"see `cadence {command} --help`")
        parts.append(f"unknown flag {flag}: {answer}")
    return "; ".join(parts)


def _script_args_as_given(argv: list[str], args: argparse.Namespace) -> list[str]:
    """The script's arguments as typed: argparse drops a `--` right after the script, the script may want it.

    >>> _script_args_as_given(["launch", "t.py", "--", "-x"], argparse.Namespace(training_script="t.py", training_script_args=["-x"]))
    ['--', '-x']
    """
    given = args.training_script_args
    before = argv[:len(argv) - len(given)]
    return ["--", *given] if before[-2:] == [args.training_script, "--"] else given


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `cadence` command; returns the exit code.

    >>> main(["config", "default", "--num_processes", "2", "--use_cpu"])    # doctest: +SKIP
    0
    """
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.exit(2, f"cadence {args.command}: error: {unknown_flags_message(parser, args.command, unknown)}\n")
    if args.command == "launch":
        args.training_script_args = _script_args_as_given(sys.argv[1:] if argv is None else argv, args)
    commands = {"env": lambda a: print(environment_report(a.config_file)) or 0,
                "config": configure, "launch": launch_mod.launch, "test": self_test, "estimate-memory": estimate_memory}
    try:
        return commands[args.command](args)
    except (ValueError, FileNotFoundError) as e:
        print(f"cadence {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
