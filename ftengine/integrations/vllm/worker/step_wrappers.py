"""The vLLM worker's methods, wrapped where vLLM has no hook of its own.

vLLM has no hook for "model loaded", "warmed up" or "model step failed", so the worker's
fault adapter wraps the worker's ``load_model`` (build ftengine's pieces once the model
exists), ``compile_or_warm_up_model`` (op timeouts from then on) and the model steps
(report the exception, then re-raise it for vLLM's own fault path). Instance attributes:
vLLM's classes stay untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

from ftengine.integrations.vllm.shapes import WorkerLike
from ftengine.integrations.vllm.worker.fault_injection import maybe_inject

WRAPPED_STEPS = ("execute_model", "sample_tokens")
WARM_UP = "compile_or_warm_up_model"


class StepListener(Protocol):
    """What the wrappers tell (``adapter.WorkerFaultAdapter``)."""

    def attach(self) -> object: ...

    def serving_started(self) -> None: ...

    def report_exception(self, exc: BaseException) -> None: ...


def wrap_worker(worker: WorkerLike, listener: StepListener) -> None:
    """Build after ``load_model``; serve after the warm-up; report model-step exceptions."""
    load = getattr(worker, "load_model", None)
    if callable(load):
        setattr(worker, "load_model", _then(load, lambda: listener.attach()))  # noqa: B010
    warm_up = getattr(worker, WARM_UP, None)
    if callable(warm_up):
        setattr(worker, WARM_UP, _then(warm_up, lambda: listener.serving_started()))
    for name in WRAPPED_STEPS:
        step = getattr(worker, name, None)
        if callable(step):
            setattr(worker, name, _reporting(step, listener, worker))


def _then(call: Callable[..., Any], after: Callable[[], object]) -> Callable[..., Any]:
    """``call``, then ``after`` once it returned; ``call``'s result."""

    @functools.wraps(call)
    def call_then(*args: Any, **kwargs: Any) -> Any:
        out = call(*args, **kwargs)
        after()
        return out

    return call_then


def _reporting(
    step: Callable[..., Any], listener: StepListener, worker: WorkerLike
) -> Callable[..., Any]:
    rank = worker.parallel_config.data_parallel_rank
    scheduled = step.__name__ == "execute_model"  # its first argument: the SchedulerOutput

    @functools.wraps(step)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            maybe_inject(rank, worker, args[0] if scheduled and args else None)
            return step(*args, **kwargs)
        except Exception as exc:
            listener.report_exception(exc)
            raise

    return run
