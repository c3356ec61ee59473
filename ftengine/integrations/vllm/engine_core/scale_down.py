"""``scale_down`` through vLLM's own fault-tolerance path (vLLM 0.32 accepts only ``retry``).

- **Router** (each API server, ``api_server/scale_down_payload.py``): ``scale_down`` joins
  ``_ALLOWED_INSTRUCTIONS``, and its ``params`` are checked there for shape
  (``{"removed_dp_ranks": [int, ...]}``): a malformed command is a 400 with vLLM's error
  object, as vLLM answers a malformed ``retry``.
- **Engine core** (``EngineCoreSentinel.scale_down``, reached by vLLM's own ``run_method``
  dispatch after its "status is DEAD / HEALTHY" check): every precondition ftengine's engine
  checks (original ranks, cumulative, not all, not itself, a newly dead rank), then the DP
  group rebuilt among the survivors with a fresh epoch (ports through vLLM's DP store under
  its epoch-numbered keys, published by the lowest survivor), then the command relayed to
  the workers with the ports (their FSM masks, rebuilds, re-hosts experts, runs a dummy
  batch), then HEALTHY. A refused command answers ``FaultToleranceResult(success=False,
  reason)`` (vLLM's client puts it in ``ft_error``); a survivor lost while the new DP group
  forms leaves the engine UNHEALTHY (its workers untouched, its requests still held) for a
  ``scale_down`` naming that rank too; so does a failure after that (the workers' rebuild)
  while every worker lives with its FSM back in quarantine (its policy's attempts left);
  otherwise (a worker gone, or out of attempts) the engine is DEAD with the reason there.

DP rank 0 in external-LB mode: its engine core leads the DP wave (``DPEngineCoreProc`` sends
"wave complete" / "wave started" to the DP coordinator only where ``dp_rank == 0``), its
engine core hosts the DP store and its API server runs the DP coordinator. When only rank
0's *worker* dies, its engine core (DEAD, waiting for a command) still serves the store the
survivors publish their new ports on, and its API server still runs the coordinator. So a
scale-down that removes rank 0 gives the wave lead to the lowest survivor (``dp_rank`` becomes
each survivor's dense rank; vLLM reads it for nothing else) and the new DP group's store is
hosted by that survivor. The coordinator lives as long as rank 0's API server, which vLLM
would stop once rank 0's engine core gives up (``engine_recovery_timeout_sec`` after the
fault): ``coordinator_host.py`` keeps that DEAD engine core parked instead, so two or more
survivors keep waking each other for new waves.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import timedelta
from typing import Any

from ftengine.commands import REMOVED_KEY, parse_command, scale_down_problems
from ftengine.errors import CommandRejected
from ftengine.faults import Phase
from ftengine.integrations.vllm.engine_core.dp_group import ClosedDpGroup
from ftengine.integrations.vllm.engine_core.standby_store import (
    STORE_RANK_ATTR,
    connect,
    stand_in,
    store_rank,
)
from ftengine.integrations.vllm.messages import DP_HOST_KEY, DP_PORTS_KEY, import_vllm
from ftengine.integrations.vllm.rendezvous import await_store, store_host

logger = logging.getLogger(__name__)

INSTRUCTION = "scale_down"
REMOVED_ATTR = "_ftengine_removed_dp_ranks"
"""On ``EngineCoreSentinel``: the original DP ranks removed so far (cumulative)."""
EPOCH_ATTR = "_dp_reinit_epoch"
AGENT_ATTR = "_ftengine_agent"
"""On ``EngineCoreSentinel``: ftengine's ``EngineCoreAgent`` (``patches/engine_core.py``)."""
STORE_ATTR = "_ftengine_dp_store"
"""On ``EngineCoreSentinel``: ``(host, port)`` of the DP store of ftengine's last rebuilt
group (a returning rank joins through it: ``engine_core/admission.py``)."""
UTILS_MODULE = "vllm.v1.fault_tolerance.utils"
ENGINE_MODULE = "vllm.v1.engine"
DISTRIBUTED_MODULE = "vllm.distributed"
NETWORK_MODULE = "vllm.utils.network_utils"
RENDEZVOUS_MIN_S = 30.0
"""The shortest wait of a DP group's rebuild for its members (:func:`rendezvous_timeout`)."""
WAVE_LEAD_ATTR = "dp_rank"
"""``DPEngineCoreProc.dp_rank``: read only to pick the DP rank that leads the wave (0)."""


