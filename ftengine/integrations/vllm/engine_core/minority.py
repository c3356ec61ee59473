"""A minority engine's late arrivals: requests that reached its engine core after its fault
(sent before its API server learned it is DEAD; then ``api_server/dead_rank.py`` refuses
new ones) wait in the input queue, which the busy loop, parked in vLLM's fault wrapper, no
longer reads. Each is ended at once with ``abort`` and the partition's reason; nothing is
handed to a survivor (across a cut there is none to reach). Everything else there (aborts,
utility calls) goes back, in order."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from ftengine.integrations.vllm.engine_core.handoff import emit
from ftengine.integrations.vllm.messages import import_vllm

logger = logging.getLogger(__name__)

ENGINE_MODULE = "vllm.v1.engine"
POLL_S = 0.2


def refuse_late_arrivals(engine: Any, reason: str, until: float, stopped: threading.Event) -> int:
    """Until ``until`` (``time.monotonic``) or ``stopped``: abort every request added to
    ``engine``'s input queue with ``reason``; how many were."""
    add = import_vllm(ENGINE_MODULE).EngineCoreRequestType.ADD
    kept: list[Any] = []
    refused = 0
    while not stopped.is_set() and time.monotonic() < until:
        try:
            item = engine.input_queue.get(timeout=POLL_S)
        except queue.Empty:
            continue
        request_type, payload = item
        if request_type != add:
            kept.append(item)
            continue
        request = payload[0]  # (vllm.v1.request.Request, wave)
        emit(engine, request, [], "abort", reason)
        refused += 1
        logger.warning("[FT] request %s reached a minority engine: %s", request.request_id, reason)
    for item in kept:
        engine.input_queue.put_nowait(item)
    return refused


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
