"""The ``ftengine`` command line.

Every module of a command package that defines ``COMMAND`` (a subcommand name) and
``register(parser)`` becomes ``ftengine COMMAND``; modules that define ``BENCH`` become
``ftengine bench BENCH``. Each registered parser sets ``func`` (args -> exit code).

The command packages are this one (the product's commands) and every package named in the
``ftengine.commands`` entry-point group (the test bed's, ``ftengine.testbed.cli``). A
source checkout run without installed metadata has no entry points: then the test bed's
package is imported by name if present (:func:`_extension_packages`). Building the parser
imports every command module, so none imports a third-party package of an extra at module
level (the test bed's commands do inside their ``run``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import pkgutil
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

Handler = Callable[[argparse.Namespace], int]

COMMANDS_GROUP = "ftengine.commands"
"""Entry-point group whose entries name packages of command modules."""

TESTBED_COMMANDS = "ftengine.testbed.cli"
"""The test bed's command package, imported by name when no entry point names a package."""


def _extension_packages() -> list[ModuleType]:
    """The command packages the entry-point group names; in a source checkout without
    installed metadata (an empty group), the test bed's package if it is there."""
    entries = sorted(importlib.metadata.entry_points(group=COMMANDS_GROUP), key=lambda e: e.name)
    if entries:
        return [entry.load() for entry in entries]
    try:
        return [importlib.import_module(TESTBED_COMMANDS)]
    except ModuleNotFoundError as exc:
        if exc.name is None or not TESTBED_COMMANDS.startswith(exc.name):
            raise
        return []


def _command_modules(package: ModuleType) -> list[ModuleType]:
    names = sorted(info.name for info in pkgutil.iter_modules(package.__path__))
    return [importlib.import_module(f"{package.__name__}.{name}") for name in names]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ftengine",
        description="Fault-tolerance engine for DP+EP MoE inference.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    bench = commands.add_parser("bench", help="benchmarks that print one JSON object")
    benches = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    packages = [sys.modules[__name__], *_extension_packages()]
    for module in (module for package in packages for module in _command_modules(package)):
        command = getattr(module, "COMMAND", None)
        if command is not None:
            module.register(
                commands.add_parser(command, help=module.__doc__, description=module.__doc__)
            )
        bench_name = getattr(module, "BENCH", None)
        if bench_name is not None:
            module.register(
                benches.add_parser(bench_name, help=module.__doc__, description=module.__doc__)
            )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ftengine`` console script."""
    args = build_parser().parse_args(argv)
    func: Handler = args.func
    return func(args)


if __name__ == "__main__":
    raise SystemExit(main())
