"""The row of the command table: one `hspec` command, what `--help` says of it, its arguments and what runs it.

A command group (`hspec bench ...`, `hspec lab ...`) is a command whose arguments are its own table
(`group`). `add_commands` turns a table into argparse subcommands; a command listed as hidden parses as
usual but is left out of `--help` (the old names of the lab's commands, which scripts still run).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Handler = Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class Command:
    name: str  # what follows `hspec` (or the group's name)
    help: str  # its line in the parent's --help
    arguments: Callable[[argparse.ArgumentParser], None]  # adds its flags (a group: its subcommands)
    run: Handler | None = None  # called with the parsed arguments; None for a group
    description: str | None = None  # the head of its own --help (default: `help`)


def add_commands(parser: argparse.ArgumentParser, table: Sequence[Command], dest: str,
                 hidden: Sequence[Command] = ()) -> None:
    """Every command of `table` as a subcommand of `parser` (the chosen name lands in `args.<dest>`), and
    `hidden` ones that parse but are not listed."""
    shown = [command.name for command in table]
    sub = parser.add_subparsers(dest=dest, required=True, metavar="{" + ",".join(shown) + "}")
    for command in table:
        _add(sub.add_parser(command.name, help=command.help, description=command.description or command.help),
             command)
    for command in hidden:  # no help=: argparse lists only subcommands that have one
        _add(sub.add_parser(command.name, description=command.description or command.help), command)


def group(table: Sequence[Command], dest: str) -> Callable[[argparse.ArgumentParser], None]:
    """The `arguments` of a command group: its table's commands as its subcommands."""
    return lambda parser: add_commands(parser, table, dest)


def _add(parser: argparse.ArgumentParser, command: Command) -> None:
    command.arguments(parser)
    if command.run is not None:
        parser.set_defaults(handler=command.run)
