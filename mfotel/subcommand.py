"""A command of `mfotel` that also runs alone (`python -m mfotel.actions.control ...`): its
arguments and its `run` are declared once, with the module that owns the concern.

    COMMAND = Subcommand("control", "stop a run or scale its learning rate", "mfotel control",
                         add_arguments, run, __doc__)
    add_control_command = COMMAND.register   # `mfotel control` (cli.py)
    main = COMMAND.main                      # alone, and in tests: main(["JOB_DIR", "--stop"])
"""
from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    prog: str                                                    # the name `main` shows
    add_arguments: Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
    run: Callable[[argparse.Namespace], int]
    doc: str | None = None       # the module docstring: its first line describes the command

    @property
    def description(self) -> str | None:
        return self.doc.splitlines()[0] if self.doc else None

    def register(self, subparsers: Any) -> argparse.ArgumentParser:
        """Add the command to argparse subparsers; dispatch via `args.func(args)`."""
        parser: argparse.ArgumentParser = subparsers.add_parser(
            self.name, help=self.help, description=self.description)
        self.add_arguments(parser)
        parser.set_defaults(func=self.run)
        return parser

    def main(self, argv: Sequence[str] | None = None) -> int:
        """Run the command alone with `argv` (default: sys.argv[1:]); its exit status."""
        parser = self.add_arguments(argparse.ArgumentParser(prog=self.prog,
                                                            description=self.description))
        return self.run(parser.parse_args(argv))