class RendezvousFailed(RuntimeError):
    """The survivors' new DP group did not form (a member lost meanwhile); the workers were
    not told, so the engine may run the command again."""


def problems(sentinel: Any, params: dict[str, Any]) -> tuple[frozenset[int], list[str]]:
    """The cumulative removed set of a ``scale_down`` and every precondition it breaks."""
    parallel = sentinel.engine.vllm_config.parallel_config
    try:
        removed = parse_command(INSTRUCTION, params).removed
    except CommandRejected as exc:
        return frozenset(), [str(exc)]
    found = scale_down_problems(
        removed,
        rank=int(parallel.data_parallel_rank),
        world_size=int(parallel.data_parallel_size),
        already_removed=frozenset(getattr(sentinel, REMOVED_ATTR, frozenset())),
        # On CPU survivors grow their expert tensors: any survivor can host every expert.
        redundancy=None,
    )
    return removed, found


def scale_down(sentinel: Any, ft_request: Any) -> Any:
    """``EngineCoreSentinel.scale_down(ft_request)`` -> ``FaultToleranceResult``."""
    utils = import_vllm(UTILS_MODULE)
    rank = sentinel.engine_index
    removed, found = problems(sentinel, dict(ft_request.params))
    if found:
        reason = f"[FT] Rejecting {INSTRUCTION} on engine {rank}: " + "; ".join(found)
        logger.warning(reason)
        return utils.FaultToleranceResult(
            request_id=ft_request.request_id, success=False, reason=reason
        )
    try:
        run(sentinel, ft_request, removed)
    except Exception as exc:
        # A new DP group that did not form (the workers were not told), or the workers'
        # step failing once (a survivor lost during their rebuild) with their FSMs back in
        # quarantine within their policy's attempts: the engine stays UNHEALTHY, its held
        # requests held, for a scale_down naming the rank lost meanwhile (issue 30: no
        # terminal DEAD for a one-shot recovery error; vLLM's client puts the reason in
        # ft_error).
        if isinstance(exc, RendezvousFailed) or workers_wait_again(sentinel):
            reason = f"[FT] engine {rank}'s scale_down did not complete: {exc}"
            logger.warning("%s", reason)
            sentinel.fault_info = f"scale_down failed, may be sent again: {exc}"
            sentinel._push_status()
            return utils.FaultToleranceResult(
                request_id=ft_request.request_id, success=False, reason=reason
            )
        # Otherwise terminal (vLLM's client records the reason in ft_error from the failed
        # result that handle_command builds from this exception); what re-inference held
        # goes to a survivor now, as a dead worker's does (aborted with the reason where
        # none can take it), rather than waiting for the deadline.
        from ftengine.integrations.vllm.engine_core.reinference import release_dead

        sentinel.status_type = import_vllm(ENGINE_MODULE).EngineStatusType.DEAD
        release_dead(sentinel, f"engine {rank}'s scale_down failed: {exc}")
        sentinel._push_status()
        logger.exception("[FT] Engine %d: scale_down failed; status -> DEAD", rank)
        raise
    return utils.FaultToleranceResult(request_id=ft_request.request_id, success=True)


WAITING_PHASE = Phase.QUARANTINED.value
"""A worker FSM's phase between a failed recovery step and the next command."""


def workers_wait_again(sentinel: Any) -> bool:
    """Whether every worker of the engine lives and its FSM is back in quarantine after a
    failed command (its policy gave it another attempt; past its attempts it is DEAD)."""
    from ftengine.integrations.vllm.worker.adapter import worker_phase

    executor = sentinel.engine.model_executor
    if getattr(executor, "is_failed", False):
        return False
    try:
        phases = executor.collective_rpc(worker_phase, timeout=5.0)
    except Exception:  # a worker gone or hung: nothing to send the command to again
        logger.warning(
            "[FT] engine %d: its workers' phase could not be read", sentinel.engine_index
        )
        return False
    return bool(phases) and all(phase == WAITING_PHASE for phase in phases)


