"""Policies by name: the one registry behind every configuration surface (``by_name`` for
library users, ``ClusterConfig.policy``, vLLM's ``additional_config`` and the NPU backend's).

In the style of vLLM EPLB's policy registry: ``POLICIES`` maps every ``PolicyName`` to a
factory, checked against each other at import, and every factory takes the same arguments:
``factory(deployment, **params)``. ``deployment`` is where one name means more in a
deployment than on its own (see :class:`Deployment`), so no configuration surface keeps a
registry of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal, Protocol, TypeGuard, get_args

import attrs

from ftengine.errors import ConfigError
from ftengine.faults import FaultKind
from ftengine.policies.algebra import Policy
from ftengine.policies.builtin import AutoRecovery, OrchestratorDriven
from ftengine.policies.import_path import is_import_path, policy_from_import_path
from ftengine.validators import seconds

PolicyName = Literal["orchestrator", "auto"]

LOCAL_FAULT_KINDS = frozenset({FaultKind.TRANSIENT, FaultKind.DEVICE_ERROR})
"""Faults of this worker's own making: retrying them needs no word about any peer."""


@attrs.frozen
class Deployment:
    """Where a policy runs as one worker of many (the CPU cluster, vLLM's workers).

    There a collective error only says *some* peer closed or stopped answering
    (``DEAD_PEER`` / ``HUNG_PEER`` without a rank); someone outside the worker (the
    cluster's supervisor) later names the dead rank, or says "transient, everyone is
    alive", and an orchestrator may send a command up to ``recovery_timeout`` s after the
    first fault. Retrying a rank-less peer fault at once would rebuild a group with a dead
    member, so a deployed policy waits for that verdict or command, and what it leaves
    undecided goes to :meth:`fallback`.
    """

    recovery_timeout: float = attrs.field(validator=seconds(positive=True))

    def fallback(self) -> OrchestratorDriven:
        """The last word in a deployment: wait ``recovery_timeout`` s for a command."""
        return OrchestratorDriven(recovery_timeout=self.recovery_timeout)


class PolicyFactory(Protocol):
    """``factory(deployment, **params)``: the policy a name stands for, built with its
    keyword ``params``; alone when ``deployment`` is None, else as a deployed worker runs it.
    Raises ``TypeError`` for parameters it does not take."""

    def __call__(self, deployment: Deployment | None, /, **params: Any) -> Policy: ...


def _orchestrator(deployment: Deployment | None, /, **params: Any) -> Policy:
    """``OrchestratorDriven(**params)``, vLLM's behaviour; deployed, the deployment's fallback."""
    if deployment is None:
        return OrchestratorDriven(**params)
    return OrchestratorDriven(recovery_timeout=deployment.recovery_timeout, **params)


def _auto(deployment: Deployment | None, /, **params: Any) -> Policy:
    """``AutoRecovery(**params)``; deployed, it retries only ``LOCAL_FAULT_KINDS`` (unless
    ``retry_kinds`` says otherwise) and hands what it abstains on to the fallback."""
    if deployment is None:
        return AutoRecovery(**params)
    return AutoRecovery(**{"retry_kinds": LOCAL_FAULT_KINDS, **params}) | deployment.fallback()


POLICIES: Mapping[PolicyName, PolicyFactory] = MappingProxyType(
    {"orchestrator": _orchestrator, "auto": _auto}
)
POLICY_NAMES: tuple[PolicyName, ...] = tuple(sorted(POLICIES))

if set(POLICIES) != set(get_args(PolicyName)):  # the registry and the typed names agree
    raise ImportError(
        f"POLICIES registers {sorted(POLICIES)}, expected PolicyName's {get_args(PolicyName)}"
    )


def _registered(name: object) -> TypeGuard[PolicyName]:
    return isinstance(name, str) and name in POLICIES


def _unknown(name: object) -> ConfigError:
    known = ", ".join(repr(n) for n in POLICY_NAMES)
    return ConfigError(
        f"unknown policy {name!r}: expected one of {known} or an import path "
        "'package.module:factory'"
    )


def check_name(name: object) -> str:
    """``name`` if it names a registered policy or a factory's import path (imported and
    checked now, so a bad path fails at start-up); else ``ConfigError`` naming what is wrong.

    Configuration surfaces check their policy option with this when they parse it.
    """
    if isinstance(name, str) and is_import_path(name):
        policy_from_import_path(name)
        return name
    if not _registered(name):
        raise _unknown(name)
    return name


def _imported(path: str) -> PolicyFactory:
    """The factory of an import path: the user's policy; deployed, with the fallback after
    it, so whatever it leaves undecided still waits for an orchestrator."""

    def factory(deployment: Deployment | None, /, **params: Any) -> Policy:
        policy = policy_from_import_path(path, **params)
        return policy if deployment is None else policy | deployment.fallback()

    return factory


def factory_of(name: str) -> PolicyFactory:
    """The factory registered as ``name`` (or at import path ``name``); ``ConfigError``
    listing the names if there is none."""
    if is_import_path(name):
        return _imported(name)
    if not _registered(name):
        raise _unknown(name)
    return POLICIES[name]


def by_name(name: str, *, deployment: Deployment | None = None, **params: Any) -> Policy:
    """Build the policy registered as ``name`` (or made by the factory at import path
    ``name``, ``"package.module:factory"``) with keyword ``params``.

    ``"orchestrator"`` -> ``OrchestratorDriven(recovery_timeout=...)`` (vLLM's default),
    ``"auto"`` -> ``AutoRecovery(...)``; with a ``deployment`` as its workers run them
    (``"auto"``: ``AutoRecovery(retry_kinds=LOCAL_FAULT_KINDS) | deployment.fallback()``).
    Raises ``ConfigError`` for an unknown name or parameters the policy does not take.
    """
    factory = factory_of(name)
    try:
        return factory(deployment, **params)
    except TypeError as exc:
        raise ConfigError(f"policy {name!r} does not take parameters {params!r}: {exc}") from exc
