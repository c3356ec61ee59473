"""A streaming completion through the official ``openai`` client, in its own thread, for
the re-inference tests (``ftengine serve`` and ``vllm serve`` alike): every chunk's token
ids as they came and when, the finish reason, the stop reason (where an abort says why), the
error."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any


class OpenAIStream(threading.Thread):
    """One greedy streaming completion of ``tokens`` tokens (EOS ignored, token ids back)."""

    def __init__(self, url: str, model: str, prompt: list[int], tokens: int, timeout_s: float):
        super().__init__(daemon=True)
        import openai

        self.client = openai.OpenAI(
            base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=timeout_s
        )
        self.model, self.prompt, self.max_tokens, self.timeout_s = model, prompt, tokens, timeout_s
        self.chunks: list[list[int]] = []
        self.arrivals: list[float] = []  # time.monotonic() of each chunk, as it came
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            chunks = self.client.completions.create(
                model=self.model, prompt=self.prompt, max_tokens=self.max_tokens, stream=True,
                temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            for chunk in chunks:
                self.arrivals.append(time.monotonic())
                for choice in chunk.choices:
                    extra = choice.model_extra or {}
                    self.chunks.append(list(extra.get("token_ids") or []))
                    self.finish_reason = choice.finish_reason or self.finish_reason
                    self.stop_reason = extra.get("stop_reason") or self.stop_reason
        except BaseException as exc:  # reported by the test, in its own thread
            self.error = exc

    @property
    def tokens(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk]

    @property
    def longest_wait_s(self) -> float:
        """The longest wait between two chunks in a row (seconds; 0 before the second)."""
        return max((b - a for a, b in itertools.pairwise(self.arrivals)), default=0.0)

    def finish(self) -> None:
        """Ended within the timeout, without a transport error."""
        self.join(self.timeout_s)
        assert not self.is_alive(), f"stream {self.prompt} never finished: {self.tokens}"
        assert self.error is None, f"stream {self.prompt} failed: {self.error!r}"
