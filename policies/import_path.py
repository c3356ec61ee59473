"""Policies named by import path in configuration (``"package.module:factory"``).

``policy_from_import_path("my_policies:make", **params)`` imports ``my_policies``, calls
``make(**params)`` and checks that it returned a policy (a callable ``RecoveryContext ->
Decision | None``). Every way it can go wrong (no colon, import error, missing name, not
callable, wrong return type) is a ``ConfigError`` naming the path, raised at start-up.
"""

from __future__ import annotations

import importlib
from typing import Any

from ftengine.errors import ConfigError
from ftengine.policies.algebra import Composable, Policy, as_policy
from ftengine.policies.decisions import Decision

SEPARATOR = ":"


def is_import_path(name: str) -> bool:
    """Whether a configured policy name is an import path rather than a registered name."""
    return SEPARATOR in name


def policy_from_import_path(path: str, **params: object) -> Composable:
    """The policy ``factory(**params)`` built by the factory at ``path`` (composable)."""
    module_name, _, attribute = path.partition(SEPARATOR)
    if not module_name or not attribute:
        raise ConfigError(
            f"policy {path!r}: expected an import path 'package.module:factory', "
            "e.g. 'my_policies:retry_once'"
        )
    factory = _resolve(path, module_name, attribute)
    if not callable(factory):
        raise ConfigError(
            f"policy {path!r}: expected {attribute} to be a callable that returns a policy, "
            f"found {type(factory).__name__}"
        )
    try:
        policy: Any = factory(**params)
    except TypeError as exc:
        raise ConfigError(f"policy {path!r}: calling {attribute}({params}) failed: {exc}") from exc
    if isinstance(policy, Decision | type) or not callable(policy):
        raise ConfigError(
            f"policy {path!r}: expected {attribute}() to return a policy (a callable "
            f"RecoveryContext -> Decision | None), found {type(policy).__name__}"
        )
    checked: Policy = policy
    return as_policy(checked)


def _resolve(path: str, module_name: str, attribute: str) -> object:
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"policy {path!r}: cannot import {module_name} ({type(exc).__name__}: {exc})"
        ) from exc
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise ConfigError(f"policy {path!r}: {module_name} has no {attribute}") from exc
    return target
