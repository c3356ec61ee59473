"""The vLLM names ftengine replaces in vLLM's engine-core process (any platform ftengine
supports).

``EngineCoreSentinel.__init__`` starts ftengine's
:class:`~ftengine.integrations.vllm.engine_core.agent.EngineCoreAgent`, ``on_fault`` tells it
of the fault (and the worker's FSM, after vLLM's own status push), ``_push_status`` adds
ftengine's phase, epoch and removed ranks to the pushed status, ``handle_command`` (vLLM's
input thread) waits for ``on_fault`` after the agent's early ``unhealthy`` report, and
``EngineCoreProc._handle_client_request`` lets the agent's input-queue marker raise a peer
fault into the busy loop (vLLM's own fault path then runs); ``DPEngineCoreProc.add_request``
rings the members' wave bells when a wave begins with DP rank 0 removed
(``engine_core/wave_bell.py``). With re-inference on,
``Scheduler._handle_blocked_waiting_request`` and ``Scheduler.update_from_output`` run the
poison probe (``engine_core/poison.py``; vLLM's own otherwise). ``scale_down`` (vLLM 0.32 has
only ``retry``): ``EngineCoreSentinel.scale_down`` is added for vLLM's own dispatch
(``engine_core/scale_down.py``); ``EngineCoreSentinel._reinit_dp_group`` (``retry``'s
DP-group rebuild) is ftengine's: among the survivors once a scale-down removed ranks, and
without torch's connect back-off (``rendezvous.py``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from ftengine.integrations.vllm.engine_core.admission import ADMIT_MARK
from ftengine.integrations.vllm.engine_core.admission import AGENT_ATTR as AGENT_ATTR
from ftengine.integrations.vllm.engine_core.poison import noting_clean_steps, skipping_suspects
from ftengine.integrations.vllm.messages import import_vllm
from ftengine.integrations.vllm.patches.mechanism import (
    PATCHED_MARK,
    NewMethod,
    Patch,
    VllmSeamMoved,
    marked,
    replacing,
    unchanged,
)

CORE_MODULE = "vllm.v1.engine.core"
CORE_SENTINEL_MODULE = "vllm.v1.fault_tolerance.engine_core_sentinel"
ENGINE_MODULE = "vllm.v1.engine"
SERIAL_MODULE = "vllm.v1.serial_utils"


def _with_agent(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def init_then_agent(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        from ftengine.integrations.vllm.engine_core import parking
        from ftengine.integrations.vllm.engine_core.agent import start_agent

        parking.install(self)  # a recovery deadline ftengine can lift (DP rank 0, a minority)
        start_agent(self, AGENT_ATTR)
        agent = getattr(self, AGENT_ATTR, None)
        if agent is not None:  # with re-inference (the default), faults hold requests
            from ftengine.integrations.vllm.engine_core.reinference import install

            install(
                self,
                agent.settings,
                check_reinference_seams,
                last_read=lambda: dict(agent.board.api_urls),
            )

    setattr(init_then_agent, PATCHED_MARK, init)
    return init_then_agent


def _agent_on_fault(on_fault: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(on_fault)
    def agent_on_fault(self: Any, exc: BaseException) -> None:
        from ftengine.integrations.vllm.engine_core.admission import end_on_fault

        end_on_fault(self, exc)  # a scale_up not started yet: the recovery moves the store
        agent = getattr(self, AGENT_ATTR, None)
        if agent is not None:
            agent.note_fault(exc)
            # Before vLLM makes the engine UNHEALTHY: no recovery (the agent's, or a
            # command's) can have replaced the group yet, and closing is local, no I/O.
            agent.let_go_of_dp_group(exc)  # peers in its DP-state all-reduce fail at once
        # vLLM's (requests aborted, status pushed, with no delay of ours), or with
        # re-inference on the same with requests held (engine_core.reinference)
        from ftengine.integrations.vllm.engine_core.reinference import hold_or_abort

        try:
            hold_or_abort(self, exc, on_fault, getattr(agent, "peers", None))
            if agent is not None:
                from ftengine.integrations.vllm.engine_core.coordinator_host import (
                    park_if_coordinator_host,
                )

                if park_if_coordinator_host(self):  # DEAD rank 0 keeps the DP coordinator up
                    from ftengine.integrations.vllm.engine_core.relaunch import start_relaunch

                    start_relaunch(self)  # its worker died: a new one, then it rejoins
                else:
                    from ftengine.integrations.vllm.engine_core.minority import park_if_cut_off

                    park_if_cut_off(self, agent)  # cut off: it waits for the link, then rejoins
                agent.after_fault()
                self._push_status()  # the same status, now with the worker's ftengine phase
        finally:
            if agent is not None:  # held commands answer after that status, not before
                agent.release_commands()

    setattr(agent_on_fault, PATCHED_MARK, on_fault)
    return agent_on_fault


def push_status(self: Any) -> None:
    """``EngineCoreSentinel._push_status`` (vLLM 0.32's payload) plus ftengine's fields;
    first, on a DP store this engine core has not written on, its API server's URL
    (``engine_core/handoff.publish_url``)."""
    from ftengine.integrations.vllm.engine_core.handoff import publish_url

    publish_url(self)  # on a new DP store (start-up, retry, scale_down): peers find our server
    engine = import_vllm(ENGINE_MODULE)
    payload: dict[str, object] = {"id": self.engine_index, "status": self.status_type.name.lower()}
    if self.status_type == engine.EngineStatusType.UNHEALTHY:
        payload["fault_info"] = self.fault_info
    agent = getattr(self, AGENT_ATTR, None)
    if agent is not None:
        payload.update(agent.status_fields())
    if payload["status"] == "dead" and not payload.get("fault_info"):
        payload["fault_info"] = dead_reason(self)  # vLLM gives a DEAD engine none
    result = import_vllm(SERIAL_MODULE).UtilityResult(payload)
    output = engine.UtilityOutput(call_id=engine.FT_STATUS_CALL_ID, result=result)
    outputs = engine.EngineCoreOutputs(utility_output=output)
    outputs.engine_index = self.engine_index
    self.engine.output_queue.put_nowait((0, outputs))


def dead_reason(sentinel: Any) -> str:
    """Why an engine is DEAD, for its status (an orchestrator must not have to guess)."""
    from ftengine.integrations.vllm.engine_core.quorum import HEALS

    fault = sentinel.fault_info or "a fault"
    if HEALS in fault:  # a minority parked for the link (minority.py): it will recover
        return str(fault)
    if getattr(sentinel.engine.model_executor, "is_failed", False):
        return f"{fault}: engine {sentinel.engine_index}'s worker process died"
    return f"{fault}: engine {sentinel.engine_index} cannot recover"


def _with_fault_marker(handle: Callable[..., None]) -> Callable[..., None]:
    from ftengine.integrations.vllm.engine_core.agent import FAULT_MARK

    @functools.wraps(handle)
    def handle_or_fault(self: Any, request_type: Any, request: Any) -> None:
        if isinstance(request_type, str) and request_type == FAULT_MARK:
            request.raise_pending()  # the agent's marker: raises into the busy loop if news
            return
        if isinstance(request_type, str) and request_type == ADMIT_MARK:
            request.run()  # a scale_up's marker (engine_core/admission.py)
            return
        handle(self, request_type, request)

    setattr(handle_or_fault, PATCHED_MARK, handle)
    return handle_or_fault


def _after_fault(handle: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(handle)
    def handle_when_faulted(self: Any, client_idx: int, call_id: int, ft_args: Any) -> None:
        agent = getattr(self, AGENT_ATTR, None)
        if agent is not None:
            agent.await_fault()  # the status the orchestrator saw is true before vLLM judges
        if isinstance(ft_args, dict) and ft_args.get("instruction") == "scale_up":
            from ftengine.integrations.vllm.engine_core.admission import handle_scale_up

            handle_scale_up(self, client_idx, call_id, ft_args)  # a HEALTHY engine's command
            return
        from ftengine.integrations.vllm.engine_core.admission import refuse_while_rejoining

        if isinstance(ft_args, dict) and refuse_while_rejoining(self, client_idx, call_id, ft_args):
            return  # a rank relaunching or waiting to be admitted: neither DEAD nor HEALTHY
        if agent is None:
            handle(self, client_idx, call_id, ft_args)
            return
        agent.command_started()
        try:
            handle(self, client_idx, call_id, ft_args)
        finally:
            agent.command_ended()  # its worker died during it: DEAD now (late_death.py)

    setattr(handle_when_faulted, PATCHED_MARK, handle)
    return handle_when_faulted


def reinit_dp_group_for_retry(self: Any) -> dict[str, Any]:
    from ftengine.integrations.vllm.engine_core.scale_down import reinit_for_retry

    return reinit_for_retry(self)


def _alone_when_rejoining(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def init_data_parallel(self: Any, vllm_config: Any) -> None:
        from ftengine.integrations.vllm.engine_core.rejoin import init_data_parallel as alone

        alone(self, vllm_config, init)

    setattr(init_data_parallel, PATCHED_MARK, init)
    return init_data_parallel


def _admitting_at_dp_sync(sync: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(sync)
    def has_global_unfinished_reqs(self: Any, local_unfinished: bool) -> bool:
        counter = int(getattr(self, "step_counter", 0)) + 1  # vLLM's rule for a sync step
        running = sync(self, local_unfinished)
        if counter != 1 and counter % int(getattr(self, "dp_sync_interval", 1) or 1) != 0:
            return running
        from ftengine.integrations.vllm.engine_core.admission import at_dp_sync

        return at_dp_sync(self, running)

    setattr(has_global_unfinished_reqs, PATCHED_MARK, sync)
    return has_global_unfinished_reqs


def _ringing_waves(add: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(add)
    def add_request(self: Any, request: Any, request_wave: int = 0) -> None:
        was_running = bool(self.engines_running)
        add(self, request, request_wave)
        from ftengine.integrations.vllm.engine_core.wave_bell import started_idle

        started_idle(self, was_running)  # no coordinator may be left to wake the others

    setattr(add_request, PATCHED_MARK, add)
    return add_request


REJOIN_ENGINE_CORE_PATCHES = (
    # A restarted rank that rejoins starts alone (engine_core/rejoin.py); vLLM's own otherwise.
    # Installed before vLLM loads the plugins (engine_core/entry.py): the DP start comes first.
    Patch(
        CORE_MODULE, "DPEngineCoreProc", "_init_data_parallel", ("vllm_config",),
        _alone_when_rejoining,
    ),
)  # fmt: skip

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
ENGINE_CORE_PATCHES = (
    Patch(
        CORE_SENTINEL_MODULE, "EngineCoreSentinel", "__init__", ("engine", "parallel_config"),
        _with_agent,
    ),
    Patch(CORE_SENTINEL_MODULE, "EngineCoreSentinel", "on_fault", ("exc",), _agent_on_fault),
    Patch(CORE_SENTINEL_MODULE, "EngineCoreSentinel", "_push_status", (), replacing(push_status)),
    Patch(
        CORE_SENTINEL_MODULE, "EngineCoreSentinel", "handle_command",
        ("client_idx", "call_id", "ft_args"), _after_fault,
    ),
    Patch(
        CORE_MODULE, "EngineCoreProc", "_handle_client_request", ("request_type", "request"),
        _with_fault_marker,
    ),
    Patch(
        CORE_SENTINEL_MODULE, "EngineCoreSentinel", "_reinit_dp_group", (),
        replacing(reinit_dp_group_for_retry),
    ),
    *REJOIN_ENGINE_CORE_PATCHES,
    # scale_up: the members agree on the admission at vLLM's DP-state sync (admission.py).
    Patch(
        CORE_MODULE, "DPEngineCoreProc", "_has_global_unfinished_reqs", ("local_unfinished",),
        _admitting_at_dp_sync,
    ),
    # DP waves once DP rank 0 (its server runs the coordinator) is removed (wave_bell.py).
    Patch(
        CORE_MODULE, "DPEngineCoreProc", "add_request", ("request", "request_wave"),
        _ringing_waves,
    ),
    # The poison probe (poison.py); vLLM's own behaviour unless re-inference installed one.
    Patch(
        SCHEDULER_MODULE, "Scheduler", "_handle_blocked_waiting_request", ("request",),
        marked(skipping_suspects),
    ),
    Patch(
        SCHEDULER_MODULE, "Scheduler", "update_from_output",
        ("scheduler_output", "model_runner_output"), marked(noting_clean_steps),
    ),
)  # fmt: skip


def _engine_scale_down(self: Any, ft_request: Any) -> Any:
    from ftengine.integrations.vllm.engine_core.scale_down import scale_down

    return scale_down(self, ft_request)


SCALE_DOWN_METHOD = NewMethod(
    CORE_SENTINEL_MODULE,
    "EngineCoreSentinel",
    "scale_down",
    _engine_scale_down,
    Patch(
        CORE_SENTINEL_MODULE, "EngineCoreSentinel", "handle_command",
        ("client_idx", "call_id", "ft_args"), unchanged,
    ),
)  # fmt: skip


REINFERENCE_SEAMS = (
    Patch(
        SCHEDULER_MODULE, "Scheduler", "reset_prefix_cache",
        ("reset_running_requests", "reset_connector"), unchanged,
    ),
    Patch(
        SCHEDULER_MODULE, "Scheduler", "finish_requests", ("request_ids", "finished_status"),
        unchanged,
    ),
)  # fmt: skip
"""vLLM names re-inference calls but never replaces (``integrations.vllm.engine_core.reinference``):
checked like the patches (``check_reinference_seams``) so that a vLLM that moves them fails
at start-up, not at the first fault."""
REQUEST_FIELDS = ("num_in_flight_tokens", "num_stale_output_tokens", "drop_stale_output")
"""``vllm.v1.request.Request`` attributes the hold resets (vLLM 0.32's async-output count)."""
REQUEST_PROPERTIES = ("num_output_tokens",)
"""``vllm.v1.request.Request`` properties the hold reads (a request that emitted nothing is
sent again as new)."""


def check_reinference_seams() -> None:
    """Raise :class:`VllmSeamMoved` unless every name in :data:`REINFERENCE_SEAMS` and
    :data:`REQUEST_FIELDS` is what ``integrations.vllm.engine_core.reinference`` expects."""
    for seam in REINFERENCE_SEAMS:
        seam.target()
    request = getattr(import_vllm("vllm.v1.request"), "Request", None)
    init = inspect.getsource(request) if isinstance(request, type) else ""
    missing = [name for name in REQUEST_FIELDS if f"self.{name}" not in init]
    missing += [
        name
        for name in REQUEST_PROPERTIES
        if not isinstance(getattr(request, name, None), property)
    ]
    if missing:
        raise VllmSeamMoved(
            f"expected vllm.v1.request.Request to set {', '.join(REQUEST_FIELDS)} and have "
            f"{', '.join(REQUEST_PROPERTIES)}, found no {missing}: ftengine's re-inference "
            "needs updating"
        )
