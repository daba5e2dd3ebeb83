"""`cadence` command line: a thin argparse layer over cadence.distributed.launch and .config."""

from __future__ import annotations

import argparse
import sys

import cadence
from cadence.distributed import launch as launch_mod


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cadence")
    parser.add_argument("--version", action="version", version=f"cadence {cadence.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    launch_mod.add_launch_args(sub.add_parser("launch", help="run a script on N processes"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return launch_mod.launch(args)


if __name__ == "__main__":
    sys.exit(main())
