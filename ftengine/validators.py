"""attrs field validators that raise ``ConfigError`` (ftengine's root + ValueError) with the
field name, the value found and what was expected."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeGuard

import attrs

from ftengine.errors import ConfigError

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _owner(instance: object) -> str:
    return type(instance).__name__


def int_at_least(low: int) -> Validator:
    """An ``int`` (not a bool) that is ``>= low``."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(
                f"{_owner(instance)}.{attribute.name} must be an int >= {low}, got {value!r}"
            )

    return check


def _is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def seconds(*, positive: bool = False) -> Validator:
    """A finite float number of seconds, ``> 0`` when ``positive`` else ``>= 0``."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        number = float(value) if _is_number(value) else math.nan
        if not math.isfinite(number) or number < 0 or (positive and number == 0):
            bound = "> 0" if positive else ">= 0"
            raise ConfigError(
                f"{_owner(instance)}.{attribute.name} must be finite seconds {bound}, got {value!r}"
            )

    return check


def finite_float() -> Validator:
    """Any finite number (an absolute monotonic time, say)."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise ConfigError(
                f"{_owner(instance)}.{attribute.name} must be a finite number, got {value!r}"
            )

    return check


def fraction() -> Validator:
    """A float in ``[0, 1]``."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not _is_number(value) or not 0 <= value <= 1:
            raise ConfigError(
                f"{_owner(instance)}.{attribute.name} must be in [0, 1], got {value!r}"
            )

    return check


def rank_set(*, non_empty: bool = False) -> Validator:
    """A frozenset of DP ranks (ints >= 0), non-empty when asked."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: frozenset[object]) -> None:
        bad = sorted(
            repr(r) for r in value if isinstance(r, bool) or not isinstance(r, int) or r < 0
        )
        if bad:
            raise ConfigError(
                f"{_owner(instance)}.{attribute.name} must hold DP ranks (ints >= 0), "
                f"found {', '.join(bad)}"
            )
        if non_empty and not value:
            raise ConfigError(f"{_owner(instance)}.{attribute.name} must name at least one rank")

    return check


def to_ranks(value: object) -> frozenset[int]:
    """Converter: any iterable of ranks to a frozenset (a lone int is refused, not wrapped)."""
    if isinstance(value, (str, bytes, int)) or not hasattr(value, "__iter__"):
        raise ConfigError(f"expected an iterable of DP ranks, got {value!r}")
    return frozenset(value)
