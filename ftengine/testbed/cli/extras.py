"""The ``testbed`` extra: the test bed's commands (demo, serve, chaos, benches) import
packages the product does not need (FastAPI, uvicorn, rich, matplotlib, msgspec, openai). A
command imports them inside :func:`testbed_extra`, which turns a missing package into a
message saying how to install it; building the parser needs none of them."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

TESTBED_EXTRA = frozenset(
    {"anyio", "fastapi", "matplotlib", "msgspec", "openai", "rich", "starlette", "uvicorn"}
)
"""Top-level packages of the ``testbed`` extra (``pyproject.toml``'s ``[testbed]`` list)."""


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """The package of the ``testbed`` extra whose absence ``exc`` reports, or None when it
    reports another module missing."""
    top = (exc.name or "").partition(".")[0]
    return top if top in TESTBED_EXTRA else None


@contextlib.contextmanager
def testbed_extra(command: str) -> Iterator[None]:
    """Around the imports of ``ftengine <command>``: a package of the ``testbed`` extra that
    is not installed exits with status 2 and the install command, naming the package; any
    other import error propagates."""
    try:
        yield
    except ModuleNotFoundError as exc:
        missing = missing_extra(exc)
        if missing is None:
            raise
        print(
            f"ftengine {command}: needs the 'testbed' extra, but {missing!r} is not installed; "
            "install it with: pip install 'ftengine[testbed]'",
            file=sys.stderr,
        )
        raise SystemExit(2) from exc
