"""The command-adapter seam: what a cluster worker hands the orchestrator's commands to.

``ClusterConfig.command_adapter = "package.module:function"`` names a factory that each
worker resolves once and calls as ``factory(sentinel, rank)``; every ``retry`` /
``scale_down`` the supervisor relays then goes through the returned object's
``run_command``. Without one, commands go straight to the worker's RankSentinel.
``ftengine.testbed.vllm.cluster_adapter:vllm_command_adapter`` is the one that drives
the cluster through vLLM's own message types.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Protocol, cast

from ftengine.commands import CommandResult
from ftengine.errors import ConfigError
from ftengine.sentinel import RankSentinel


class CommandAdapter(Protocol):
    """Runs one orchestrator command on this worker, to its end (``RankSentinel`` is one)."""

    def run_command(
        self, instruction: str, params: Mapping[str, object], request_id: str
    ) -> CommandResult: ...


AdapterFactory = Callable[[RankSentinel, int], CommandAdapter]
"""``factory(sentinel, rank)``: the adapter of DP rank ``rank``'s worker."""

_EXPECTED = "expected 'package.module:function' naming a callable importable by the workers"


def resolve_adapter_factory(spec: str) -> AdapterFactory:
    """Import the factory ``spec`` names; ConfigError if it does not import or is not callable."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"ClusterConfig.command_adapter {spec!r} is malformed: {_EXPECTED}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"ClusterConfig.command_adapter {spec!r}: module {module_name!r} does not import "
            f"({type(exc).__name__}: {exc}); {_EXPECTED}"
        ) from exc
    factory = getattr(module, attribute, None)
    if factory is None:
        raise ConfigError(
            f"ClusterConfig.command_adapter {spec!r}: module {module_name!r} has no attribute "
            f"{attribute!r}; {_EXPECTED}"
        )
    if not callable(factory):
        raise ConfigError(
            f"ClusterConfig.command_adapter {spec!r}: {attribute!r} is a "
            f"{type(factory).__name__}, not callable; {_EXPECTED}"
        )
    return cast(AdapterFactory, factory)


def build_command_adapter(spec: str | None, sentinel: RankSentinel, rank: int) -> CommandAdapter:
    """The adapter ``spec`` names, built for ``rank`` over ``sentinel`` (the sentinel if None)."""
    if spec is None:
        return sentinel
    adapter = resolve_adapter_factory(spec)(sentinel, rank)
    if not callable(getattr(adapter, "run_command", None)):
        raise ConfigError(
            f"ClusterConfig.command_adapter {spec!r} returned a {type(adapter).__name__} without "
            "a run_command(instruction, params, request_id) method"
        )
    return adapter
