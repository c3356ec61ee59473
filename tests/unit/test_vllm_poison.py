"""The poison probe in vLLM's engine core, with the hold's scheduler stand-in (real
signatures, ``test_vllm_reinference``): after an own fault the requests that ran are re-run
one at a time through the patched ``Scheduler._handle_blocked_waiting_request``, the one
whose lone re-run faults again is aborted alone with the poison reason and its batch-mates
keep their re-run count; a peer's fault suspects nobody; the tests' content-keyed fault
injection fires on every step of a request whose prompt holds the marker token once it has
emitted a token, and on nothing else."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

from ftengine.errors import PeerDead
from ftengine.integrations.vllm.engine_core.poison import (
    PROBE_ATTR,
    EngineProbe,
    noting_clean_steps,
    own_fault,
    skipping_suspects,
)
from ftengine.integrations.vllm.engine_core.reinference import HOLD_ATTR, hold_or_abort
from ftengine.integrations.vllm.worker import fault_injection
from tests.unit.test_vllm_reinference import (
    FakeRequest,
    Sentinel,
    Status,
    aborts,
    held_sentinel,
    vllm_abort_all,
)


def vllm_skip_check(scheduler: Any, request: Any) -> bool:
    return True  # vLLM's own answer for a plain waiting request: schedule it


skip_unless_ready = skipping_suspects(vllm_skip_check)


def scheduled(sentinel: Sentinel) -> list[str]:
    """What the patched check lets vLLM's scan schedule from the waiting queue now."""
    scheduler = sentinel.engine.scheduler
    return [r.request_id for r in scheduler.waiting if skip_unless_ready(scheduler, r)]


def schedule(sentinel: Sentinel, request_ids: list[str]) -> None:
    """``request_ids`` are scheduled: waiting -> running (those running stay)."""
    scheduler = sentinel.engine.scheduler
    for rid in request_ids:
        request = scheduler.requests[rid]
        if request in scheduler.waiting:
            scheduler.waiting.remove(request)
            scheduler.running.append(request)
            request.status = Status.RUNNING
            request.num_in_flight_tokens = 1


def run_clean_step(sentinel: Sentinel, request_ids: list[str]) -> None:
    """``request_ids`` are scheduled and their step's output comes back."""
    schedule(sentinel, request_ids)
    update = noting_clean_steps(lambda *_: {})
    update(sentinel.engine.scheduler, StepOutput(dict.fromkeys(request_ids, 1)), None)


@attrs.frozen
class StepOutput:
    """``SchedulerOutput``'s field the clean-step note reads."""

    num_scheduled_tokens: dict[str, int]


def test_a_poison_request_is_found_by_lone_re_runs_and_aborted_alone() -> None:
    sentinel = held_sentinel(max_reinference=1, running=3, waiting=0)
    hold_or_abort(sentinel, RuntimeError("worker failed"), vllm_abort_all)  # r2 is the poison
    assert scheduled(sentinel) == ["r0"]  # the others wait for their turn
    run_clean_step(sentinel, ["r0"])
    assert scheduled(sentinel) == ["r1"]
    run_clean_step(sentinel, ["r0", "r1"])
    assert scheduled(sentinel) == ["r2"]
    schedule(sentinel, ["r2"])
    hold_or_abort(sentinel, RuntimeError("worker failed again"), vllm_abort_all)
    reasons = aborts(sentinel.engine)
    assert list(reasons) == ["r2"]
    assert str(reasons["r2"]).startswith("poison request: re-run alone on rank 0 after a fault")
    scheduler = sentinel.engine.scheduler
    assert set(scheduler.requests) == {"r0", "r1"} and scheduled(sentinel) == ["r0", "r1"]
    # max_reinference 1: charged for the second fault too, they would have been aborted
    reruns = getattr(sentinel, HOLD_ATTR).reruns
    assert (reruns["r0"], reruns["r1"]) == (1, 1)


