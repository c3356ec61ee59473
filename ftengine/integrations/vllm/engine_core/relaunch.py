"""An engine core relaunches its worker in place and comes back without a restart of its
server: DP rank 0 whose worker died (issue 28), and a partition's minority once the link
heals (``minority.py``).

Rank 0's API server runs the DP coordinator and answers restarted ranks' start-up
handshakes: it cannot be restarted while the survivors serve. When only its worker died, its
engine core is parked DEAD (``coordinator_host.py``), its held requests handed to a survivor.
That engine core then relaunches its worker in place (:func:`relaunch`, on a thread of its
own while the busy loop stays parked):

1. the old worker's processes are gone (their memory freed: a live one, a minority's, is
   shut down first) and the handoff's watch for late arrivals stops;
2. a new executor of vLLM's class starts new worker processes, alone as a restarted rank's
   start (``rejoin_flag``: the worker's FSM goes loading -> ready): they load the weights
   from disk, allocate KV caches at least as large as the scheduler was built for (checked:
   the free memory measured again may differ by a few blocks) and warm up; the scheduler's
   prefix cache is reset (the cached blocks died with the old worker);
3. the engine core becomes a returning rank: a DP group of its own, no DP store, no wave to
   lead, its agent's view of the peers and of the fault forgotten; the dead executor's
   ``EXECUTOR_FAILED`` notice is dropped from the input queue (a request still there is
   ended with the reason: nothing may run before the admission); status ``unhealthy``,
   phase ``ready``; the busy loop resumes;
4. it announces itself on the survivors' DP store (read from the survivors' servers, at the
   URLs its DP board last read) and joins once admitted (``admission.join``): by their
   policy under ``auto``, by ``scale_up`` otherwise, as any restarted rank.

Its API server and the DP coordinator stay up throughout. While it loads, its status is
``dead`` with phase ``loading``; a relaunch that fails leaves it parked DEAD with the reason
in ``fault_info``.
"""

from __future__ import annotations

import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ftengine.integrations.vllm.engine_core import announce
from ftengine.integrations.vllm.engine_core.admission import AGENT_ATTR
from ftengine.integrations.vllm.engine_core.rejoin import start_alone
from ftengine.integrations.vllm.engine_core.relaunch_state import (
    FAILED,
    FAILED_WORDS,
    LOADING,
    RELAUNCH_ATTR,
    Relaunch,
)
from ftengine.integrations.vllm.engine_core.scale_down import (
    REMOVED_ATTR,
    STORE_ATTR,
    WAVE_LEAD_ATTR,
)
from ftengine.integrations.vllm.messages import import_vllm
from ftengine.integrations.vllm.patches.mechanism import Patch, VllmSeamMoved, unchanged
from ftengine.integrations.vllm.rejoin_flag import REJOIN_KEY

logger = logging.getLogger(__name__)

EXIT_WAIT_S = 60.0  # the dead worker's processes must be gone (memory freed) by then
ENGINE_MODULE = "vllm.v1.engine"
SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"


SEAMS = (
    Patch("vllm.v1.engine.core", "EngineCore", "_initialize_kv_caches", ("vllm_config",),
          unchanged),
    Patch("vllm.v1.executor.multiproc_executor", "MultiprocExecutor", "__init__",
          ("vllm_config", "monitor_workers"), unchanged),
    Patch("vllm.v1.executor.abstract", "Executor", "register_failure_callback", ("callback",),
          unchanged),
    Patch("vllm.v1.executor.multiproc_executor", "MultiprocExecutor", "shutdown", (),
          unchanged),
    Patch(SCHEDULER_MODULE, "Scheduler", "reset_prefix_cache",
          ("reset_running_requests", "reset_connector"), unchanged),
)  # fmt: skip
"""vLLM names a relaunch calls but never replaces (checked before it starts, and by a test)."""
REQUEST_TYPES = ("ADD", "EXECUTOR_FAILED")
"""``EngineCoreRequestType`` members the input queue is sorted by."""


