"""An engine whose worker dies while it recovers goes DEAD as one dying in its busy loop does.

vLLM makes an engine DEAD only from its busy loop's next fault (``on_fault`` sees the
executor failed); an engine that is recovering (parked UNHEALTHY in vLLM's wait, or running
a command that then fails) never reaches it, and would wait out its recovery deadline
holding its requests while its status (``agent.status_fields``) already says ``dead``. The
chaos campaign found two streams lost that way: a worker SIGKILLed during a ``retry``, its
requests held until the server was restarted under them. :func:`went_dead` does what the
patched ``on_fault`` does for a DEAD engine: the status DEAD with the reason, what it held
handed to a survivor (or aborted with the reason), DP rank 0 parked for its relaunch in
place, the status pushed. The agent calls it once the executor reads failed, when neither
``on_fault`` nor a command is running (``EngineCoreAgent.settle_late_death``).
"""

from __future__ import annotations

import logging
from typing import Any

from ftengine.integrations.vllm.engine_core.coordinator_host import (
    ENGINE_MODULE,
    park_if_coordinator_host,
)
from ftengine.integrations.vllm.messages import import_vllm

logger = logging.getLogger(__name__)


def went_dead(sentinel: Any, why: str) -> None:
    """Make ``sentinel``'s parked UNHEALTHY engine DEAD because ``why`` (its worker died)."""
    from ftengine.integrations.vllm.engine_core.reinference import release_dead
    from ftengine.integrations.vllm.engine_core.relaunch import start_relaunch

    sentinel.status_type = import_vllm(ENGINE_MODULE).EngineStatusType.DEAD
    sentinel.fault_info = why
    logger.warning("[FT] Engine %d status -> DEAD: %s", sentinel.engine_index, why)
    release_dead(sentinel, why)
    if park_if_coordinator_host(sentinel):  # DEAD rank 0 keeps the DP coordinator up
        start_relaunch(sentinel)
    sentinel._push_status()
