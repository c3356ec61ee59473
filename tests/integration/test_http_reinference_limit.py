"""The re-inference limit on a real cluster with ``--max-reinference 1``, through HTTP, with
a fault pattern the poison probe does not catch first: two different faults, an injected
transient error on rank 1 (answered by ``retry``) and then a SIGKILL of rank 3 (answered by
``scale_down``), both strike the same concurrent streams. No request's own content faults
(the probe finds nothing), yet the requests that ran in both faulted steps have been re-run
past the limit: each ends ``abort`` with the limit's message in ``stop_reason``, having
streamed only reference tokens, and every other stream ends exact."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftengine.testbed.cluster import reference_generate
from ftengine.weights.checkpoint_gen import make_checkpoint
from tests.integration.serve_support import MODEL, SIZES, Server, Starter
from tests.integration.test_http_reinference import (
    FAULT_STEP,
    PROMPTS,
    STREAM_TIMEOUT_S,
    TOKENS,
    command,
)
from tests.stream_support import OpenAIStream

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("reinference-limit-ckpt") / "model", **SIZES)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[Server]:
    starter = Starter(tmp_path_factory.mktemp("reinference-limit-serve"), checkpoint)
    try:
        yield starter(
            "--max-reinference", "1", "--inject-fault", f"rank=1,step={FAULT_STEP},kind=raise"
        )
    finally:
        starter.stop_all()


@pytest.mark.timeout(300)
def test_requests_in_two_faulted_steps_are_aborted_past_max_reinference_one(
    server: Server, checkpoint: Path
) -> None:
    reference = [list(g.token_ids) for g in reference_generate(checkpoint, PROMPTS, TOKENS)]
    streams = [OpenAIStream(server.url, MODEL, p, TOKENS, STREAM_TIMEOUT_S) for p in PROMPTS]
    for stream in streams:
        stream.start()
    server.wait(lambda e: all(x["status"] == "unhealthy" for x in e.values()), 60)
    command(server, "retry", {}, "limit-retry")
    at_retry = max(len(s.tokens) for s in streams)
    deadline = time.monotonic() + 60
    while not all(len(s.tokens) >= at_retry + 2 for s in streams):  # every one ran again
        assert time.monotonic() < deadline and all(s.is_alive() for s in streams), [
            (len(s.tokens), s.finish_reason) for s in streams
        ]
        time.sleep(0.01)
    pid = server.engines()[3]["pid"]
    assert pid in server.descendants  # only ever our own server's worker
    os.kill(pid, signal.SIGKILL)
    server.wait(lambda e: e[3]["status"] == "dead", 60)
    command(server, "scale_down", {"removed_dp_ranks": [3]}, "limit-scale-down")
    aborted = 0
    for stream, want in zip(streams, reference, strict=True):
        stream.finish()
        assert stream.tokens == want[: len(stream.tokens)], (stream.prompt, stream.chunks)
        if stream.finish_reason == "length":
            assert stream.tokens == want
            continue
        assert stream.finish_reason == "abort", (stream.prompt, stream.finish_reason)
        reason = str(stream.stop_reason)
        assert reason.startswith("re-inference limit reached: the request was in 2 faulted")
        assert "at most 1 times (max_reinference)" in reason
        aborted += 1
    assert aborted > 0, "no request was over the limit: the test did not exercise it"