def check_seams() -> None:
    """Raise :class:`VllmSeamMoved` unless every vLLM name a relaunch uses is as expected."""
    for seam in SEAMS:
        seam.target()
    types = import_vllm(ENGINE_MODULE).EngineCoreRequestType
    scheduler = import_vllm(SCHEDULER_MODULE).Scheduler
    missing = [f"EngineCoreRequestType.{n}" for n in REQUEST_TYPES if not hasattr(types, n)]
    if "self.kv_cache_config =" not in inspect.getsource(scheduler.__init__):
        missing.append("Scheduler.kv_cache_config")
    if missing:
        raise VllmSeamMoved(
            f"expected {', '.join(missing)} in the installed vLLM: ftengine's in-place "
            "relaunch needs updating"
        )


class RelaunchFailed(RuntimeError):
    """The relaunched worker cannot replace the dead one (the reason says why)."""


def start_relaunch(sentinel: Any) -> threading.Thread | None:
    """After the patched ``on_fault`` parked a DEAD coordinator host whose worker died: its
    :func:`relaunch`, started (None when there is no worker to relaunch, no agent, or a
    relaunch under way)."""
    engine = sentinel.engine
    state = getattr(sentinel, RELAUNCH_ATTR, None)
    if getattr(sentinel, AGENT_ATTR, None) is None or not getattr(
        engine.model_executor, "is_failed", False
    ):
        return None
    if isinstance(state, Relaunch) and state.phase == LOADING:
        return None
    rank = sentinel.engine_index
    setattr(sentinel, RELAUNCH_ATTR, Relaunch(LOADING, (
        f"engine {rank}'s worker process died; its engine core relaunches it in place (its "
        "API server runs the DP coordinator) and rejoins once the survivors admit it"
    )))  # fmt: skip
    return start_thread(sentinel, f"engine {rank}'s worker process died")


def start_thread(sentinel: Any, cause: str) -> threading.Thread:
    """:func:`relaunch` on a thread of its own (the status already says why, phase loading)."""
    thread = threading.Thread(
        target=relaunch, args=(sentinel, cause), name="ftengine-relaunch", daemon=True
    )
    thread.start()
    return thread


def relaunch(sentinel: Any, cause: str) -> bool:
    """Relaunch the worker, then make the engine core a returning rank (module doc); True
    once the busy loop resumed, False (parked DEAD, ``cause`` and the reason in its status)
    on failure."""
    engine = sentinel.engine
    parallel = engine.vllm_config.parallel_config
    rank, started = sentinel.engine_index, time.monotonic()
    sentinel._push_status()  # dead, phase loading
    dead = engine.model_executor
    logger.warning("[FT] engine %d: relaunching its worker in place (%s)", rank, cause)
    try:
        check_seams()
        if not getattr(dead, "is_failed", False):
            dead.shutdown()  # alive (a minority's): its DP and EP groups are the old ones
        await_exit(dead, EXIT_WAIT_S)
        stop_late_arrivals(sentinel)
        setattr(parallel, REJOIN_KEY, 1)  # pickled with the config: the worker starts alone
        start_worker(engine, type(dead))
    except Exception as exc:
        setattr(parallel, REJOIN_KEY, 0)
        new, engine.model_executor = engine.model_executor, dead
        if new is not dead:
            new.shutdown()
        setattr(sentinel, RELAUNCH_ATTR, Relaunch(FAILED, (
            f"{cause} and {FAILED_WORDS}: "
            f"{type(exc).__name__}: {exc}"
        )))  # fmt: skip
        logger.exception("[FT] engine %d: relaunching its worker failed", rank)
        sentinel._push_status()
        return False
    returning(sentinel)
    logger.info(
        "[FT] engine %d: worker relaunched in %.1f s; ready, waiting to be admitted",
        rank, time.monotonic() - started,
    )  # fmt: skip
    return True


def await_exit(executor: Any, timeout_s: float) -> None:
    """Wait until every worker process of the dead ``executor`` has exited."""
    deadline = time.monotonic() + timeout_s
    for handle in getattr(executor, "workers", None) or ():
        proc = getattr(handle, "proc", None)
        if proc is not None:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                raise RelaunchFailed(
                    f"the dead worker's process {proc.pid} has not exited after {timeout_s:.0f} s"
                )


