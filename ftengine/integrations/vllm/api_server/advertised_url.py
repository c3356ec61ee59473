"""The URL at which this API server's peers reach it, handed to its engine core.

A DEAD engine core hands its held requests to a survivor's API server
(``engine_core/handoff.py``); the engine cores find each other's servers on vLLM's DP store
(``engine_core/survivors.py``), but an engine core does not know its own server's address.
vLLM's API server binds its socket from ``--host`` / ``--port`` before it starts the engine
core, which inherits its environment: so, just before, the server exports
:data:`~ftengine.integrations.vllm.messages.API_URL_ENV` (unless an operator set it, e.g. to
an address a NAT or proxy publishes). Assumes what vLLM's DP group already does: the
peers reach this host at the address ``--host`` names, or, when it binds every interface,
at vLLM's ``get_ip()`` (``VLLM_HOST_IP`` when set, else the interface of the default route).
A server on a Unix socket (``--uds``) has no URL: its engine core hands nothing to peers.
With ``--api-key`` the first key goes the same way (:data:`API_KEY_ENV`): the survivors'
servers, the same deployment's, ask for it.
"""

from __future__ import annotations

import os
from argparse import Namespace
from collections.abc import Callable

from ftengine.integrations.vllm.messages import API_KEY_ENV, API_URL_ENV, import_vllm

WILDCARDS = ("", "0.0.0.0", "::")
"""``--host`` values that bind every interface (vLLM's default is none: every interface)."""


def advertised_url(args: Namespace, host_ip: Callable[[], str] | None = None) -> str | None:
    """``http(s)://host:port`` of the server ``args`` (vLLM's parsed flags) start, or None
    on a Unix socket; ``host_ip`` (default vLLM's ``get_ip``) names a wildcard's host."""
    if getattr(args, "uds", None):
        return None
    host = str(getattr(args, "host", None) or "")
    if host in WILDCARDS:
        host = (host_ip or import_vllm("vllm.utils.network_utils").get_ip)()
    scheme = "https" if getattr(args, "ssl_keyfile", None) and args.ssl_certfile else "http"
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{int(args.port)}"


def export_url(args: Namespace) -> None:
    """Set :data:`API_URL_ENV` (an operator's value is kept) and, with ``--api-key``,
    :data:`API_KEY_ENV` for the engine core about to start."""
    url = advertised_url(args)
    if url is not None and not os.environ.get(API_URL_ENV):
        os.environ[API_URL_ENV] = url
    keys = getattr(args, "api_key", None) or []
    if keys and keys[0]:
        os.environ[API_KEY_ENV] = str(keys[0])
