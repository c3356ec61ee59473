"""A partition's minority engine: it sits the partition out and rejoins once the link heals.

- **Parked** (:func:`park_if_cut_off`, from the patched ``on_fault``): an engine that faults
  cut off from the majority (``agent.fenced``) has its recovery deadline dropped, as the DP
  coordinator's host is (``coordinator_host.py``): vLLM's wrapper would otherwise end its
  engine core, and its API server with it, ``engine_recovery_timeout_sec`` later. The agent
  then gives up at once (DEAD naming the partition, what it held ended with that reason, new
  requests 503 at its API server) and the engine waits.
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

An engine that learnt it was cut off only after its fault (vLLM's wrapper already waits with
the deadline) still stops, but keeps vLLM's deadline: its server exits then, and an operator
restarts it (docs/design-partitions.md).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ftengine.integrations.vllm.engine_core.coordinator_host import (
    DEADLINE_ATTR,
    wait_seam_present,
)
from ftengine.integrations.vllm.engine_core.handoff import drain_added, emit
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
    """After ``on_fault`` (busy-loop thread, before vLLM's wrapper reads the deadline): when
    ``agent``'s engine faulted on a minority side, drop its recovery deadline and mark it
    :data:`PARKED`; True if parked."""
    if agent.fenced is None or agent.cut_off is not None:
        return False
    if not wait_seam_present():
        logger.warning(
            "[FT] engine %d is cut off, but vLLM's fault_tolerant_wrapper no longer reads its "
            "deadline at each wait: it will exit at the deadline, not rejoin by itself",
            agent.rank,
        )
        return False
    setattr(sentinel, DEADLINE_ATTR, None)
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
