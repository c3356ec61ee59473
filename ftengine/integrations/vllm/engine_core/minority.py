"""A partition's minority engine: it sits the partition out and rejoins once the link heals.

- **Parked** (:func:`park_if_cut_off`): an engine cut off from the majority
  (``agent.fenced``) has its recovery deadline lifted (``parking.py``), as the DP
  coordinator's host has: vLLM's wrapper would otherwise end its engine core, and its API
  server with it, ``engine_recovery_timeout_sec`` after the fault. The patched ``on_fault``
  parks an engine that faults cut off (the usual order: the 3 s silence comes before a
  step's collective times out); the agent parks one that learnt it was cut off only after
  its fault, as it gives up. Giving up: DEAD naming the partition, what it held ended with
  that reason, new requests 503 at its API server; then the engine waits.
- **Late arrivals** (:func:`start_refusing`): requests that reached its engine core after its
  fault (sent before its API server learned it is DEAD) wait in the input queue, which the
  parked busy loop no longer reads. Each is ended at once with ``abort`` and the partition's
  reason; nothing is handed to a survivor (across a cut there is none to reach). Everything
  else there (aborts, utility calls) goes back, in order.
- **Heal** (:func:`await_heal`, the agent's watch thread): its probes kept running; once this
  engine reaches a majority of the live ranks again (the same rule that stopped it,
  ``quorum.keeps_serving``), it relaunches its worker in place (the old one still belongs to
  the DP and EP groups the majority rebuilt without it) and comes back as a returning rank,
  announcing itself on the survivors' DP store (``relaunch.py``): admitted by their policy
  under ``auto``, by ``scale_up`` otherwise. Its API server and the majority are never
  restarted.

Where vLLM's wrapper no longer waits on the sentinel's ``resumed`` (a vLLM this was not built
for) nothing is parked: the engine stops as before, its server exits at vLLM's deadline, and
an operator restarts it (its fault_info then lacks ``quorum.HEALS``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ftengine.integrations.vllm.engine_core.handoff import drain_added, emit
from ftengine.integrations.vllm.engine_core.parking import park
from ftengine.integrations.vllm.engine_core.quorum import keeps_serving
from ftengine.integrations.vllm.engine_core.relaunch import start_thread
from ftengine.integrations.vllm.engine_core.relaunch_state import (
    LOADING,
    RELAUNCH_ATTR,
    Relaunch,
)

logger = logging.getLogger(__name__)

POLL_S = 0.2
PARKED, WAITING, REJOINING = "parked", "waiting for the link", "rejoining"
"""``agent.cut_off``: parked at its fault, stopped (DEAD) until the link heals, relaunching."""


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


def park_if_cut_off(sentinel: Any, agent: Any) -> bool:
    """When ``agent``'s engine is on a minority side and not parked yet: lift its recovery
    deadline and mark it :data:`PARKED`; True if parked (the patched ``on_fault``, and the
    agent as it gives up)."""
    if agent.fenced is None or agent.cut_off is not None:
        return False
    if not park(sentinel):
        logger.warning(
            "[FT] engine %d is cut off, but vLLM's fault_tolerant_wrapper no longer waits on "
            "its sentinel's resumed event: it will exit at the deadline, not rejoin by itself",
            agent.rank,
        )
        return False
    agent.cut_off = PARKED
    logger.warning(
        "[FT] engine %d is cut off from the majority: it stops and waits for the link",
        agent.rank,
    )
    return True


def await_heal(agent: Any) -> None:
    """One look (the watch thread) for a :data:`WAITING` engine: once it reaches a majority
    of the live ranks again, relaunch its worker and rejoin (module doc)."""
    if agent.cut_off != WAITING or not keeps_serving(agent.sight()):
        return
    agent.cut_off = REJOINING
    sentinel, rank = agent.sentinel, agent.rank
    logger.warning("[FT] engine %d reaches a majority again: the link healed, rejoining", rank)
    setattr(sentinel, RELAUNCH_ATTR, Relaunch(LOADING, (
        f"engine {rank} was cut off by a network partition and the link healed; its engine "
        "core relaunches its worker in place and rejoins once the survivors admit it"
    )))  # fmt: skip
    start_thread(sentinel, f"engine {rank} was cut off by a network partition")