def run(sentinel: Any, ft_request: Any, removed: frozenset[int]) -> None:
    """Rebuild the engine's DP group among the survivors, relay to the workers, resume."""
    engine = sentinel.engine
    world = int(engine.vllm_config.parallel_config.data_parallel_size)
    alive = [r for r in range(world) if r not in removed]
    try:
        ft_request.params.update(reinit_dp_group(sentinel, alive))
    except Exception as exc:  # a survivor lost (or cut off) while the group forms
        raise RendezvousFailed(
            f"the survivors {alive} did not all meet in the new DP group ({type(exc).__name__}:"
            f" {exc}); send scale_down again naming every rank lost since"
        ) from exc
    ft_request.params[REMOVED_KEY] = sorted(removed)
    if hasattr(engine, WAVE_LEAD_ATTR):  # the lowest survivor leads the DP wave now
        setattr(engine, WAVE_LEAD_ATTR, alive.index(int(sentinel.engine_index)))
    if hasattr(engine, "step_counter"):
        engine.step_counter = 0  # the survivors' DP sync counts steps from here together
    engine.model_executor.collective_rpc("handle_ft_command", args=(ft_request,))
    setattr(sentinel, REMOVED_ATTR, removed)
    sentinel.status_type = import_vllm(ENGINE_MODULE).EngineStatusType.HEALTHY
    logger.info(
        "[FT] Engine %d status -> HEALTHY (removed DP ranks %s)",
        sentinel.engine_index,
        sorted(removed),
    )
    sentinel.resumed.set()
    sentinel._push_status()


def reinit_dp_group(
    sentinel: Any, alive: list[int], *, publisher: int | None = None, store: Any = None
) -> dict[str, Any]:
    """vLLM's ``_reinit_dp_group`` among ``alive`` (original DP ranks, ascending): the same
    epoch-numbered DP-store keys, published by ``publisher`` (default: the lowest of
    ``alive``) on ``store`` (default: this engine's DP store; a returning rank passes its
    client of the survivors'; a store whose host rank is not among ``alive`` is replaced by
    the lowest member's standby store: :func:`keys_store`); this engine joins the new group
    at its dense rank. The new group's stores run where its dense rank 0 runs, so that
    member publishes its host's address (:func:`store_host`) and every member meets there:
    vLLM's own rebuild meets at DP rank 0's address, which on many hosts is another host
    once rank 0 is gone. Returns the workers' params (their fresh ports and that host)."""
    engine = sentinel.engine
    if not hasattr(engine, "dp_group") or not hasattr(engine, "dp_store"):
        return {}
    timeout = rendezvous_timeout(sentinel)
    store = keys_store(sentinel, alive, timeout) if store is None else store
    parallel = engine.vllm_config.parallel_config
    epoch = int(getattr(sentinel, EPOCH_ATTR, 0))
    worker_key, engine_key = f"ft_worker_dp_ports_{epoch}", f"ft_engine_dp_port_{epoch}"
    host_key = f"ft_engine_dp_host_{epoch}"
    setattr(sentinel, EPOCH_ATTR, epoch + 1)
    rank = int(parallel.data_parallel_rank)
    dense = alive.index(rank)
    network = import_vllm(NETWORK_MODULE)
    store.set_timeout(timeout)  # vLLM's DP store waits 30 min for a key by default
    if dense == 0:  # first: the others wait for it before they connect
        host = store_host(str(parallel.data_parallel_master_ip), rank, network.get_ip)
        store.set(host_key, host.encode())
    if rank == (alive[0] if publisher is None else publisher):
        worker_ports = [network.get_open_port() for _ in range(parallel.world_size)]
        engine_port = network.get_open_port()
        store.set(worker_key, json.dumps(worker_ports).encode())
        store.set(engine_key, str(engine_port).encode())
    else:
        worker_ports = json.loads(store.get(worker_key).decode())
        engine_port = int(store.get(engine_key).decode())
    if dense != 0:
        host = store.get(host_key).decode()
    dist = import_vllm(DISTRIBUTED_MODULE)
    if engine.dp_group is not None:
        dist.stateless_destroy_torch_distributed_process_group(engine.dp_group)
        engine.dp_group = ClosedDpGroup(rank)  # destroyed: a rendezvous that fails leaves
        # the stand-in, which the next attempt's destroy accepts
    if dense != 0:  # no connect back-off: rank 0 makes the store after publishing the port
        await_store(host, engine_port, timeout)
    engine.dp_group, engine.dp_store = dist.stateless_init_torch_distributed_process_group(
        host, engine_port, dense, len(alive), backend="gloo", return_store=True, timeout=timeout
    )
    setattr(sentinel, STORE_ATTR, (host, engine_port))
    setattr(sentinel, STORE_RANK_ATTR, alive[0])  # its engine core hosts engine.dp_store now
    return {DP_PORTS_KEY: worker_ports, DP_HOST_KEY: host}


