"""The continuous-batching serving loop over a stand-in cluster: requests join between
steps, tokens arrive one per step, every finish reason, failures confined to their request,
and caches released on every way out."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest

from ftengine.testbed.cluster.generation import RequestAborted, StepResult
from ftengine.testbed.cluster.protocol import StepItem, StepOutput
from ftengine.testbed.cluster.serving import SHUTDOWN_REASON, ServingLoop, ServingUnavailable
from ftengine.testbed.serving_api import FinishReason, GenerationRequest, TokenEvent
from tests.serving_support import Collected

VOCAB = 50
WAIT_S = 10.0


class StepStandIn:
    """Ranks that "generate" ``(last token + 1) % VOCAB``; records every step's items and
    keeps each rank's caches (request id -> tokens seen) until released."""

    def __init__(self, ranks: Sequence[int] = (0, 1)) -> None:
        self.ranks = tuple(ranks)
        self.steps: list[dict[int, tuple[StepItem, ...]]] = []
        self.caches: dict[int, dict[str, list[int]]] = {rank: {} for rank in self.ranks}
        self.serving = True
        self.fail_next_step: str | None = None
        self.reject: set[int] = set()  # token ids a rank refuses
        self.gate: threading.Event | None = None  # see hold()

    def serving_ranks(self) -> tuple[int, ...]:
        if not self.serving:
            raise RequestAborted("cluster is not serving: engines are not healthy")
        return self.ranks

    def run_step(self, items: Mapping[int, Sequence[StepItem]]) -> StepResult:
        self.serving_ranks()
        self.steps.append({rank: tuple(mine) for rank, mine in items.items()})
        if self.fail_next_step is not None:
            why, self.fail_next_step = self.fail_next_step, None
            raise RequestAborted(why)
        outputs, rejected = {}, {}
        for rank, mine in items.items():
            for item in mine:
                if set(item.token_ids) & self.reject:
                    rejected[item.request_id] = f"rank {rank}: token id out of range"
                    continue
                seen = self.caches[rank].setdefault(item.request_id, [])
                seen.extend(item.token_ids)
                token = (seen[-1] + 1) % VOCAB
                outputs[item.request_id] = StepOutput(item.request_id, token)
        gate = self.gate
        if gate is not None:  # hold the loop inside this step until the test lets it go
            assert gate.wait(WAIT_S)
        return StepResult(outputs, rejected)

    def hold(self) -> None:
        """From now on, every step waits (after computing) until :meth:`let_go`."""
        self.gate = threading.Event()

    def let_go(self) -> None:
        """Stop holding steps and release the one waiting."""
        gate, self.gate = self.gate, None
        if gate is not None:
            gate.set()

    def release(self, rank: int, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self.caches[rank].pop(request_id, None)


@pytest.fixture
def cluster() -> StepStandIn:
    return StepStandIn()


@pytest.fixture
def loop(cluster: StepStandIn) -> Iterator[ServingLoop]:
    serving = ServingLoop(cluster, max_running=8).start()
    yield serving
    serving.close()


def request(prompt: Sequence[int], max_tokens: int, stop: Sequence[int] = ()) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), max_tokens, frozenset(stop))


def test_tokens_arrive_one_per_step_and_the_last_says_length(
    loop: ServingLoop, cluster: StepStandIn
) -> None:
    got = Collected(WAIT_S)
    loop.submit(request([3, 4], 3), got)
    last = got.wait()
    assert got.tokens == [5, 6, 7]
    assert [e.finish_reason for e in got.events] == [None, None, FinishReason.LENGTH]
    assert last.detail is None
    items = [step[0][0].token_ids for step in cluster.steps]
    assert items == [(3, 4), (5,), (6,)], "the prompt first, then one token per step"
    assert cluster.caches == {0: {}, 1: {}}, "a finished request's cache is dropped"


def test_a_stop_id_finishes_with_stop_and_keeps_the_token(loop: ServingLoop) -> None:
    got = Collected(WAIT_S)
    loop.submit(request([10], 8, stop=[12]), got)
    last = got.wait()
    assert got.tokens == [11, 12]
    assert (last.finish_reason, last.stop_reason) == (FinishReason.STOP, 12)


def test_requests_join_between_steps_and_spread_over_ranks(cluster: StepStandIn) -> None:
    first, second, third = Collected(WAIT_S), Collected(WAIT_S), Collected(WAIT_S)
    cluster.hold()
    with serving(cluster) as loop:
        loop.submit(request([1], 4), first)
        loop.start()
        wait_steps(cluster, 1)  # step 0 ran with the first request alone, and is held
        loop.submit(request([20, 21], 2), second)
        loop.submit(request([30], 2), third)
        cluster.let_go()
        for got in (first, second, third):
            assert got.wait().finish_reason is FinishReason.LENGTH
    assert first.tokens == [2, 3, 4, 5] and second.tokens == [22, 23] and third.tokens == [31, 32]
    assert [sum(map(len, step.values())) for step in cluster.steps] == [1, 3, 3, 1]
    joined = cluster.steps[1]
    by_request = {item.token_ids: rank for rank, mine in joined.items() for item in mine}
    assert by_request == {(2,): 0, (20, 21): 1, (30,): 0}, "least loaded, then lowest rank"


