"""A DEAD rank's API server tells the truth: ``/health`` says 503, and a request it would
accept and then abort is refused with 503, vLLM's error object and ``Retry-After``.

Under vLLM's fault tolerance a rank whose worker died keeps its API server (and its
engine core, DEAD) until ``engine_recovery_timeout_sec``; vLLM's ``/health`` still answers
200 (it asks only whether the engine-core client is errored) and a new completion is
queued to an engine core that will never run it. ASGI middleware in front of vLLM's routes
reads the engines' FT statuses that vLLM's client caches (``EngineClient.get_status``, no
round trip) and, once every engine this server feeds is ``dead``:

- ``GET /health`` (and SageMaker's ``/ping``) answer 503, so a load balancer's health check
  takes the rank out; an ``unhealthy`` engine (recovering: its requests queue and resume)
  stays 200, else a fault of one rank, which makes every DP peer ``unhealthy`` for a
  moment, would take the whole deployment out of the balancer;
- any other request that is not a read (``GET`` / ``HEAD``) and not for the FT routes
  (``/fault_tolerance/...``, which the orchestrator still needs) answers 503 with
  ``Retry-After`` and vLLM's ``{"error": {...}}``: retried through the load balancer, it
  reaches a survivor.

Requests already held when the engine died are handed to a survivor by the engine core
(``engine_core/handoff.py``), not refused here.

When the engine core process itself exits (killed, crashed), vLLM's engine-core monitor
marks its client errored, but the FT statuses the engine core pushed stay cached, ``healthy``
included: the guard then answers ``GET /fault_tolerance/status`` itself, every engine
``dead`` saying why, so an orchestrator never reads a stale ``healthy`` from a rank with no
engine.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ftengine.integrations.vllm.engine_core.rejoin import REJOINING_PHASES

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

RETRY_AFTER_S = 1
"""Seconds a refused client waits before asking again (through the load balancer, which
``/health`` has steered to a survivor by then)."""
HEALTH_PATHS = ("/health", "/ping")
OPEN_PREFIXES = ("/fault_tolerance/",)
READS = ("GET", "HEAD")


STATUS_PATH = "/fault_tolerance/status"
ENGINE_GONE = (
    "the engine core process exited (vLLM's client is errored): this rank serves nothing "
    "until its server is restarted"
)


def all_dead(status: object) -> bool:
    """Whether vLLM's ``get_status()`` answer (``{"engines": [{"status": ...}, ...]}``)
    names engines and every one is ``dead``, or a restarted rank's not yet admitted (its
    phase is ``loading``, ``ready`` or ``joining``): either way this server serves nothing."""
    engines = status.get("engines") if isinstance(status, dict) else None
    if not isinstance(engines, list) or not engines:
        return False
    return all(
        isinstance(e, dict) and (e.get("status") == "dead" or e.get("phase") in REJOINING_PHASES)
        for e in engines
    )


def dead_reasons(status: object) -> list[str]:
    """The ``fault_info`` of each engine in vLLM's ``get_status()`` answer that has one."""
    engines = status.get("engines") if isinstance(status, dict) else None
    if not isinstance(engines, list):
        return []
    return [str(e["fault_info"]) for e in engines if isinstance(e, dict) and e.get("fault_info")]


def refused_body(message: str) -> bytes:
    """vLLM's error object (``ErrorResponse``) for a 503."""
    error = {"message": message, "type": "ServiceUnavailableError", "param": None, "code": 503}
    return json.dumps({"error": error}).encode()


class DeadRankGuard:
    """ASGI middleware: what a server whose engines are all DEAD answers (module doc)."""

    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        status = await self._status(scope) if scope.get("type") == "http" else None
        reasons = dead_reasons(status) if status is not None and all_dead(status) else None
        if reasons is None:
            await self.app(scope, receive, send)
            return
        path, method = str(scope.get("path", "")), str(scope.get("method", "GET"))
        if path in HEALTH_PATHS:
            await _answer(send, b"", [])
        elif path == STATUS_PATH and method == "GET" and status is not None:
            body = json.dumps(status).encode()  # vLLM's route would answer its stale cache
            await _answer(send, body, [(b"content-type", b"application/json")], 200)
        elif method in READS or path.startswith(OPEN_PREFIXES):
            await self.app(scope, receive, send)
        else:
            why = (
                f"this rank's engine is DEAD ({'; '.join(reasons) or 'its worker process died'})"
                " and will not serve again, or it restarted and is not admitted yet; retry "
                "through the load balancer, which reaches a serving rank"
            )
            headers = [(b"content-type", b"application/json"),
                       (b"retry-after", str(RETRY_AFTER_S).encode())]  # fmt: skip
            await _answer(send, refused_body(why), headers)

    async def _status(self, scope: Scope) -> dict[str, Any] | None:
        """vLLM's ``get_status()`` answer (None when it has none), every engine ``dead``
        with the reason once vLLM's client is errored (:func:`engine_gone`)."""
        app = scope.get("app")
        client = getattr(getattr(app, "state", None), "engine_client", None)
        get_status = getattr(client, "get_status", None)
        if get_status is None:
            return None
        try:
            status = await get_status()
        except Exception:  # a status that cannot be read is vLLM's to report, not ours
            logger.debug("[FT] could not read the engines' status", exc_info=True)
            return None
        if not isinstance(status, dict):
            return None
        return engine_gone(status) if getattr(client, "errored", False) is True else status


def engine_gone(status: dict[str, Any]) -> dict[str, Any]:
    """``status`` once vLLM's client is errored (its engine core process exited: vLLM's
    engine-core monitor saw it; the statuses the engine core pushed stay in the client's
    cache, ``healthy`` included): every engine ``dead``, phase ``dead``, saying why."""
    engines = status.get("engines")
    listed = engines if isinstance(engines, list) else []
    dead = [
        {**engine, "status": "dead", "phase": "dead", "fault_info": ENGINE_GONE}
        for engine in listed
        if isinstance(engine, dict)
    ]
    return {**status, "engines": dead}


async def _answer(
    send: Send, body: bytes, headers: list[tuple[bytes, bytes]], code: int = 503
) -> None:
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": code, "headers": headers})
    await send({"type": "http.response.body", "body": body})
