"""The background request stream records every answer and judges it against the reference."""

from __future__ import annotations

import threading

import pytest

from ftengine.errors import BackendError
from ftengine.testbed.bench.traffic import TrafficStream

PROMPTS = [[1, 2], [3]]
EXPECTED = [[7, 7], [8, 8]]


def test_stream_records_correct_wrong_and_failed_answers() -> None:
    calls: list[list[int]] = []
    enough = threading.Event()

    def generate(prompt: list[int], max_tokens: int) -> list[int]:
        calls.append(prompt)
        if len(calls) >= 6:
            enough.set()
        if len(calls) == 2:
            raise BackendError("recovering")
        if len(calls) == 3:
            return [0] * max_tokens
        return EXPECTED[PROMPTS.index(prompt)][:max_tokens]

    stream = TrafficStream(generate, PROMPTS, EXPECTED, max_tokens=2, backoff_s=0.0).start()
    assert enough.wait(30), "the stream never sent six requests"
    stream.stop()
    samples = stream.samples[:4]
    assert [s.prompt for s in samples] == [0, 1, 0, 1]
    assert [s.correct for s in samples] == [True, False, False, True]
    assert samples[1].error == "BackendError: recovering" and samples[1].tokens == 0
    assert samples[2].error is None and samples[2].tokens == 2
    assert all(s.end >= s.start for s in samples)
    first = stream.first_correct_after(samples[1].start)
    assert first == samples[3]
    sent = len(calls)
    assert len(stream.samples) == sent  # stopped: nothing in flight


def test_stream_needs_one_expected_output_per_prompt() -> None:
    with pytest.raises(ValueError, match="one expected output per prompt"):
        TrafficStream(lambda p, n: [], PROMPTS, EXPECTED[:1], max_tokens=1)