@contextlib.contextmanager
def serving(cluster: StepStandIn, **options: Any) -> Iterator[ServingLoop]:
    """A loop not yet started (requests submitted before ``start`` share the first step)."""
    loop = ServingLoop(cluster, **options)
    try:
        yield loop
    finally:
        cluster.let_go()
        loop.close()


def wait_steps(cluster: StepStandIn, count: int) -> None:
    pause = threading.Event()
    for _ in range(int(WAIT_S / 0.01)):
        if len(cluster.steps) >= count:
            return
        pause.wait(0.01)
    raise AssertionError(f"only {len(cluster.steps)} steps ran, expected {count}")


def test_a_failed_step_aborts_every_running_request_and_serving_goes_on(
    cluster: StepStandIn,
) -> None:
    cluster.fail_next_step = "step 0 failed (rank 3: InjectedFault)"
    a, b, again = Collected(WAIT_S), Collected(WAIT_S), Collected(WAIT_S)
    with serving(cluster) as loop:
        loop.submit(request([1], 5), a)
        loop.submit(request([2], 5), b)
        loop.start()
        for got in (a, b):
            last = got.wait()
            assert last.finish_reason is FinishReason.ABORT
            assert last.detail == "step 0 failed (rank 3: InjectedFault)"
        loop.submit(request([1], 2), again)
        assert again.wait().finish_reason is FinishReason.LENGTH
    assert again.tokens == [2, 3]


def test_a_request_a_rank_rejects_fails_alone(cluster: StepStandIn) -> None:
    cluster.reject = {49}
    bad, good = Collected(WAIT_S), Collected(WAIT_S)
    with serving(cluster) as loop:
        loop.submit(request([49], 3), bad)
        loop.submit(request([7], 3), good)
        loop.start()
        last = bad.wait()
        assert good.wait().finish_reason is FinishReason.LENGTH
    assert last.finish_reason is FinishReason.ERROR and "out of range" in (last.detail or "")
    assert bad.tokens == [] and good.tokens == [8, 9, 10]
    assert 49 in cluster.steps[0][0][0].token_ids, "it was in the same step as the good one"


def test_submit_while_not_serving_raises_and_queues_nothing(
    loop: ServingLoop, cluster: StepStandIn
) -> None:
    cluster.serving = False
    with pytest.raises(RequestAborted, match="not serving"):
        loop.submit(request([1], 2), Collected(WAIT_S))
    assert cluster.steps == []


def test_losing_service_mid_request_aborts_it_with_the_reason(cluster: StepStandIn) -> None:
    got = Collected(WAIT_S)
    cluster.hold()
    with serving(cluster) as loop:
        loop.submit(request([1], 10), got)
        loop.start()
        wait_steps(cluster, 1)
        cluster.serving = False
        cluster.let_go()
        last = got.wait()
    assert last.finish_reason is FinishReason.ABORT and "not serving" in (last.detail or "")
    assert got.tokens == [2]
    assert cluster.caches == {0: {}, 1: {}}


def test_cancel_aborts_and_releases(cluster: StepStandIn) -> None:
    got = Collected(WAIT_S)
    cluster.hold()
    with serving(cluster) as loop:
        ticket = loop.submit(request([1], 10), got)
        loop.start()
        wait_steps(cluster, 1)
        ticket.cancel()
        cluster.let_go()
        last = got.wait()
    assert last.finish_reason is FinishReason.ABORT and "cancelled" in (last.detail or "")
    assert got.tokens == [2] and cluster.caches == {0: {}, 1: {}}


def test_a_broken_listener_costs_only_its_own_request(loop: ServingLoop) -> None:
    def broken(event: TokenEvent) -> None:
        raise RuntimeError("client gone")

    loop.submit(request([1], 5), broken)
    good = Collected(WAIT_S)
    loop.submit(request([2], 3), good)
    assert good.wait().finish_reason is FinishReason.LENGTH and good.tokens == [3, 4, 5]


def test_close_aborts_what_is_left_and_refuses_new_requests(cluster: StepStandIn) -> None:
    running, waiting = Collected(WAIT_S), Collected(WAIT_S)
    cluster.hold()
    loop = ServingLoop(cluster, max_running=1)
    loop.submit(request([1], 10), running)
    loop.submit(request([2], 10), waiting)
    loop.start()
    wait_steps(cluster, 1)
    closer = threading.Thread(target=loop.close)
    closer.start()
    cluster.let_go()  # the step in progress finishes, then the loop stops
    closer.join(WAIT_S)
    assert not closer.is_alive()
    for got in (running, waiting):
        last = got.wait()
        assert last.finish_reason is FinishReason.ABORT and last.detail == SHUTDOWN_REASON
    assert running.tokens == [2] and waiting.tokens == []
    with pytest.raises(ServingUnavailable, match="closed"):
        loop.submit(request([1], 1), Collected(WAIT_S))


def test_max_running_bounds_a_step_and_the_rest_wait(cluster: StepStandIn) -> None:
    got = [Collected(WAIT_S) for _ in range(5)]
    with serving(cluster, max_running=2) as loop:
        for index, listener in enumerate(got):
            loop.submit(request([index], 2), listener)
        loop.start()
        for listener in got:
            assert listener.wait().finish_reason is FinishReason.LENGTH
    assert [sum(map(len, step.values())) for step in cluster.steps] == [2, 2, 2, 2, 1, 1]
