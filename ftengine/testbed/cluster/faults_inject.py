"""Fault injection for tests and demos: ``FTENGINE_INJECT_FAULT="rank=3,step=50,kind=raise"``.

Kinds: ``raise`` (a transient error in the forward pass at ``step``), ``hang`` (the
worker's main thread stops at ``step`` while its heartbeat thread keeps beating, like a
stuck device op), ``kill`` (the worker SIGKILLs itself at ``step``) and ``reload_error``
(the worker's next expert reload fails; ``step`` is ignored). Each injection fires once,
except ``poison`` (``"kind=poison,token=77"``): every rank's forward pass raises in every
step that feeds token id ``token`` (``rank`` and ``step`` are ignored), the request whose
own content faults each re-run.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable, Mapping

import attrs

from ftengine.errors import ConfigError, FTEngineError

ENV_VAR = "FTENGINE_INJECT_FAULT"


class InjectKind(str, enum.Enum):
    """What an injected fault does."""

    RAISE = "raise"
    HANG = "hang"
    KILL = "kill"
    RELOAD_ERROR = "reload_error"
    POISON = "poison"


class InjectedFault(FTEngineError, RuntimeError):
    """The error an injected ``raise`` fault throws inside the forward pass."""


@attrs.frozen
class FaultSpec:
    """One fault to inject: on DP ``rank``, at model ``step`` (0-based), of ``kind``
    (``token``: the poison token id, for ``poison`` only)."""

    rank: int = attrs.field(validator=attrs.validators.ge(0))
    kind: InjectKind
    step: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    token: int | None = None

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """Parse ``"rank=3,step=50,kind=raise"`` (``step`` optional, default 0)."""
        fields: dict[str, str] = {}
        for part in text.split(","):
            key, sep, value = part.strip().partition("=")
            if not sep or not key:
                raise ConfigError(
                    f"{ENV_VAR}: expected comma-separated key=value pairs like "
                    f"'rank=3,step=50,kind=raise', found {text!r}"
                )
            fields[key.strip()] = value.strip()
        return cls._from_fields(fields, text)

    @classmethod
    def _from_fields(cls, fields: Mapping[str, str], text: str) -> FaultSpec:
        unknown = set(fields) - {"rank", "step", "kind", "token"}
        poison = fields.get("kind") == InjectKind.POISON.value
        if unknown or "kind" not in fields or ("rank" not in fields) == (not poison):
            raise ConfigError(
                f"{ENV_VAR}: expected keys rank, kind and optionally step (or kind=poison "
                f"and token), found {text!r}"
            )
        if poison != ("token" in fields):
            raise ConfigError(f"{ENV_VAR}: token goes with kind=poison only, found {text!r}")
        kinds = ", ".join(k.value for k in InjectKind)
        try:
            kind = InjectKind(fields["kind"])
        except ValueError as exc:
            raise ConfigError(
                f"{ENV_VAR}: kind must be one of {kinds}, found {fields['kind']!r}"
            ) from exc
        try:
            token = int(fields["token"]) if poison else None
            rank, step = int(fields.get("rank", "0")), int(fields.get("step", "0"))
            return cls(rank=rank, kind=kind, step=step, token=token)
        except ValueError as exc:
            raise ConfigError(
                f"{ENV_VAR}: rank, step and token must be integers >= 0, found {text!r}"
            ) from exc

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FaultSpec | None:
        """The fault named by ``FTENGINE_INJECT_FAULT``, or None when it is unset or empty."""
        text = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
        return cls.parse(text) if text else None

    def __str__(self) -> str:
        if self.kind is InjectKind.POISON:
            return f"kind=poison,token={self.token}"
        return f"rank={self.rank},step={self.step},kind={self.kind.value}"


class FaultInjector:
    """Fires one :class:`FaultSpec` on the rank it names, once.

    The worker asks ``due(step)`` at the start of each real model step and
    ``reload_due()`` before reloading experts; ``fired`` tells whether it went off.
    """

    def __init__(self, spec: FaultSpec | None, rank: int) -> None:
        poison = spec is not None and spec.kind is InjectKind.POISON
        self._spec = spec if spec is not None and (poison or spec.rank == rank) else None
        self.fired = False
        self._rank = rank

    def arm(self, spec: FaultSpec) -> None:
        """Replace what this injector fires with ``spec`` (if it names this rank), unfired."""
        self._spec = spec if spec.kind is InjectKind.POISON or spec.rank == self._rank else None
        self.fired = False

    def poisoned(self, token_ids: Iterable[int]) -> bool:
        """True when the step feeds the poison token (every time, on every rank)."""
        spec = self._spec
        if spec is None or spec.kind is not InjectKind.POISON:
            return False
        return spec.token in set(token_ids)

    def due(self, step: int) -> InjectKind | None:
        """The step-time kind to fire now (``raise``/``hang``/``kill``), at most once."""
        spec = self._spec
        if spec is None or self.fired or spec.kind in (InjectKind.RELOAD_ERROR, InjectKind.POISON):
            return None
        if step < spec.step:
            return None
        self.fired = True
        return spec.kind

    def reload_due(self) -> bool:
        """True once when a ``reload_error`` fault must make this reload fail."""
        spec = self._spec
        if spec is None or self.fired or spec.kind is not InjectKind.RELOAD_ERROR:
            return False
        self.fired = True
        return True
