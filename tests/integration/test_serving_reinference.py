"""Token-level re-inference on a real DP=4 CPU cluster: a fault mid-generation holds every
in-flight request, and after recovery each continues from its last emitted token with
exactly the single-process reference's tokens (none missing, none repeated); a poison
request is found and ends alone with the documented reason."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ftengine.testbed.cluster import reference_generate
from ftengine.testbed.cluster.serving import ServingLoop
from ftengine.testbed.serving_api import FinishReason, GenerationRequest
from tests.integration.conftest import PROMPTS, Launcher
from tests.integration.test_serving_cluster import WAIT_S, wait_steps
from tests.serving_support import Collected

pytestmark = pytest.mark.integration
LONG = 16


@pytest.mark.timeout(240)
def test_an_injected_fault_and_auto_retry_lose_no_request_and_no_token(
    launch: Launcher, checkpoint: Path
) -> None:
    reference = reference_generate(checkpoint, PROMPTS, LONG)
    cluster = launch(policy="auto", inject_fault="rank=1,step=6,kind=raise")
    loop = ServingLoop(cluster, resumption=cluster.resumption()).start()
    try:
        start = cluster.steps_run
        got = [Collected(WAIT_S) for _ in PROMPTS]
        for index, prompt in enumerate(PROMPTS):
            if index == 3:
                wait_steps(cluster, start + 2)
            loop.submit(GenerationRequest(prompt, LONG), got[index])
        for index, listener in enumerate(got):
            last = listener.wait()
            assert last.finish_reason is FinishReason.LENGTH, last
            assert listener.tokens == list(reference[index].token_ids), f"prompt {index}"
            assert all(len(e.token_ids) <= 1 for e in listener.events)
    finally:
        loop.close()
    assert [e for e in cluster.events() if e.kind == "step_failed"], "no fault happened"


@pytest.mark.timeout(240)
def test_a_poison_request_ends_alone_and_its_batch_mates_finish(
    launch: Launcher, checkpoint: Path
) -> None:
    reference = reference_generate(checkpoint, PROMPTS[:4], LONG)
    # The poison token must be one the good requests never feed, prompt or output.
    used = {t for g in reference for t in g.token_ids} | {t for p in PROMPTS[:4] for t in p}
    token = min(set(range(1, 128)) - used)
    cluster = launch(policy="auto", inject_fault=f"kind=poison,token={token}")
    loop = ServingLoop(cluster, resumption=cluster.resumption()).start()
    try:
        good = [Collected(WAIT_S) for _ in range(4)]
        for index in range(4):
            loop.submit(GenerationRequest(PROMPTS[index], LONG), good[index])
        wait_steps(cluster, cluster.steps_run + 2)
        poison = Collected(WAIT_S)
        loop.submit(GenerationRequest((token, 5, 6), LONG), poison)
        last = poison.wait()
        assert last.finish_reason is FinishReason.ERROR and poison.tokens == []
        assert "poison request" in (last.detail or ""), last
        for index, listener in enumerate(good):
            assert listener.wait().finish_reason is FinishReason.LENGTH
            assert listener.tokens == list(reference[index].token_ids), f"prompt {index}"
    finally:
        loop.close()


@pytest.mark.timeout(240)
def test_sigkill_and_scale_down_resume_the_dead_ranks_requests_on_survivors(
    launch: Launcher, checkpoint: Path
) -> None:
    tokens = 40
    reference = reference_generate(checkpoint, PROMPTS, tokens)
    cluster = launch()
    loop = ServingLoop(cluster, resumption=cluster.resumption()).start()
    try:
        got = [Collected(WAIT_S) for _ in PROMPTS]
        start = cluster.steps_run
        for index, prompt in enumerate(PROMPTS):
            loop.submit(GenerationRequest(prompt, tokens), got[index])
        wait_steps(cluster, start + 4)
        cluster.kill(3, signal.SIGKILL)
        dead = cluster.wait_for(lambda s: s["engines"][3]["status"] == 1, 30.0)
        assert dead is not None, cluster.status()
        assert any(not listener.done.is_set() for listener in got), "all finished before"
        result = cluster.apply("scale_down", {"removed_dp_ranks": [3]}, "reinference-sd")
        assert result.success, result.reason
        for index, listener in enumerate(got):
            last = listener.wait()
            assert last.finish_reason is FinishReason.LENGTH, last
            assert listener.tokens == list(reference[index].token_ids), f"prompt {index}"
    finally:
        loop.close()
