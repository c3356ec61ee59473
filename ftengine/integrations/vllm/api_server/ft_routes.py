"""The fault-tolerance routes behind the API server's key (``--api-key`` / ``VLLM_API_KEY``).

vLLM's authentication middleware checks the key only on paths under its module constant
``GUARDED_PREFIX`` (``/v1``, ``/v2``, ``/inference``, ``/cohere``), so ``POST
/fault_tolerance/apply`` (which can scale a healthy deployment down) and ``GET
/fault_tolerance/status`` answer anyone who reaches the server. ftengine adds
``/fault_tolerance`` to that constant: vLLM's own middleware then guards them as it guards
``/v1`` (constant-time comparison of the bearer token, its 401 ``{"error": "Unauthorized"}``).
A server that has no key and listens beyond loopback says so at start-up, loudly: anyone who
reaches it can command its engines.
"""

from __future__ import annotations

import inspect
import ipaddress
import logging
from typing import Any

from ftengine.integrations.vllm.messages import import_vllm
from ftengine.integrations.vllm.patches.mechanism import VllmSeamMoved

logger = logging.getLogger(__name__)

AUTH_MODULE = "vllm.entrypoints.serve.middleware.authenticate"
GUARD_NAME = "GUARDED_PREFIX"
FT_PREFIX = "/fault_tolerance"


def guard_ft_routes() -> None:
    """Add :data:`FT_PREFIX` to vLLM's ``GUARDED_PREFIX`` (idempotent); raise
    :class:`VllmSeamMoved` if vLLM no longer guards by that constant."""
    module = import_vllm(AUTH_MODULE)
    prefixes = getattr(module, GUARD_NAME, None)
    middleware = getattr(module, "AuthenticationMiddleware", None)
    reads = isinstance(middleware, type) and GUARD_NAME in inspect.getsource(middleware.__call__)
    if not (isinstance(prefixes, tuple) and all(isinstance(p, str) for p in prefixes) and reads):
        raise VllmSeamMoved(
            f"expected {AUTH_MODULE}.{GUARD_NAME} (a tuple of path prefixes read by "
            f"AuthenticationMiddleware.__call__), found {prefixes!r}: ftengine cannot put "
            "/fault_tolerance behind the API key in this vLLM"
        )
    if FT_PREFIX not in prefixes:
        setattr(module, GUARD_NAME, (*prefixes, FT_PREFIX))


def has_api_key(args: Any) -> bool:
    """vLLM's rule (``serve/middleware/register.py``): ``--api-key`` values, else
    ``VLLM_API_KEY``; any non-empty one installs the authentication middleware."""
    envs = import_vllm("vllm.envs")
    return any(key for key in (getattr(args, "api_key", None) or [envs.VLLM_API_KEY]))


def is_loopback(host: str | None) -> bool:
    """Whether a server bound to ``host`` is reachable only from this machine (vLLM binds
    every interface when no ``--host`` is given)."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def warn_if_open(args: Any) -> bool:
    """Log a warning (and return True) when the FT routes answer anyone beyond loopback."""
    host = getattr(args, "host", None)
    if has_api_key(args) or is_loopback(host):
        return False
    logger.warning(
        "[FT] /fault_tolerance/apply is open to anyone who reaches %s:%s (no --api-key and "
        "no VLLM_API_KEY): any client can retry or scale_down this deployment's engines. "
        "Start vLLM with --api-key KEY (the FT routes then need it, as /v1 does) or bind "
        "--host 127.0.0.1.",
        host or "every interface",
        getattr(args, "port", "?"),
    )
    return True
