"""The vLLM worker's methods, wrapped where vLLM has no hook of its own.

vLLM has no hook for "model loaded", "warmed up" or "model step failed", so the worker's
fault adapter wraps the worker's ``load_model`` (build ftengine's pieces once the model
exists), ``compile_or_warm_up_model`` (op timeouts from then on) and the model steps
(report the exception, then re-raise it for vLLM's own fault path; a peer's collective error
hidden under another exception is raised as ftengine's typed one). Instance attributes:
vLLM's classes stay untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

from ftengine.collective_errors import classify_exception, error_text
from ftengine.errors import BackendError, CollectiveTimeout, PeerDead
from ftengine.faults import FaultKind
from ftengine.integrations.vllm.shapes import WorkerLike
from ftengine.integrations.vllm.worker.fault_injection import maybe_inject

# vLLM's engine core calls execute_dummy_batch on an idle DP rank so that it meets its busy
# peers in the step's collectives: an idle rank learns of a peer's fault there.
WRAPPED_STEPS = ("execute_model", "sample_tokens", "execute_dummy_batch")
INJECTED_STEPS = ("execute_model", "sample_tokens")  # a test's injected fault hits requests
WARM_UP = "compile_or_warm_up_model"
PEER_ERRORS: dict[FaultKind, type[BackendError]] = {
    FaultKind.DEAD_PEER: PeerDead,
    FaultKind.HUNG_PEER: CollectiveTimeout,
}


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
    injects = step.__name__ in INJECTED_STEPS

    @functools.wraps(step)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            if injects:
                maybe_inject(rank, worker, args[0] if scheduled and args else None)
            return step(*args, **kwargs)
        except Exception as exc:
            peer = hidden_peer_error(exc)
            if peer is None:
                listener.report_exception(exc)
                raise
            peer.__cause__ = exc
            listener.report_exception(peer)
            raise peer from exc

    return run


def hidden_peer_error(exc: BaseException) -> BackendError | None:
    """The peer's fault under ``exc``, typed, or None when ``exc`` itself says what it is.

    torch's logging wrapper of a collective on a group vLLM built stateless (every DP group
    a retry rebuilt) raises a ValueError ("not initialized in the world group map") while
    handling gloo's "Connection closed by peer": the worker, and vLLM's engine core, which
    sees only the text, would take it for this rank's own fault. The typed error carries
    the collective's message (its first line), so both see a peer's."""
    if classify_exception(exc) in PEER_ERRORS:
        return None
    inner = exc.__cause__ or exc.__context__
    seen = {id(exc)}
    while inner is not None and id(inner) not in seen:
        seen.add(id(inner))
        error = PEER_ERRORS.get(classify_exception(inner))
        if error is not None:
            return error(error_text(inner))
        inner = inner.__cause__ or inner.__context__
    return None
