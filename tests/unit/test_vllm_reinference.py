"""Re-inference in vLLM's engine core, against vLLM's real output, status and request types
and a scheduler stand-in with the real scheduler's signatures: a fault holds the running
requests (preempted, nothing left in flight) and the waiting ones, aborts the ones over
``max_reinference`` with the reason, aborts everything when the engine is DEAD or the wait
for a recovery times out; with ``"reinference": false`` vLLM's own ``on_fault`` runs; the
seams it calls fail loudly when vLLM moves them."""

from __future__ import annotations

import inspect
import queue
import threading
from typing import Any

import attrs
import pytest

from ftengine.integrations.vllm.config import VllmFtSettings
from ftengine.integrations.vllm.engine_core.parking import ParkableEvent, park
from ftengine.integrations.vllm.engine_core.poison import PROBE_ATTR
from ftengine.integrations.vllm.engine_core.reinference import (
    HOLD_ATTR,
    Hold,
    abort_held,
    hold_or_abort,
    install,
    release_dead,
)
from ftengine.integrations.vllm.patches import engine_core as patches
from ftengine.integrations.vllm.patches.engine_core import (
    REINFERENCE_SEAMS,
    check_reinference_seams,
)
from ftengine.integrations.vllm.patches.mechanism import VllmSeamMoved

vllm_request = pytest.importorskip("vllm.v1.request", reason="vLLM is not installed")
v1 = pytest.importorskip("vllm.v1.engine")
scheduler_module = pytest.importorskip(patches.SCHEDULER_MODULE)
Status = vllm_request.RequestStatus


@attrs.define(eq=False)
class FakeRequest:
    """The ``vllm.v1.request.Request`` fields the hold reads and writes."""

    request_id: str
    status: Any = Status.RUNNING
    client_index: int = 0
    num_in_flight_tokens: int = 1
    num_stale_output_tokens: int = 0
    drop_stale_output: bool = False
    num_output_tokens: int = 1  # a property of the real Request

    def is_finished(self) -> bool:
        return bool(Status.is_finished(self.status))


class FakeScheduler:
    """vLLM's ``Scheduler`` as far as the hold uses it (same parameter names)."""

    def __init__(self, running: list[FakeRequest], waiting: list[FakeRequest]) -> None:
        self.running = list(running)
        self.waiting = list(waiting)
        for request in waiting:
            request.status = Status.WAITING
        self.requests = {r.request_id: r for r in [*running, *waiting]}

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        assert reset_running_requests
        while self.running:  # as vLLM does: pop in reverse, preempt, prepend
            request = self.running.pop()
            request.status = Status.PREEMPTED
            request.num_stale_output_tokens = request.num_in_flight_tokens
            request.drop_stale_output = True
            self.waiting.insert(0, request)
        return True

    def finish_requests(self, request_ids: Any, finished_status: Any) -> list[FakeRequest]:
        finished = []
        for rid in request_ids:
            request = self.requests.pop(rid, None)
            if request is not None:
                request.status = finished_status
                self.waiting = [r for r in self.waiting if r is not request]
                finished.append(request)
        return finished


@attrs.define
class Executor:
    is_failed: bool = False


@attrs.define
class ParallelConfig:
    """``ParallelConfig``'s DP fields the handoff reads (one rank: no survivor)."""

    data_parallel_rank: int = 0
    data_parallel_size: int = 1


@attrs.define
class EngineConfig:
    parallel_config: ParallelConfig = attrs.field(factory=ParallelConfig)


@attrs.define
class Engine:
    scheduler: FakeScheduler
    model_executor: Executor = attrs.field(factory=Executor)
    output_queue: queue.Queue[Any] = attrs.field(factory=queue.Queue)
    input_queue: queue.Queue[Any] = attrs.field(factory=queue.Queue)
    batch_queue: Any = None
    engine_index: int = 0
    vllm_config: Any = attrs.field(factory=EngineConfig)


