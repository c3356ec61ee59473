"""Tests' fault injection into a vLLM worker's model steps (``$FTENGINE_VLLM_FAULT_FILE``).

A file there holding DP rank R makes R's next model step that runs a request raise (once: the
file is removed; the empty step that only tells the worker which requests finished, which can
run after a client has its answer, is no such step);
one holding ``token:T`` makes every model step that runs a request whose prompt holds token
id T, once it has emitted a token, raise, on any rank, for as long as the file exists (a
poison request: its first token streams, then its every step faults, re-runs included).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ftengine.integrations.vllm.shapes import WorkerLike

FAULT_FILE_ENV = "FTENGINE_VLLM_FAULT_FILE"
"""Where the fault file is looked for (see the module's docstring)."""
POISON_PREFIX = "token:"


def maybe_inject(rank: int, worker: WorkerLike, scheduler_output: Any) -> None:
    """Raise if ``$FTENGINE_VLLM_FAULT_FILE`` exists and names this DP rank (once) or a
    token in the prompt of a request this step runs (tests)."""
    path = os.environ.get(FAULT_FILE_ENV)
    if not path or not os.path.exists(path):
        return
    try:
        with open(path) as handle:
            target = handle.read().strip()
        if target.startswith(POISON_PREFIX):
            _maybe_poison(worker, scheduler_output, target, path)
            return
        if target != str(rank) or _empty(scheduler_output):
            return
        os.unlink(path)
    except OSError:
        return  # another step raced us to it
    raise RuntimeError(f"[FT] fault injected on DP rank {rank} ({FAULT_FILE_ENV}={path})")


def _empty(scheduler_output: Any) -> bool:
    """A ``SchedulerOutput`` that runs no request (``sample_tokens``, None: runs only after
    a step that did)."""
    return scheduler_output is not None and scheduler_output.total_num_scheduled_tokens == 0


def _maybe_poison(worker: WorkerLike, scheduler_output: Any, target: str, path: str) -> None:
    """Raise if a request ``scheduler_output`` runs has emitted a token and has the poison
    token in its prompt."""
    try:
        token = int(target.removeprefix(POISON_PREFIX))
    except ValueError as exc:
        raise ValueError(
            f"{FAULT_FILE_ENV}={path}: expected a DP rank or {POISON_PREFIX}<token id>, "
            f"found {target!r}"
        ) from exc
    for request_id, prompt in scheduled_decodes(worker, scheduler_output).items():
        if token in prompt:
            raise RuntimeError(
                f"[FT] fault injected: poison token {token} in the prompt of request "
                f"{request_id} ({FAULT_FILE_ENV}={path})"
            )


def scheduled_decodes(worker: WorkerLike, scheduler_output: Any) -> dict[str, Sequence[int]]:
    """The prompt token ids of each request a vLLM ``SchedulerOutput`` runs that has emitted
    a token already (decoding, or resumed after a fault): vLLM sends those as cached
    requests, with their output counts; their prompts are in the model runner's states."""
    if scheduler_output is None:
        return {}
    cached = scheduler_output.scheduled_cached_reqs
    states = getattr(getattr(worker, "model_runner", None), "requests", {})
    return {
        request_id: getattr(states.get(request_id), "prompt_token_ids", None) or ()
        for request_id, emitted in zip(cached.req_ids, cached.num_output_tokens, strict=True)
        if emitted > 0
    }
