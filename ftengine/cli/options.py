"""Shared pieces of the commands' argument handling: an attrs options object from parsed
arguments, and bounded integer flags (no subcommand here)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

import attrs
from attrs import AttrsInstance

T = TypeVar("T", bound=AttrsInstance)


def options_from_args(cls: type[T], args: argparse.Namespace, **overrides: object) -> T:
    """An instance of the attrs class ``cls`` from the same-named attributes of ``args``.

    Fields ``args`` lacks keep their defaults; ``overrides`` replace parsed values (e.g. a
    clamped count, or a value derived from several flags).
    """
    given = vars(args)
    values = {field.name: given[field.name] for field in attrs.fields(cls) if field.name in given}
    return cls(**{**values, **overrides})


def at_least(low: int, why: str = "") -> Callable[[str], int]:
    """An argparse ``type`` for integers >= ``low``; ``why`` explains the bound in the error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from exc
        if value < low:
            reason = f" ({why})" if why else ""
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}{reason}")
        return value

    return parse