def test_new_arrivals_wait_for_the_probes_step_so_its_fault_is_its_own() -> None:
    """Seen on hosts (chaos-vllm --hosts 2, seed 113): the poison request re-run beside
    requests that had just arrived faulted three times with them and was aborted by the
    re-run limit, its reason not naming it. New arrivals now wait for the probe's step."""
    sentinel = held_sentinel(max_reinference=3, running=1, waiting=0)
    hold_or_abort(sentinel, RuntimeError("worker failed"), vllm_abort_all)  # r0: the poison
    scheduler = sentinel.engine.scheduler
    for rid in ("n0", "n1"):  # the clients' next requests, arrived since the fault
        request = FakeRequest(rid)
        scheduler.requests[rid] = request
        scheduler.waiting.append(request)
    assert scheduled(sentinel) == ["r0"]  # the probe alone
    schedule(sentinel, ["r0"])
    hold_or_abort(sentinel, RuntimeError("worker failed again"), vllm_abort_all)
    reasons = aborts(sentinel.engine)
    assert list(reasons) == ["r0"]
    assert str(reasons["r0"]).startswith("poison request: re-run alone on rank 0 after a fault")
    assert scheduled(sentinel) == ["n0", "n1"]  # nobody suspected: they run at once


def test_an_arrival_waits_one_step_per_suspect_then_runs_with_them() -> None:
    sentinel = held_sentinel(running=2, waiting=0)
    hold_or_abort(sentinel, RuntimeError("worker failed"), vllm_abort_all)
    scheduler = sentinel.engine.scheduler
    request = FakeRequest("n0")
    scheduler.requests["n0"] = request
    scheduler.waiting.append(request)
    assert scheduled(sentinel) == ["r0"]
    run_clean_step(sentinel, ["r0"])
    assert scheduled(sentinel) == ["r1"]  # r0 clean and running; n0 still waits
    run_clean_step(sentinel, ["r0", "r1"])
    assert scheduled(sentinel) == ["n0"]


def test_a_fault_while_a_not_yet_clean_mate_ran_suspects_everyone_again() -> None:
    sentinel = held_sentinel(running=2, waiting=1)
    hold_or_abort(sentinel, RuntimeError("worker failed"), vllm_abort_all)
    run_clean_step(sentinel, ["r0", "w0"])  # w0 scheduled beside the probe all the same
    run_clean_step(sentinel, ["r1"])
    assert getattr(sentinel.engine.scheduler, PROBE_ATTR).probe.suspects == []
    hold_or_abort(sentinel, RuntimeError("worker failed"), vllm_abort_all)  # nobody was probed
    assert aborts(sentinel.engine) == {}
    assert getattr(sentinel.engine.scheduler, PROBE_ATTR).probe.suspects == ["r0", "w0", "r1"]


@pytest.mark.parametrize(
    "exc", [TimeoutError("gloo"), RuntimeError("Connection closed by peer"), PeerDead("engine 1")]
)
def test_a_peers_fault_suspects_nobody_and_finds_no_poison(exc: BaseException) -> None:
    assert not own_fault(exc, {}) and own_fault(
        RuntimeError("Worker failed: 'boom'"), {1: "healthy"}
    )
    sentinel = held_sentinel(running=1, waiting=0)
    hold_or_abort(sentinel, exc, vllm_abort_all)
    assert scheduled(sentinel) == ["r0"]
    schedule(sentinel, ["r0"])
    hold_or_abort(sentinel, exc, vllm_abort_all)  # alone again: still the peer's fault
    assert aborts(sentinel.engine) == {}
    assert getattr(sentinel, HOLD_ATTR).reruns == {"r0": 2}


def test_any_error_after_a_peer_died_is_the_peers() -> None:
    group_gone = RuntimeError("Worker failed with error 'Process group is not initialized'")
    assert not own_fault(group_gone, {1: "dead"})
    sentinel = held_sentinel(running=1, waiting=0)
    hold_or_abort(sentinel, group_gone, vllm_abort_all, {1: "dead"})  # the agent's view
    assert getattr(sentinel.engine.scheduler, PROBE_ATTR).probe.suspects == []


def test_an_own_error_stays_own_while_a_peer_is_only_unhealthy() -> None:
    """A peer's last status may still say ``unhealthy`` (a recovery's settle time, or it
    reported its wait for this engine first): this engine's own error stays its own."""
    injected = RuntimeError("Worker failed with error '[FT] fault injected on DP rank 1'")
    assert own_fault(injected, {0: "unhealthy"})
    closed = RuntimeError("Worker failed with error '[pair.cc:553] Connection closed by peer'")
    assert not own_fault(closed, {1: "unhealthy"})  # a peer's error stays the peer's
    sentinel = held_sentinel(running=1, waiting=0)
    hold_or_abort(sentinel, injected, vllm_abort_all, {0: "unhealthy"})
    assert getattr(sentinel.engine.scheduler, PROBE_ATTR).probe.suspects == ["r0"]


