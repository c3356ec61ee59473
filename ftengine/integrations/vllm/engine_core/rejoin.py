"""A restarted DP rank's engine core starts alone (issue 28).

The start-up handshake told it that it rejoins (``rejoin_flag``: DP rank 0's server answered
its HELLO after start-up, ``api_server/rejoin_responder.py``). vLLM's
``DPEngineCoreProc._init_data_parallel`` would now join the original DP group on the start-up
DP ports with every original rank, which the survivors left long ago (their group is at a
later epoch, among the survivors only): it would wait for them until the group's timeout.
:func:`init_data_parallel` builds a DP group of this engine alone instead (a one-member gloo
group on a free local port: vLLM's ``_has_global_unfinished_reqs`` all-reduce and barrier run
on it unchanged) and no DP store (ftengine's agent then watches no peers: this engine is no
member until it is admitted). Its DP rank and size stay the original ones, as vLLM's wave
and request bookkeeping index by them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ftengine.integrations.vllm.logs import route_logs
from ftengine.integrations.vllm.messages import import_vllm
from ftengine.integrations.vllm.rejoin_flag import rejoining

logger = logging.getLogger(__name__)

DISTRIBUTED_UTILS = "vllm.distributed.utils"
NETWORK_MODULE = "vllm.utils.network_utils"
LOOPBACK = "127.0.0.1"


def init_data_parallel(
    engine: Any, vllm_config: Any, vllm_init: Callable[[Any, Any], None]
) -> None:
    """``DPEngineCoreProc._init_data_parallel``: vLLM's own unless this engine rejoins; then
    a DP group of this engine alone and no DP store."""
    parallel = vllm_config.parallel_config
    if not rejoining(parallel):
        vllm_init(engine, vllm_config)
        return
    route_logs()  # vLLM configured its handlers by now; its plugins (ours) load later
    engine.dp_rank = int(parallel.data_parallel_rank)
    engine.dp_size = int(parallel.data_parallel_size)
    start_alone(engine, parallel)
    logger.info(
        "[FT] Engine %d rejoins a running deployment: it starts alone (a DP group of its own) "
        "and waits to be admitted",
        engine.dp_rank,
    )


def start_alone(engine: Any, parallel: Any) -> None:
    """``engine``'s DP group: one of its own (a one-member gloo group on a free local port);
    no DP store."""
    port = import_vllm(NETWORK_MODULE).get_open_port()
    init = import_vllm(DISTRIBUTED_UTILS).stateless_init_torch_distributed_process_group
    engine.dp_group = init(
        LOOPBACK, port, 0, 1, backend="gloo", timeout=parallel.cpu_distributed_timeout
    )
    engine.dp_store = None


READY_PHASE = "ready"
"""The returning rank's phase once loaded and warmed up (``Phase.READY`` of the rejoin FSM)."""
REJOINING_PHASES = frozenset({"loading", READY_PHASE, "joining"})
"""The returning rank's phases before it is admitted: its server serves nothing yet."""


def rejoin_status(engine: Any) -> dict[str, object]:
    """ftengine's status fields of a rejoining engine not yet admitted: ``unhealthy`` (it
    serves nothing yet), phase ``ready`` (its engine core's start-up, weights and warm-up
    included, is done: the agent starts after it); DP rank 0 relaunching its worker in
    place: ``dead``, phase ``loading`` (``relaunch.py``); empty for any other engine."""
    from ftengine.integrations.vllm.engine_core.relaunch_state import relaunch_status

    relaunching = relaunch_status(engine)
    if relaunching or not rejoining(engine.vllm_config.parallel_config):
        return relaunching
    return {
        "status": "unhealthy",
        "phase": READY_PHASE,
        "fault_info": (
            f"DP rank {engine.vllm_config.parallel_config.data_parallel_rank} restarted and "
            "waits to be admitted (scale_up)"
        ),
    }
