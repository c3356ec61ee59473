"""The continuous-batching serving loop on a real DP=4 CPU cluster: requests that join and
leave at different steps get exactly the single-process reference's tokens, and a request
a worker cannot compute fails alone while the engines stay healthy."""

from __future__ import annotations

import time

import pytest

from ftengine.faults import HealthStatus
from ftengine.testbed.cluster import Cluster, Generation, RequestAborted
from ftengine.testbed.cluster.serving import ServingLoop
from ftengine.testbed.serving_api import FinishReason, GenerationRequest
from tests.integration.conftest import MAX_TOKENS, PROMPTS, Launcher
from tests.serving_support import Collected

pytestmark = pytest.mark.integration
WAIT_S = 60.0


def wait_steps(cluster: Cluster, count: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while cluster.steps_run < count:
        assert time.monotonic() < deadline, f"only {cluster.steps_run} steps ran"
        time.sleep(0.005)


@pytest.mark.timeout(180)
def test_staggered_requests_get_the_reference_tokens_whatever_the_batch(
    launch: Launcher, reference: list[Generation]
) -> None:
    cluster = launch()
    loop = ServingLoop(cluster).start()
    try:
        got = [Collected(WAIT_S) for _ in PROMPTS]
        lengths = [MAX_TOKENS - (i % 3) for i in range(len(PROMPTS))]
        start = cluster.steps_run
        for index, prompt in enumerate(PROMPTS):
            # Each pair joins two steps after the previous one: prefill and decode mix.
            if index and index % 2 == 0:
                wait_steps(cluster, start + index)
            loop.submit(GenerationRequest(prompt, lengths[index]), got[index])
        for index, listener in enumerate(got):
            last = listener.wait()
            assert last.finish_reason is FinishReason.LENGTH, last
            want = list(reference[index].token_ids[: lengths[index]])
            assert listener.tokens == want, f"prompt {index}"
    finally:
        loop.close()
    assert cluster.steps_run - start < sum(lengths), "requests shared steps"


@pytest.mark.timeout(180)
def test_a_request_a_worker_cannot_compute_fails_alone_and_nothing_turns_unhealthy(
    launch: Launcher, reference: list[Generation]
) -> None:
    """The issue's case, past the API edge: token id 99999 in a 128-token vocabulary."""
    cluster = launch()
    loop = ServingLoop(cluster).start()
    try:
        bad, good = Collected(WAIT_S), Collected(WAIT_S)
        loop.submit(GenerationRequest((1, 2, 99999), 5), bad)
        loop.submit(GenerationRequest(PROMPTS[0], MAX_TOKENS), good)
        last = bad.wait()
        assert last.finish_reason is FinishReason.ERROR and bad.tokens == []
        assert "token id 99999 is outside the vocabulary" in (last.detail or "")
        assert good.wait().finish_reason is FinishReason.LENGTH
        assert good.tokens == list(reference[0].token_ids)
        engines = cluster.status()["engines"]
        assert [e["status"] for e in engines] == [int(HealthStatus.HEALTHY)] * 4
        assert [e["phase"] for e in engines] == ["running"] * 4
        assert not [e for e in cluster.events() if e.kind == "step_failed"]
        again = Collected(WAIT_S)
        loop.submit(GenerationRequest(PROMPTS[1], MAX_TOKENS), again)
        assert again.wait().finish_reason is FinishReason.LENGTH
        assert again.tokens == list(reference[1].token_ids)
    finally:
        loop.close()
    # A synchronous batch with a bad prompt is refused as a whole, and still hurts nobody.
    with pytest.raises(RequestAborted, match="outside the vocabulary"):
        cluster.generate_batch([PROMPTS[2], (1, 2, 99999)], 2)
    assert [e["status"] for e in cluster.status()["engines"]] == [int(HealthStatus.HEALTHY)] * 4
    assert cluster.generate_batch([PROMPTS[2]], MAX_TOKENS)[0].token_ids == reference[2].token_ids
