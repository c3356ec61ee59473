"""A minority engine's late arrivals: requests that reached its engine core after its fault
(sent before its API server learned it is DEAD; then ``api_server/dead_rank.py`` refuses
new ones) wait in the input queue, which the busy loop, parked in vLLM's fault wrapper, no
longer reads. Each is ended at once with ``abort`` and the partition's reason; nothing is
handed to a survivor (across a cut there is none to reach). Everything else there (aborts,
utility calls) goes back, in order."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ftengine.integrations.vllm.engine_core.handoff import drain_added, emit

logger = logging.getLogger(__name__)

POLL_S = 0.2


def refuse_late_arrivals(engine: Any, reason: str, until: float, stopped: threading.Event) -> int:
    """Until ``until`` (``time.monotonic``) or ``stopped``: abort every request added to
    ``engine``'s input queue with ``reason``; how many were."""

    def arrived(request: Any) -> None:
        emit(engine, request, [], "abort", reason)
        logger.warning("[FT] request %s reached a minority engine: %s", request.request_id, reason)

    return drain_added(engine, arrived, until, stopped, POLL_S)


def start_refusing(engine: Any, reason: str, seconds: float) -> threading.Event:
    """:func:`refuse_late_arrivals` on its own thread for ``seconds``; set the returned
    event to stop it sooner."""
    stopped = threading.Event()
    threading.Thread(
        target=refuse_late_arrivals,
        args=(engine, reason, time.monotonic() + seconds, stopped),
        name="ftengine-minority",
        daemon=True,
    ).start()
    return stopped
