"""Build a command's attrs options object from its parsed arguments (no subcommand here)."""

from __future__ import annotations

import argparse
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
