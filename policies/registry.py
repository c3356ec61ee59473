"""Policies by name, for configuration files and command lines (``by_name("auto")``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from ftengine.errors import ConfigError
from ftengine.policies.algebra import Policy
from ftengine.policies.builtin import AutoRecovery, OrchestratorDriven

POLICIES: Mapping[str, Callable[..., Policy]] = MappingProxyType(
    {"orchestrator": OrchestratorDriven, "auto": AutoRecovery}
)


def by_name(name: str, **params: object) -> Policy:
    """Build the policy registered as ``name`` with keyword ``params``.

    ``"orchestrator"`` -> ``OrchestratorDriven(recovery_timeout=...)`` (vLLM's default),
    ``"auto"`` -> ``AutoRecovery(...)``. Raises ``ConfigError`` for an unknown name or
    parameters the policy does not take.
    """
    factory = POLICIES.get(name)
    if factory is None:
        known = ", ".join(repr(n) for n in sorted(POLICIES))
        raise ConfigError(f"unknown policy {name!r}: expected one of {known}")
    try:
        return factory(**params)
    except TypeError as exc:
        raise ConfigError(f"policy {name!r} does not take parameters {params!r}: {exc}") from exc
