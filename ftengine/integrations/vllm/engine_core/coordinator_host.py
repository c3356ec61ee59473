"""The DP coordinator's host stays up after its own worker dies.

In vLLM's external-LB (and hybrid-LB) mode the API server of DP rank 0 runs the DP
coordinator, the process that starts every engine's next wave of a MoE deployment: an idle
engine only joins a wave (and its all-reduce) when the coordinator tells it one began. When
rank 0's *worker* dies, its engine core is DEAD and vLLM's ``fault_tolerant_wrapper`` waits
``engine_recovery_timeout_sec`` for a recovery that cannot come, then re-raises: the engine
core exits, its API server shuts down with it, and so does the coordinator. After a
``scale_down`` past rank 0 one survivor needs no coordinator, but two or more would stop
waking each other: a request to one of them would wait in a wave the others never join.

So a DEAD engine that hosts the coordinator waits with no deadline (``parking.py``): it
stays parked, answering ``dead`` and refusing every command with vLLM's wording, until the
deployment is stopped (SIGTERM interrupts the wait; vLLM's engine-core signal handler then
exits as usual) or, when its worker died, until it has relaunched that worker in place and
comes back as a returning rank (``relaunch.py``).
Its held requests were already handed to a survivor (or aborted with the reason) when it went
DEAD (``reinference.py``, ``handoff.py``).
A transient fault (UNHEALTHY) keeps vLLM's deadline.
"""

from __future__ import annotations

import logging
from typing import Any

from ftengine.integrations.vllm.engine_core.parking import WAIT_SOURCE, park
from ftengine.integrations.vllm.messages import import_vllm

logger = logging.getLogger(__name__)

ENGINE_MODULE = "vllm.v1.engine"


def hosts_coordinator(parallel_config: Any) -> bool:
    """Whether this engine's API server runs the DP coordinator (vLLM's
    ``launch_core_engines``: DP rank 0 of an online DP deployment); only in external or
    hybrid LB does that server serve this engine alone, so only there does its engine core
    outlive its peers' needs."""
    return (
        int(parallel_config.data_parallel_size) > 1
        and int(parallel_config.data_parallel_rank) == 0
        and bool(parallel_config.local_engines_only)
    )


def park_if_coordinator_host(sentinel: Any) -> bool:
    """After ``on_fault``: when ``sentinel``'s engine is DEAD and hosts the coordinator,
    lift its recovery deadline (``parking.py``); True if parked."""
    dead = import_vllm(ENGINE_MODULE).EngineStatusType.DEAD
    if sentinel.status_type != dead or not hosts_coordinator(sentinel.parallel_config):
        return False
    if not park(sentinel):
        logger.warning(
            "[FT] Engine %d hosts the DP coordinator, but vLLM's fault_tolerant_wrapper no "
            "longer waits with %r: it will exit at its recovery deadline as vLLM decides.",
            sentinel.engine_index, WAIT_SOURCE,
        )  # fmt: skip
        return False
    logger.warning(
        "[FT] Engine %d is DEAD but its API server runs the DP coordinator the survivors "
        "need: it stays up (answering dead) until the deployment is stopped.",
        sentinel.engine_index,
    )
    return True
