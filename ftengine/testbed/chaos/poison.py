"""The real-vLLM campaign's poison request: a completion whose prompt holds the token the
fault file's ``token:T`` keys on (``integrations/vllm/worker/fault_injection.py``), so every
model step that runs it after its first token raises, on whichever rank runs it, re-runs
included. ftengine must retry its rank's fault, re-run it alone, and end it alone with a
reason naming it, while every other stream finishes exactly; it must never hang nor be
answered (its steps cannot complete)."""

from __future__ import annotations

import threading
import time

import openai

from ftengine.testbed.chaos.traffic import PROMPTS, StreamRecord, Traffic

POISON_TOKEN = 42
"""A token id in no campaign prompt (checked at import) nor, the reference shows, any
greedy answer of the tiny checkpoint."""
POISON_PROMPT = (7, POISON_TOKEN, 8)
POISON_WORD = "poison"  # what the reason of its end names (``engine_core/poison.py``)

if any(POISON_TOKEN in prompt for prompt in PROMPTS):
    raise AssertionError(f"the poison token {POISON_TOKEN} is in a campaign prompt")


def fault_file_text() -> str:
    """What the fault file holds while a poison request runs."""
    return f"token:{POISON_TOKEN}"


class PoisonRequest:
    """One poison completion streamed to ``url`` on a thread of its own (``max_tokens``,
    greedy, at most ``timeout_s``); :attr:`record` is how it ended."""

    def __init__(self, fault: int, rank: int, url: str, max_tokens: int, timeout_s: float):
        self.fault, self.rank, self.url = fault, rank, url
        self.record = StreamRecord(client=-1, prompt=-1, started=time.monotonic())
        self.done = threading.Event()
        self._body = {
            "model": "chaos", "prompt": list(POISON_PROMPT), "max_tokens": max_tokens,
            "stream": True, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
        }  # fmt: skip
        self._timeout_s = timeout_s
        self._thread = threading.Thread(target=self._run, name="chaos-poison", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with openai.DefaultHttpxClient(timeout=self._timeout_s) as http:
                Traffic.attempt(http, self.url, self._body, self.record)
        finally:
            self.record.ended = time.monotonic()
            self.done.set()

    def problems(self) -> list[str]:
        """What is wrong with how it ended (``name: detail``): it must have ended, not run
        to its length, and ended saying it was poison."""
        record = self.record
        if not self.done.is_set():
            return [f"hang: the poison request of fault #{self.fault} never ended"]
        why = f"{record.stop_reason or ''} {record.error or ''}"
        if record.finish_reason == "length":
            return [f"poison_request: answered in full ({len(record.tokens)} tokens)"]
        if record.finish_reason in ("abort", "error") and POISON_WORD in why:
            return []
        return [
            f"poison_request: ended {record.finish_reason!r} without naming the poison: "
            f"stop_reason {record.stop_reason!r} error {record.error!r}"
        ]

    def to_dict(self) -> dict[str, object]:
        record = self.record
        return {
            "fault": self.fault,
            "rank": self.rank,
            "tokens": len(record.tokens),
            "finish_reason": record.finish_reason,
            "stop_reason": record.stop_reason,
            "error": record.error,
            "s": None if record.ended is None else round(record.ended - record.started, 3),
        }
