"""A minority engine's late arrivals (``engine_core/minority.py``): every request added to
its input queue after its fault ends ``abort`` with the partition's reason; anything else
there goes back in order."""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from ftengine.integrations.vllm.engine_core.minority import refuse_late_arrivals

v1 = pytest.importorskip("vllm.v1.engine")


def test_added_requests_are_aborted_with_the_reason_the_rest_goes_back() -> None:
    engine = SimpleNamespace(input_queue=queue.Queue(), output_queue=queue.Queue())
    add, abort = v1.EngineCoreRequestType.ADD, v1.EngineCoreRequestType.ABORT
    late = SimpleNamespace(request_id="r1", client_index=0)
    engine.input_queue.put((abort, ["r0"]))
    engine.input_queue.put((add, (late, 0)))
    refused = refuse_late_arrivals(engine, "network partition: x", time.monotonic() + 0.5,
                                   threading.Event())  # fmt: skip
    assert refused == 1
    client, outputs = engine.output_queue.get_nowait()
    (output,) = outputs.outputs
    assert (client, output.request_id) == (0, "r1")
    assert output.finish_reason == v1.FinishReason.ABORT
    assert output.stop_reason == "network partition: x"
    assert outputs.finished_requests == {"r1"}
    assert engine.input_queue.get_nowait() == (abort, ["r0"])  # kept for the busy loop
    assert engine.input_queue.empty()


def test_it_stops_when_told() -> None:
    engine: Any = SimpleNamespace(input_queue=queue.Queue(), output_queue=queue.Queue())
    stopped = threading.Event()
    stopped.set()
    started = time.monotonic()
    assert refuse_late_arrivals(engine, "why", started + 60, stopped) == 0
    assert time.monotonic() - started < 5
