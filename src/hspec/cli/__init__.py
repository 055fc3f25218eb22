"""The `hspec` command line: the only package that reads argv; each command calls library code.

One module per command group, each holding its commands' rows of the table (`command.Command`: name,
help, arguments, what runs it); `options` holds the flags several commands share. `COMMANDS` below is
the whole table, in the order `hspec --help` lists it:

- generate.py: `generate`, `demo`          - serve.py: `serve`
- train.py: `data`, `train`, `validate`, `train-report`
- export.py: `export-drafter`, `export-gguf`
- evaluate.py: `eval`, `eval-report`           - bench.py: `bench decode|serve|vllm|vllm-serve|draft`
- describe.py: `kv-table`, `drafters describe`
- lab.py: `lab merge|claims|table` (the research tooling, `hspec.lab`; the only commands that import it)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hspec.cli import bench, describe, evaluate, export, generate, lab, serve, train
from hspec.cli.command import add_commands
from hspec.console import json_stdout

COMMANDS = (*generate.COMMANDS, *serve.COMMANDS, *train.COMMANDS, *export.COMMANDS, *evaluate.COMMANDS,
            *bench.COMMANDS, *describe.COMMANDS, *lab.COMMANDS)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: every command of `COMMANDS`, and the lab's earlier names (hidden)."""
    parser = argparse.ArgumentParser(
        prog="hspec", description="Lossless speculative decoding with the H-Spec drafter and its baselines.")
    add_commands(parser, COMMANDS, "command", hidden=lab.HIDDEN)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the subcommand `argv` names (default: the process's arguments); a bad value exits with 2."""
    args = build_parser().parse_args(argv)
    args.command_line = "hspec " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        if getattr(args, "json", None) is True:  # `--json`: stdout carries the JSON alone (`eval-report`'s is a path)
            with json_stdout() as args.json_out:
                return args.handler(args)
        return args.handler(args)
    except (ValueError, FileNotFoundError, FileExistsError) as err:  # FileExistsError: an output that is not ours
        print(f"hspec: error: {err}", file=sys.stderr)
        return 2