def stop_late_arrivals(sentinel: Any) -> None:
    """End the handoff's watch for requests that reach the DEAD engine (it puts back what
    it took that was no request); a later DEAD fault starts a new one."""
    from ftengine.integrations.vllm.engine_core.handoff import HANDOFF_ATTR

    handoff = getattr(sentinel, HANDOFF_ATTR, None)
    if handoff is None or handoff.late is None:
        return
    handoff.stopped.set()
    handoff.late.join()
    handoff.late, handoff.stopped = None, threading.Event()


def start_worker(engine: Any, executor_class: Callable[[Any], Any]) -> None:
    """A new executor for ``engine`` (vLLM's ``EngineCore.__init__`` steps: its failure
    noticed on the input queue, KV caches sized and allocated, warm-up), exactly as many KV
    cache blocks as the scheduler's (vLLM's ``num_gpu_blocks_override`` while they are
    sized: the free memory measured again differs by a block now and then, and one block
    short failed a relaunch in the 60-fault campaign on hosts), the scheduler's prefix
    cache emptied."""
    request_types = import_vllm(ENGINE_MODULE).EngineCoreRequestType
    executor = executor_class(engine.vllm_config)
    engine.model_executor = executor
    executor.register_failure_callback(
        lambda: engine.input_queue.put_nowait((request_types.EXECUTOR_FAILED, b""))
    )
    before = int(engine.scheduler.kv_cache_config.num_blocks)
    cache = engine.vllm_config.cache_config
    override, cache.num_gpu_blocks_override = cache.num_gpu_blocks_override, before
    try:
        after = int(engine._initialize_kv_caches(engine.vllm_config).num_blocks)
    finally:
        cache.num_gpu_blocks_override = override  # the operator's, as it was
    cache.num_gpu_blocks = before  # what the scheduler hands out
    if after < before:  # more is harmless: the scheduler never names a block past its own
        raise RelaunchFailed(
            f"the relaunched worker has {after} KV cache blocks, fewer than the {before} the "
            "scheduler was built for"
        )
    if not engine.scheduler.reset_prefix_cache():
        raise RelaunchFailed("the scheduler's prefix cache could not be reset")


def returning(sentinel: Any) -> None:
    """The engine core as a restarted rank's is before its admission (module doc, 3-4)."""
    engine = sentinel.engine
    parallel = engine.vllm_config.parallel_config
    start_alone(engine, parallel)
    setattr(engine, WAVE_LEAD_ATTR, int(parallel.data_parallel_size))  # no member's: no lead
    engine.step_counter, engine.engines_running = 0, False
    setattr(sentinel, STORE_ATTR, None)
    setattr(sentinel, REMOVED_ATTR, frozenset())
    urls = getattr(sentinel, AGENT_ATTR).start_over()
    end_queued(sentinel)
    sentinel.status_type = import_vllm(ENGINE_MODULE).EngineStatusType.HEALTHY
    sentinel.fault_info = None
    setattr(sentinel, RELAUNCH_ATTR, None)
    sentinel._push_status()  # unhealthy, phase ready (rejoin.rejoin_status)
    sentinel.resumed.set()
    announce.start_announcing(sentinel, urls)


def end_queued(sentinel: Any) -> None:
    """Drop the dead executor's ``EXECUTOR_FAILED`` notices from the input queue and end
    each request still there with the reason (this rank runs nothing before its admission);
    everything else goes back, in order."""
    from ftengine.integrations.vllm.engine_core.handoff import emit

    engine = sentinel.engine
    types = import_vllm(ENGINE_MODULE).EngineCoreRequestType
    kept: list[Any] = []
    while True:
        try:
            item = engine.input_queue.get_nowait()
        except queue.Empty:
            break
        request_type, payload = item
        if request_type == types.EXECUTOR_FAILED:
            continue
        if request_type == types.ADD:
            reason = (
                f"engine {sentinel.engine_index} relaunched its worker and is rejoining; it "
                "serves again once the survivors admit it: send the request to another rank"
            )
            emit(engine, payload[0], [], "abort", reason)
            continue
        kept.append(item)
    for item in kept:
        engine.input_queue.put_nowait(item)
