"""A background request stream: sends generation requests back to back, checks each answer
against the reference, and keeps a timestamped record (for the demo and the benchmark).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import attrs

from ftengine.errors import FTEngineError

logger = logging.getLogger(__name__)

Generate = Callable[[list[int], int], list[int]]
"""``(prompt_token_ids, max_tokens) -> new token ids`` (``Cluster.generate``)."""

Ready = Callable[[float], bool]
"""``(timeout_s) -> serving``: waits up to ``timeout_s`` until the cluster serves again."""

READY_CHECK_S = 0.25  # how long one wait for the cluster to serve lasts (stop() waits for it)


@attrs.frozen
class Sample:
    """One request: ``start``/``end`` are ``time.monotonic`` seconds; ``correct`` compares with
    the reference (False on error, and ``error`` then names it)."""

    start: float
    end: float
    prompt: int
    tokens: int
    correct: bool
    error: str | None = None


class TrafficStream:
    """Cycles through ``prompts`` with ``max_tokens`` each, until ``stop()``.

    ``expected[i]`` is the reference continuation of ``prompts[i]``. After an error the
    stream waits ``backoff_s`` before the next request (the cluster is recovering); with
    ``ready`` (e.g. :func:`ftengine.testbed.bench.waits.serving_waiter`) it instead waits until
    ``ready`` says the cluster serves again, so the first request after a recovery is not
    held back by a poll interval (``backoff_s`` still applies when ``ready`` already holds).
    """

    def __init__(
        self,
        generate: Generate,
        prompts: Sequence[list[int]],
        expected: Sequence[list[int]],
        *,
        max_tokens: int,
        backoff_s: float = 0.02,
        ready: Ready | None = None,
    ) -> None:
        if len(prompts) != len(expected) or not prompts:
            raise ValueError(
                f"need one expected output per prompt, got {len(prompts)} prompts and "
                f"{len(expected)} outputs"
            )
        self._generate = generate
        self._prompts = [list(p) for p in prompts]
        self._expected = [list(e) for e in expected]
        self._max_tokens = max_tokens
        self._backoff_s = backoff_s
        self._ready = ready
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._samples: list[Sample] = []
        self._thread = threading.Thread(target=self._loop, name="ftengine-traffic", daemon=True)

    def start(self) -> TrafficStream:
        """Start sending (returns self)."""
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop after the request in flight; waits up to ``timeout_s`` for it."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def samples(self) -> list[Sample]:
        """Every finished request so far, oldest first."""
        with self._lock:
            return list(self._samples)

    def first_correct_after(self, moment: float) -> Sample | None:
        """The first correct answer to a request sent at or after ``moment``."""
        return next((s for s in self.samples if s.start >= moment and s.correct), None)

    def _loop(self) -> None:
        index = 0
        while not self._stop.is_set():
            sample = self._one(index % len(self._prompts))
            with self._lock:
                self._samples.append(sample)
            index += 1
            if sample.error is not None:
                self._pause()

    def _pause(self) -> None:
        """Wait before retrying after an error: until ``ready`` holds, or ``backoff_s``."""
        ready = self._ready
        if ready is None or ready(0.0):
            self._stop.wait(self._backoff_s)
            return
        while not self._stop.is_set() and not ready(READY_CHECK_S):
            pass

    def _one(self, index: int) -> Sample:
        start = time.monotonic()
        try:
            tokens = self._generate(list(self._prompts[index]), self._max_tokens)
        except FTEngineError as exc:
            return Sample(start, time.monotonic(), index, 0, False, f"{type(exc).__name__}: {exc}")
        end = time.monotonic()
        return Sample(start, end, index, len(tokens), list(tokens) == self._expected[index])


def tokens_per_second(
    samples: Sequence[Sample], *, start: float, end: float, bin_s: float = 0.5
) -> list[tuple[float, float]]:
    """Correct tokens per second in bins of ``bin_s`` over [start, end): ``(bin start, rate)``.

    A request's tokens are credited to the bin its answer arrived in; bins start at
    ``start`` (times are offsets from it).
    """
    if bin_s <= 0 or end <= start:
        raise ValueError(f"need bin_s > 0 and end > start, got {bin_s}, [{start}, {end})")
    count = max(1, int((end - start) / bin_s + 0.999999))
    totals = [0.0] * count
    for sample in samples:
        if sample.correct and start <= sample.end < end:
            totals[int((sample.end - start) / bin_s)] += sample.tokens
    return [(index * bin_s, total / bin_s) for index, total in enumerate(totals)]
