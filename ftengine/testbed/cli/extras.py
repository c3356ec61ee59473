"""The ``bench`` extra: the demo and the benchmarks import ``ftengine.bench``, which needs
rich, matplotlib and psutil; the rest of the command line needs none of them. A command
imports ``ftengine.bench`` inside :func:`bench_extra`, which turns a missing package into a
message saying how to install it."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

BENCH_EXTRA = frozenset({"matplotlib", "psutil", "rich"})
"""Top-level packages of the ``bench`` extra (``pyproject.toml``'s ``[bench]`` list)."""


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """The package of the ``bench`` extra whose absence ``exc`` reports, or None when it
    reports another module missing."""
    top = (exc.name or "").partition(".")[0]
    return top if top in BENCH_EXTRA else None


@contextlib.contextmanager
def bench_extra(command: str) -> Iterator[None]:
    """Around the imports of ``ftengine <command>``: a package of the ``bench`` extra that is
    not installed exits with status 2 and the install command, naming the package; any
    other import error propagates."""
    try:
        yield
    except ModuleNotFoundError as exc:
        missing = missing_extra(exc)
        if missing is None:
            raise
        print(
            f"ftengine {command}: needs the 'bench' extra, but {missing!r} is not installed; "
            "install it with: pip install 'ftengine[bench]'",
            file=sys.stderr,
        )
        raise SystemExit(2) from exc