def keys_store(sentinel: Any, alive: list[int], timeout: timedelta) -> Any:
    """Where a rebuild among ``alive`` publishes its keys: this engine's DP store while
    the rank hosting it is a member; otherwise (that rank removed: its engine core may be
    lost with its host) a new client of the lowest member's standby store, which every
    member picks alike (``standby_store``)."""
    host = store_rank(sentinel)
    if host in alive:
        return sentinel.engine.dp_store
    agent = getattr(sentinel, AGENT_ATTR, None)
    standbys = agent.standbys() if agent is not None else {}
    rank = int(sentinel.engine.vllm_config.parallel_config.data_parallel_rank)
    lowest, address = stand_in(rank, alive, standbys)
    logger.info(
        "[FT] engine %d: DP rank %d, which hosts the DP store, is left out: the rebuild "
        "meets on DP rank %d's standby store %s:%d",
        *(rank, host, lowest, *address),
    )  # fmt: skip
    return connect(address, timeout.total_seconds())


def rendezvous_timeout(sentinel: Any) -> timedelta:
    """How long a rebuild of the DP group waits for a member: the per-op timeout (ftengine's
    ``cpu_distributed_timeout_sec``, else vLLM's ``--cpu-distributed-timeout-seconds``), at
    least :data:`RENDEZVOUS_MIN_S` (a survivor's command may wait for its own ``on_fault``
    first). Unbounded (vLLM's default is 30 minutes), a member lost while the group forms
    held the command, and vLLM's input thread with it, until the recovery deadline: the
    survivor died with the requests it held (the vLLM chaos campaign, a SIGKILL landing in
    a scale-down)."""
    settings = getattr(getattr(sentinel, AGENT_ATTR, None), "settings", None)
    seconds = getattr(settings, "cpu_distributed_timeout_s", None)
    if not seconds:
        flag = sentinel.engine.vllm_config.parallel_config.cpu_distributed_timeout
        seconds = flag.total_seconds() if isinstance(flag, timedelta) else 0.0
    return timedelta(seconds=max(float(seconds), RENDEZVOUS_MIN_S))


def reinit_for_retry(sentinel: Any) -> dict[str, Any]:
    """``EngineCoreSentinel._reinit_dp_group`` for ``retry``: :func:`reinit_dp_group` among
    the ranks not removed (every original rank until a scale-down removed some; vLLM's own
    would wait for the removed until its timeout). vLLM's keys and epoch counter, so the
    workers' retry (ftengine's FSM rebuilds among its alive ranks) gets the matching ports;
    unlike vLLM's own, a member waits for rank 0's store instead of backing off."""
    removed = frozenset(getattr(sentinel, REMOVED_ATTR, frozenset()))
    started = time.monotonic()
    world = int(sentinel.engine.vllm_config.parallel_config.data_parallel_size)
    params = reinit_dp_group(sentinel, [r for r in range(world) if r not in removed])
    logger.info(
        "[FT] engine %d: retry's DP group rebuilt (epoch %s) in %.3f s",
        *(sentinel.engine_index, getattr(sentinel, EPOCH_ATTR, "?"), time.monotonic() - started),
    )  # fmt: skip
    return params