class Sentinel:
    """``EngineCoreSentinel``'s fields ``on_fault`` touches."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.engine_index = 0
        self.resumed = threading.Event()
        self.resumed.set()
        self.status_type = v1.EngineStatusType.HEALTHY
        self.fault_info: str | None = None
        self.pushed: list[Any] = []

    def _push_status(self) -> None:
        self.pushed.append(self.status_type)


def settings(**options: object) -> VllmFtSettings:
    from ftengine.backends.npu_config import NpuFtConfig

    return VllmFtSettings(enabled=True, npu=NpuFtConfig.from_options(options))


def held_sentinel(max_reinference: int = 3, running: int = 2, waiting: int = 1) -> Sentinel:
    run = [FakeRequest(f"r{i}") for i in range(running)]
    wait = [FakeRequest(f"w{i}", num_in_flight_tokens=0) for i in range(waiting)]
    sentinel = Sentinel(Engine(FakeScheduler(run, wait)))
    options = settings(reinference=True, max_reinference=max_reinference)
    install(sentinel, options, check_reinference_seams)
    return sentinel


def aborts(engine: Engine) -> dict[str, Any]:
    """Every request id the engine told its clients was aborted, with its stop reason."""
    found: dict[str, Any] = {}
    while not engine.output_queue.empty():
        _client, outputs = engine.output_queue.get_nowait()
        for output in outputs.outputs:
            assert output.finish_reason == v1.FinishReason.ABORT and output.new_token_ids == []
            found[output.request_id] = output.stop_reason
    return found


def vllm_abort_all(sentinel: Any, exc: BaseException) -> None:
    sentinel.vllm_ran = True


def test_the_stand_in_has_the_real_schedulers_signatures() -> None:
    real = scheduler_module.Scheduler
    for name in ("reset_prefix_cache", "finish_requests"):
        want = list(inspect.signature(getattr(real, name)).parameters)
        assert list(inspect.signature(getattr(FakeScheduler, name)).parameters) == want


def test_a_fault_holds_running_and_waiting_requests_with_nothing_in_flight() -> None:
    sentinel = held_sentinel()
    engine = sentinel.engine
    hold_or_abort(sentinel, RuntimeError("boom"), vllm_abort_all)
    assert not hasattr(sentinel, "vllm_ran")
    scheduler = engine.scheduler
    assert [r.request_id for r in scheduler.waiting] == ["r0", "r1", "w0"]  # order kept
    assert all(r.status == Status.PREEMPTED for r in scheduler.waiting[:2])
    assert all(
        (r.num_in_flight_tokens, r.num_stale_output_tokens, r.drop_stale_output) == (0, 0, False)
        for r in scheduler.waiting
    )
    assert aborts(engine) == {}
    assert sentinel.status_type == v1.EngineStatusType.UNHEALTHY and sentinel.fault_info == (
        "RuntimeError"
    )
    assert sentinel.pushed == [v1.EngineStatusType.UNHEALTHY] and not sentinel.resumed.is_set()
    hold: Hold = getattr(sentinel, HOLD_ATTR)
    assert hold.reruns == {"r0": 1, "r1": 1} and hold.since is not None
    sentinel.resumed.set()  # what vLLM's retry does
    assert hold.since is None


def test_a_running_request_that_emitted_nothing_is_sent_again_as_new() -> None:
    """The step that first scheduled it may have faulted before the model runner recorded
    it: as PREEMPTED vLLM would send it as a cached request the runner does not have."""
    sentinel = held_sentinel()
    scheduler = sentinel.engine.scheduler
    scheduler.requests["r1"].num_output_tokens = 0
    hold_or_abort(sentinel, RuntimeError("boom"), vllm_abort_all)
    assert [(r.request_id, r.status) for r in scheduler.waiting] == [
        ("r0", Status.PREEMPTED),
        ("r1", Status.WAITING),
        ("w0", Status.WAITING),
    ]
    assert aborts(sentinel.engine) == {}


def test_a_request_in_more_faulted_steps_than_the_limit_is_aborted_with_the_reason() -> None:
    sentinel = held_sentinel(max_reinference=1, running=1, waiting=1)
    engine = sentinel.engine
    hold_or_abort(sentinel, RuntimeError("first"), vllm_abort_all)
    scheduler = engine.scheduler
    scheduler.running = [scheduler.waiting.pop(0)]  # resumed, running again
    scheduler.running[0].status = Status.RUNNING
    # ... and it ran clean steps since: no longer a suspect (re-run alone, a second fault
    # straight away would make it the poison request, test_vllm_poison)
    getattr(scheduler, PROBE_ATTR).ran_clean(["r0"])
    hold_or_abort(sentinel, RuntimeError("second"), vllm_abort_all)
    reasons = aborts(engine)
    assert list(reasons) == ["r0"] and "w0" in scheduler.requests  # never ran: still held
    assert reasons["r0"].startswith("re-inference limit reached: the request was in 2 faulted")
    assert "at most 1 times (max_reinference)" in reasons["r0"]


def test_a_dead_engine_aborts_what_it_held_saying_so() -> None:
    sentinel = held_sentinel()
    sentinel.engine.model_executor.is_failed = True
    hold_or_abort(sentinel, RuntimeError("worker died"), vllm_abort_all)
    reasons = aborts(sentinel.engine)
    assert set(reasons) == {"r0", "r1", "w0"} and sentinel.engine.scheduler.requests == {}
    assert all(str(r).startswith("recovery ended DEAD") for r in reasons.values())
    assert sentinel.status_type == v1.EngineStatusType.DEAD


def test_an_engine_dead_after_a_failed_scale_down_with_no_survivor_aborts_what_it_held() -> None:
    """A single rank (no handoff): aborted with the reason (with survivors they are handed
    over: test_vllm_handoff)."""
    sentinel = held_sentinel()
    hold_or_abort(sentinel, RuntimeError("peer died"), vllm_abort_all)
    assert aborts(sentinel.engine) == {}  # held for the recovery
    release_dead(sentinel, "engine 0's scale_down failed: peer gone")
    reasons = aborts(sentinel.engine)
    assert set(reasons) == {"r0", "r1", "w0"} and sentinel.engine.scheduler.requests == {}
    assert all("scale_down failed: peer gone" in str(r) for r in reasons.values())
    release_dead(Sentinel(sentinel.engine), "no hold: nothing to do")  # re-inference off


def test_an_engine_whose_policy_gave_up_aborts_what_it_held() -> None:
    sentinel = held_sentinel()
    hold_or_abort(sentinel, RuntimeError("peer died"), vllm_abort_all)
    abort_held(sentinel, "engine 0 gave up: the minority of a partition")
    reasons = aborts(sentinel.engine)
    assert set(reasons) == {"r0", "r1", "w0"} and sentinel.engine.scheduler.requests == {}
    assert all("minority of a partition" in str(r) for r in reasons.values())
    abort_held(Sentinel(sentinel.engine), "no hold: nothing to do")  # re-inference off


def test_a_wait_for_recovery_past_the_deadline_aborts_every_held_request() -> None:
    sentinel = held_sentinel()
    hold_or_abort(sentinel, RuntimeError("boom"), vllm_abort_all)
    assert sentinel.resumed.wait(timeout=0.01) is False  # vLLM's wrapper, then it re-raises
    reasons = aborts(sentinel.engine)
    assert set(reasons) == {"r0", "r1", "w0"}
    assert all("recovery deadline (recovery_timeout)" in str(r) for r in reasons.values())


def test_a_parked_engine_with_held_requests_waits_on_past_the_deadline() -> None:
    """Re-inference replaces the sentinel's ``resumed`` too: it stays parkable (a minority
    cut off, rank 0 hosting the coordinator), and a parked wait neither ends at its timeout
    nor aborts what the engine holds (that is the agent's, as it gives up)."""
    sentinel = held_sentinel()
    hold_or_abort(sentinel, RuntimeError("boom"), vllm_abort_all)
    assert park(sentinel)
    threading.Timer(0.3, sentinel.resumed.set).start()
    assert sentinel.resumed.wait(timeout=0.01) is True  # resumed 30x past the timeout
    assert isinstance(sentinel.resumed, ParkableEvent) and not sentinel.resumed.parked
    assert aborts(sentinel.engine) == {}


def test_without_the_option_vllms_own_on_fault_runs() -> None:
    sentinel = Sentinel(Engine(FakeScheduler([FakeRequest("r0")], [])))
    install(sentinel, settings(reinference=False), check_reinference_seams)
    assert not hasattr(sentinel, HOLD_ATTR) and type(sentinel.resumed) is threading.Event
    hold_or_abort(sentinel, RuntimeError("boom"), vllm_abort_all)
    assert getattr(sentinel, "vllm_ran", False) is True


@pytest.mark.parametrize(("failed", "what"), [(False, "faulted"), (True, "lost its worker")])
def test_without_the_option_the_aborted_requests_say_why(failed: bool, what: str) -> None:
    """vLLM's own on_fault aborts with no stop reason (the chaos campaign's 'lost' streams):
    ftengine aborts them first, naming the fault, and vLLM's then finds nothing left."""
    engine = Engine(FakeScheduler([FakeRequest("r0")], [FakeRequest("w0")]))
    engine.model_executor.is_failed = failed
    sentinel = Sentinel(engine)
    install(sentinel, settings(reinference=False), check_reinference_seams)
    hold_or_abort(sentinel, RuntimeError("boom"), vllm_abort_all)
    reasons = aborts(engine)
    assert set(reasons) == {"r0", "w0"}
    assert all(
        str(r).startswith(f"engine 0 {what} (RuntimeError); re-inference is off")
        for r in reasons.values()
    ), reasons
    assert getattr(sentinel, "vllm_ran", False) is True and not engine.scheduler.requests


def test_the_options_are_checked_at_start_up() -> None:
    from ftengine.errors import ConfigError

    assert settings().reinference is True and settings().max_reinference == 3  # the defaults
    assert settings(reinference=False).reinference is False
    assert settings(reinference=True, max_reinference=0).max_reinference == 0
    with pytest.raises(ConfigError, match=r"ftengine\.max_reinference must be an integer >= 0"):
        settings(max_reinference=-1)
    with pytest.raises(ConfigError, match=r"ftengine\.reinference must be true or false"):
        settings(reinference="yes")


def test_the_seams_re_inference_calls_are_where_it_expects_them() -> None:
    check_reinference_seams()
    moved = attrs.evolve(REINFERENCE_SEAMS[0], params=("reset_running_requests",))
    with pytest.raises(VllmSeamMoved, match=r"Scheduler\.reset_prefix_cache: expected"):
        moved.target()


@pytest.mark.parametrize(
    ("names", "known"),
    [("REQUEST_FIELDS", "num_in_flight_tokens"), ("REQUEST_PROPERTIES", "num_output_tokens")],
)
def test_a_request_without_a_field_or_property_the_hold_uses_fails_the_seam_check(
    monkeypatch: pytest.MonkeyPatch, names: str, known: str
) -> None:
    monkeypatch.setattr(patches, names, (known, "no_such_count"))
    with pytest.raises(VllmSeamMoved, match=r"found no \['no_such_count'\]"):
        check_reinference_seams()