def test_a_suspect_its_client_aborted_never_holds_the_others_back() -> None:
    sentinel = held_sentinel(running=2, waiting=0)
    hold_or_abort(sentinel, RuntimeError("worker failed"), vllm_abort_all)
    scheduler = sentinel.engine.scheduler
    scheduler.finish_requests(["r0"], Status.FINISHED_ABORTED)  # the probe, gone
    assert scheduled(sentinel) == ["r1"]


def test_without_a_probe_vllms_own_check_and_update_run() -> None:
    scheduler = attrs.make_class("Plain", {"requests": attrs.field(factory=dict)})()
    assert skipping_suspects(lambda s, r: False)(scheduler, FakeRequest("x")) is False
    assert skip_unless_ready(scheduler, FakeRequest("x")) is True
    out = noting_clean_steps(lambda s, o, m: {"from": "vllm"})(scheduler, StepOutput({}), None)
    assert out == {"from": "vllm"}
    probe = EngineProbe()
    probe.ran_clean(["x"])  # nobody suspected: nothing to note
    assert probe.clean == set()


@attrs.frozen
class CachedRequests:
    """``vllm.v1.core.sched.output.CachedRequestData``'s fields the injection reads."""

    req_ids: list[str]
    num_output_tokens: list[int]


@attrs.frozen
class SchedulerOutput:
    """``vllm.v1.core.sched.output.SchedulerOutput``'s fields the injection reads."""

    scheduled_cached_reqs: CachedRequests
    total_num_scheduled_tokens: int


def running(**emitted: int) -> SchedulerOutput:
    return SchedulerOutput(CachedRequests(list(emitted), list(emitted.values())), len(emitted))


def test_the_fake_scheduler_output_has_vllms_field_names() -> None:
    output = pytest.importorskip("vllm.v1.core.sched.output")
    fields = output.SchedulerOutput.__dataclass_fields__
    assert {"scheduled_cached_reqs", "total_num_scheduled_tokens"} <= set(fields)
    cached = output.CachedRequestData.__dataclass_fields__
    assert {"req_ids", "num_output_tokens"} <= set(cached)


@attrs.frozen
class CachedState:
    prompt_token_ids: list[int]


def worker_holding(**cached: list[int]) -> Any:
    runner = attrs.make_class("Runner", {"requests": attrs.field()})(
        {rid: CachedState(p) for rid, p in cached.items()}
    )
    return attrs.make_class("W", {"model_runner": attrs.field()})(runner)


def test_the_decoding_requests_prompts_come_from_the_runners_states() -> None:
    worker = worker_holding(a=[1, 2], b=[3], c=[7])
    assert fault_injection.scheduled_decodes(worker, running(a=0, b=2, c=1)) == {"b": [3], "c": [7]}
    assert fault_injection.scheduled_decodes(worker, None) == {}


def test_a_poison_token_faults_every_step_of_its_request_after_its_first_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fault_file = tmp_path / "inject"
    monkeypatch.setenv(fault_injection.FAULT_FILE_ENV, str(fault_file))
    worker = worker_holding(p=[5, 42, 6], q=[5, 6])
    poisoned = running(q=3, p=1)
    fault_injection.maybe_inject(1, worker, poisoned)  # no file: no fault
    fault_file.write_text("token:42\n")
    for _ in range(2):  # every re-run, on any rank; the file stays
        with pytest.raises(RuntimeError, match="poison token 42 in the prompt of request p"):
            fault_injection.maybe_inject(0, worker, poisoned)
    assert fault_file.exists()
    fault_injection.maybe_inject(0, worker, running(q=3, p=0))  # its first step (its first token)
    fault_injection.maybe_inject(0, worker, running(q=3))  # its mate alone: clean
    fault_injection.maybe_inject(0, worker, None)  # sample_tokens: not keyed on requests
    fault_file.write_text("token:x")
    with pytest.raises(ValueError, match=r"a DP rank or token:<token id>, found 'token:x'"):
        fault_injection.maybe_inject(0, worker, poisoned)
    fault_file.write_text("1")  # the rank form: once, on that rank
    fault_injection.maybe_inject(0, worker, poisoned)
    fault_injection.maybe_inject(1, worker, running())  # finished-requests note: no request
    assert fault_file.exists()
    with pytest.raises(RuntimeError, match="fault injected on DP rank 1"):
        fault_injection.maybe_inject(1, worker, poisoned)
    assert not fault_file.exists()
