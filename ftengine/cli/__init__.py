"""The ``ftengine`` command line.

Every module in this package that defines ``COMMAND`` (a subcommand name) and
``register(parser)`` becomes ``ftengine COMMAND``; modules that define ``BENCH``
become ``ftengine bench BENCH``. Each registered parser sets ``func`` (args -> exit code).

Building the parser imports every module here, so none imports ``ftengine.bench`` at module
level: ``demo`` and the benches import it inside their ``run``, under
:func:`ftengine.cli.extras.bench_extra`, and the other commands work without the ``bench``
extra.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

Handler = Callable[[argparse.Namespace], int]


def _command_modules() -> list[ModuleType]:
    package = sys.modules[__name__]
    names = sorted(info.name for info in pkgutil.iter_modules(package.__path__))
    return [importlib.import_module(f"{__name__}.{name}") for name in names]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ftengine",
        description="Fault-tolerance engine for DP+EP MoE inference.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    bench = commands.add_parser("bench", help="benchmarks that print one JSON object")
    benches = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for module in _command_modules():
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
